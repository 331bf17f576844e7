"""docker-compose.yml (the GPU deployment): the Compose specification's schema, and what it must mean.

No Docker engine is needed: the file is checked against the vendored Compose
JSON schema (tests/schemas/compose-spec.json), before and after variable
interpolation, and against the code it runs — every ``SPECGATE_*`` variable a
container gets must be a field of the settings class that reads it (and parse
there), every ``specgate`` command line must parse with the real CLI, the two
vLLM variants must carry the per-request metrics flags, ports must not collide. The profile ``pools``
(replica pools behind a gateway) must leave the default shape as it is, put its servers on GPUs of their own,
start them like the twins, and give the gateway settings that name them.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import typer
import yaml
from pydantic_settings import BaseSettings

from controlplane.settings import ControlPlaneSettings
from dashboard.settings import DashboardSettings
from sidecar.settings import SidecarSettings
from specgate.cli import app
from tests.support import paths
from tests.support.deploy import VARIABLE, flags_of, interpolate, parse_cli, sidecar_settings_of

ROOT = paths.ROOT
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
SCHEMA = Path(__file__).resolve().parent / "schemas" / "compose-spec.json"
# typer may bring its own copy of click, so the click types are reached through typer
UsageError: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
SPECGATE_SERVICES = ("controlplane-init", "controlplane", "policy-init", "dashboard", "sidecar", "loadgen", "gateway")
VLLM_SERVICES = ("vllm-spec", "vllm-plain")
# profile pools: a speculative and a plain server, each on a GPU of its own, behind a gateway
POOL_SERVICES = ("vllm-spec-pool", "vllm-plain-pool")
# what `docker compose up` starts: the twin shape, exactly as before the pools profile existed
DEFAULT_SHAPE = {"postgres", "controlplane-init", "controlplane", "policy-init", "dashboard", *VLLM_SERVICES,
                 "sidecar", "otel-collector"}

# --- Compose variable interpolation (tests/support/deploy.py) ----------------------------------


def references(node: Any) -> Iterator[re.Match[str]]:
    if isinstance(node, str):
        for match in VARIABLE.finditer(node):
            if match.group("braced") or match.group("named"):
                yield match
    elif isinstance(node, list):
        for item in node:
            yield from references(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from references(value)


def env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f".env.example: {line!r} is not KEY=VALUE"
            assert key not in values, f".env.example sets {key} twice"
            values[key] = value
    return values


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose(raw: dict[str, Any]) -> dict[str, Any]:
    """The file as ``docker compose up`` sees it with no .env: every default applied."""
    return interpolate(raw, {})


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA.read_text())


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command") or []
    return shlex.split(command) if isinstance(command, str) else list(command)


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def _script(service: dict[str, Any]) -> str:
    """The whole command as one text (a ``sh -c`` script or an argument list)."""
    command = _command(service)
    if command[:2] == ["sh", "-c"]:
        return command[2]
    return shlex.join(command)


def specgate_invocations(service: dict[str, Any]) -> list[list[str]]:
    """Every ``specgate ...`` command line a service runs, as argument lists (without ``specgate``)."""
    command = _command(service)
    if command[:2] != ["sh", "-c"]:
        return [command[1:]] if command and command[0] == "specgate" else []
    found = []
    for segment in re.split(r";|\|\||&&|\bthen\b|\bfi\b", command[2]):
        words = shlex.split(segment.split(">")[0])
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value prefixes
            words.pop(0)
        if words[:1] == ["exec"]:
            words.pop(0)
        if words[:1] == ["specgate"]:
            found.append(words[1:])
    return found


# --- the Compose specification -------------------------------------------------------------


def test_the_file_validates_against_the_compose_schema(raw: dict[str, Any], compose: dict[str, Any],
                                                       schema: dict[str, Any]) -> None:
    validator = jsonschema.Draft7Validator(schema)
    for document in (raw, compose, interpolate(raw, env_example())):
        errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
        assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_the_schema_catches_mistakes(raw: dict[str, Any], schema: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(raw))
    broken["services"]["sidecar"]["depends_on"]["controlplane"]["condition"] = "service_ready"
    broken["services"]["postgres"]["healthcheck"]["intervall"] = "5s"
    broken["services"]["dashboard"]["portz"] = []
    errors = list(jsonschema.Draft7Validator(schema).iter_errors(broken))
    assert len(errors) >= 3


def test_every_variable_has_a_default_and_is_in_env_example(raw: dict[str, Any]) -> None:
    example = env_example()
    used: dict[str, set[str]] = {}
    for match in references(raw):
        name = match.group("braced") or match.group("named")
        assert match.group("braced"), f"${name}: use ${{{name}:-default}}, so the default is visible"
        assert match.group("op") in (":-", "-"), f"${{{name}}} has no default: a bare `docker compose up` must work"
        used.setdefault(name, set()).add(match.group("arg") or "")
    assert set(used) == set(example), (f"only in docker-compose.yml: {sorted(set(used) - set(example))}; "
                                       f"only in .env.example: {sorted(set(example) - set(used))}")
    for name, defaults in used.items():
        assert defaults == {example[name]}, f"{name}: compose defaults {defaults} != .env.example {example[name]!r}"


def test_services_volumes_and_dependencies_hang_together(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(SPECGATE_SERVICES + VLLM_SERVICES + ("postgres", "otel-collector")) <= set(services)
    for name, service in services.items():
        for target, rule in (service.get("depends_on") or {}).items():
            assert target in services, f"{name} depends on unknown service {target}"
            if rule["condition"] == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target} to be healthy: no healthcheck"
            if rule["condition"] == "service_completed_successfully":
                assert services[target].get("restart") == "no", f"{target} is one-shot: restart must be 'no'"
        for volume in service.get("volumes") or []:
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repository"
            else:
                assert source in compose["volumes"], f"{name} uses volume {source}, not declared"
    # long-running services report health, so that dependants and operators can wait on them
    for name in ("postgres", "controlplane", "dashboard", "sidecar", *VLLM_SERVICES, "gateway", *POOL_SERVICES):
        assert "healthcheck" in services[name], name


def test_host_ports_do_not_collide(compose: dict[str, Any]) -> None:
    seen: dict[int, str] = {}
    for name, service in compose["services"].items():
        for mapping in service.get("ports") or []:
            parts = str(mapping).split(":")
            assert len(parts) == 3, f"{name}: publish {mapping} with an explicit bind address"
            host = int(parts[1])
            assert host not in seen, f"host port {host} is published by {seen[host]} and {name}"
            seen[host] = name
    assert len(seen) >= 6


# --- what the specgate containers read ---------------------------------------------------------

# The settings class that reads a container's SPECGATE_* variables, by the specgate command it runs.
READERS: dict[str, type[BaseSettings]] = {"serve": ControlPlaneSettings, "db": ControlPlaneSettings,
                                          "keys": ControlPlaneSettings, "sidecar": SidecarSettings,
                                          "dashboard": DashboardSettings}


def _cli_envvars() -> set[str]:
    """Every environment variable a command-line option of ``specgate`` reads (SPECGATE_URL, SPECGATE_KEY, ...)."""
    names: set[str] = set()

    def walk(command: Any) -> None:
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            if envvar:
                names.update([envvar] if isinstance(envvar, str) else envvar)
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(typer.main.get_command(app))
    return names


def _fields(settings: type[BaseSettings]) -> set[str]:
    prefix = settings.model_config.get("env_prefix", "")
    return {(prefix + name).upper() for name in settings.model_fields}


@pytest.mark.parametrize("name", SPECGATE_SERVICES)
def test_specgate_variables_are_settings_the_container_reads(compose: dict[str, Any], name: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    service = compose["services"][name]
    env = _env(service)
    commands = {args[0] for args in specgate_invocations(service)}
    assert commands, f"{name} runs no specgate command"
    readers = {READERS[c] for c in commands if c in READERS}
    known = set().union(*(_fields(r) for r in readers)) | _cli_envvars()
    script = _script(service)
    for key in env:
        if key.startswith("SPECGATE_"):
            assert key in known, f"{name}: {key} is read by none of {sorted(commands)} (a typo, or a stale setting)"
        elif not key.startswith("OTEL_"):
            assert f"${key}" in script or "${" + key in script, f"{name}: {key} is set but its command never uses it"
    # and the values parse where they are read
    for variable in list(__import__("os").environ):
        if variable.startswith("SPECGATE_"):
            monkeypatch.delenv(variable)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for reader in readers:
        reader()


def _assert_engines_are_served(services: dict[str, Any], engines: dict[str, list[str]]) -> None:
    """Every replica URL names a service of the file, on the port its vLLM server listens on."""
    for urls in engines.values():
        for url in urls:
            target = services[urlsplit(url).hostname or ""]
            command = _command(target)
            assert command[command.index("--port") + 1] == str(urlsplit(url).port), url


def test_the_sidecar_reaches_the_engines_control_plane_and_collector(compose: dict[str, Any],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose["services"]
    sidecar_env = _env(services["sidecar"])
    for key, value in sidecar_env.items():
        monkeypatch.setenv(key, value)
    settings = SidecarSettings()
    assert settings.kind == "worker"
    assert not settings.replica_scope  # the twin engines share one GPU: a rule's batch is the worker's
    assert settings.engines == {"base": ["http://vllm-plain:8000"], "draft": ["http://vllm-spec:8000"]}
    _assert_engines_are_served(services, settings.engines)
    # the control plane: host and port as it serves them
    control = urlsplit(settings.control_plane)
    serve = _command(services["controlplane"])
    assert control.hostname == "controlplane"
    assert serve[serve.index("--port") + 1] == str(control.port)
    assert urlsplit(_env(services["dashboard"])["SPECGATE_DASHBOARD_API_URL"]).netloc == control.netloc
    assert urlsplit(_env(services["policy-init"])["SPECGATE_URL"]).netloc == control.netloc
    # it listens where its port is published, and where the load generator sends
    listen_port = settings.listen.rpartition(":")[2]
    assert services["sidecar"]["ports"][0].rsplit(":", 1)[1] == listen_port
    loadgen = _command(services["loadgen"])
    assert urlsplit(loadgen[loadgen.index("--url") + 1]).port == int(listen_port)
    # OpenTelemetry goes to the collector's OTLP/HTTP receiver
    otlp = urlsplit(sidecar_env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert otlp.hostname == "otel-collector"
    collector = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    assert collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"] == f"0.0.0.0:{otlp.port}"


def test_the_bootstrap_policy_names_the_sidecars_engines(compose: dict[str, Any],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from policies import load_policy

    policy_file = _env(compose["services"]["policy-init"])["BOOTSTRAP_POLICY"]
    document = load_policy((ROOT / policy_file).read_text())
    for key, value in _env(compose["services"]["sidecar"]).items():
        monkeypatch.setenv(key, value)
    assert set(document.engines) <= set(SidecarSettings().engines)


@pytest.mark.parametrize("name", SPECGATE_SERVICES)
def test_specgate_command_lines_parse(compose: dict[str, Any], name: str) -> None:
    root: Any = typer.main.get_command(app)
    for args in specgate_invocations(compose["services"][name]):
        assert args[0] in root.commands, f"`specgate {args[0]}` is not a command"
        parse_cli(args)


def test_a_bad_command_line_would_be_caught() -> None:
    with pytest.raises(UsageError):
        parse_cli(["serve", "--no-such-flag"])
    with pytest.raises(UsageError):
        parse_cli(["keys", "create", "--scope", "root", "--name", "x"])


def test_migrations_run_before_the_control_plane_serves(compose: dict[str, Any]) -> None:
    services = compose["services"]
    init = specgate_invocations(services["controlplane-init"])
    assert init[0] == ["db", "upgrade"]
    assert [args[:3] for args in init[1:]] == [["keys", "create", "--scope"]] * 2
    assert specgate_invocations(services["controlplane"]) == [
        ["serve", "--host", "0.0.0.0", "--port", "8080", "--no-migrate"]]
    assert services["controlplane"]["depends_on"]["controlplane-init"]["condition"] == \
        "service_completed_successfully"


# --- the two vLLM variants -----------------------------------------------------------------------


def test_the_vllm_variants(compose: dict[str, Any]) -> None:
    services = compose["services"]
    spec, plain = (services[name] for name in VLLM_SERVICES)
    for service in (spec, plain):
        assert service["image"].startswith("vllm/vllm-openai:")
        assert service["entrypoint"] == ["vllm", "serve"]
        reservation = service["deploy"]["resources"]["reservations"]["devices"][0]
        assert reservation["capabilities"] == ["gpu"]
    spec_flags, plain_flags = flags_of(_command(spec)), flags_of(_command(plain))
    # one model, served under one name, on one GPU
    assert _command(spec)[0] == _command(plain)[0]
    assert spec_flags["--served-model-name"] == plain_flags["--served-model-name"]
    assert spec["deploy"] == plain["deploy"]
    # split the GPU's memory
    shares = [float(flags["--gpu-memory-utilization"] or "nan") for flags in (spec_flags, plain_flags)]
    assert all(0.1 <= share <= 0.6 for share in shares)
    assert sum(shares) <= 0.95
    # per-request metrics: speculative ones only where speculation is on (else vLLM refuses to start)
    assert "--enable-per-request-metrics" in spec_flags
    assert "--enable-per-request-metrics" in plain_flags
    assert spec_flags["--per-request-spec-decode-metrics"] == "summary"
    assert "--per-request-spec-decode-metrics" not in plain_flags
    assert "--speculative-config" not in plain_flags
    config = json.loads(spec_flags["--speculative-config"] or "")
    assert config["method"] in ("draft_model", "ngram", "eagle", "eagle3", "mtp")
    assert isinstance(config["num_speculative_tokens"], int)
    assert 1 <= config["num_speculative_tokens"] <= 16
    # started one after the other, so each sizes its KV cache from what the other left
    assert plain["depends_on"]["vllm-spec"]["condition"] == "service_healthy"


def test_the_speculative_config_follows_its_variables(raw: dict[str, Any]) -> None:
    env = {"SPEC_METHOD": "ngram", "SPEC_NUM_TOKENS": "5", "SPEC_DRAFT_MODEL": "org/small"}
    command = _command(interpolate(raw, env)["services"]["vllm-spec"])
    config = json.loads(command[command.index("--speculative-config") + 1])
    assert config == {"method": "ngram", "model": "org/small", "num_speculative_tokens": 5}


# --- profile pools: replica pools behind a gateway ------------------------------------------------


def _profiles(service: dict[str, Any]) -> set[str]:
    return set(service.get("profiles") or [])


def _closure(services: dict[str, Any], names: tuple[str, ...]) -> set[str]:
    """What ``docker compose up NAMES`` starts: the named services and, transitively, what they depend on."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(services[name].get("depends_on") or {})
    return seen


def test_the_profiles_leave_the_default_shape_as_it_was(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {name for name, service in services.items() if not _profiles(service)} == DEFAULT_SHAPE
    assert {name for name, service in services.items() if "pools" in _profiles(service)} == \
        {"gateway", *POOL_SERVICES}
    assert _profiles(services["loadgen"]) == {"loadgen"}
    # a default service that waited on a profiled one would drag it into a plain `docker compose up`
    for name in DEFAULT_SHAPE:
        assert set(services[name].get("depends_on") or {}) <= DEFAULT_SHAPE, name


def test_naming_the_gateway_brings_up_the_pools_shape_without_the_twin(compose: dict[str, Any]) -> None:
    """docs/deploy-gpu.md: `docker compose --profile pools up -d gateway dashboard`."""
    started = _closure(compose["services"], ("gateway", "dashboard"))
    assert started == {"postgres", "controlplane-init", "controlplane", "policy-init", "dashboard",
                       "otel-collector", "gateway", *POOL_SERVICES}
    assert not started & {"sidecar", *VLLM_SERVICES}


def _gateway_settings(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> SidecarSettings:
    gateway = compose["services"]["gateway"]
    return sidecar_settings_of(_command(gateway), _env(gateway), monkeypatch)


def test_the_gateway_routes_to_the_pool_servers(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose["services"]
    settings = _gateway_settings(compose, monkeypatch)
    assert settings.kind == "gateway"
    assert settings.replica_scope  # a rule's batch is the least-loaded healthy replica's
    assert settings.engines == {"base": ["http://vllm-plain-pool:8000"], "draft": ["http://vllm-spec-pool:8000"]}
    _assert_engines_are_served(services, settings.engines)
    assert "--speculative-config" in _command(services["vllm-spec-pool"])
    assert "--speculative-config" not in _command(services["vllm-plain-pool"])
    # the control plane, the collector, the key's pool and a worker id of its own
    sidecar_env, gateway_env = _env(services["sidecar"]), _env(services["gateway"])
    assert settings.control_plane == sidecar_env["SPECGATE_CONTROL_PLANE"]
    assert gateway_env["OTEL_EXPORTER_OTLP_ENDPOINT"] == sidecar_env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert settings.pool == _env(services["controlplane-init"])["WORKER_POOL"]
    assert settings.worker_id
    assert settings.worker_id != sidecar_env["SPECGATE_WORKER_ID"]
    assert services["gateway"]["ports"][0].rsplit(":", 1)[1] == settings.listen.rpartition(":")[2]
    # the bootstrap policy's engines are the gateway's
    from policies import load_policy

    policy = load_policy((ROOT / _env(services["policy-init"])["BOOTSTRAP_POLICY"]).read_text())
    assert set(policy.engines) <= set(settings.engines)


def test_the_gateway_follows_the_speculative_engines_name(raw: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    settings = _gateway_settings(interpolate(raw, {"SPEC_ENGINE_NAME": "ngram"}), monkeypatch)
    assert set(settings.engines) == {"base", "ngram"}


def pool_problems(services: dict[str, Any]) -> list[str]:
    """What would make the pools shape wrong: shared GPUs, a server that is not the twin's, a bad memory share."""
    problems = []
    devices = {}
    for name in POOL_SERVICES:
        reservations = services[name]["deploy"]["resources"]["reservations"]["devices"]
        ids = [device_id for reservation in reservations for device_id in reservation.get("device_ids", [])]
        if len(ids) != 1:
            problems.append(f"{name}: one GPU each, got {ids}")
        devices[name] = tuple(ids)
        share = float(flags_of(_command(services[name])).get("--gpu-memory-utilization") or "nan")
        if not 0.5 <= share <= 0.95:
            problems.append(f"{name}: --gpu-memory-utilization {share} (the GPU is its own: 0.5 to 0.95)")
    if len(set(devices.values())) != len(devices):
        problems.append(f"the pool servers share a GPU: {devices}")
    # the same servers as the twin shape's, memory share aside
    for pool, twin in zip(POOL_SERVICES, VLLM_SERVICES, strict=True):
        pool_flags, twin_flags = flags_of(_command(services[pool])), flags_of(_command(services[twin]))
        pool_flags.pop("--gpu-memory-utilization", None)
        twin_flags.pop("--gpu-memory-utilization", None)
        if _command(services[pool])[0] != _command(services[twin])[0] or pool_flags != twin_flags:
            problems.append(f"{pool} is not started like {twin}: {pool_flags} != {twin_flags}")
        for key in ("image", "entrypoint", "ipc", "volumes", "environment", "healthcheck"):
            if services[pool].get(key) != services[twin].get(key):
                problems.append(f"{pool}: {key} differs from {twin}'s")
    return problems


def test_the_pool_servers_each_have_a_gpu_and_start_like_the_twins(raw: dict[str, Any],
                                                                   compose: dict[str, Any]) -> None:
    assert pool_problems(compose["services"]) == []
    assert pool_problems(interpolate(raw, env_example())["services"]) == []
    overridden = interpolate(raw, {"GPU_DEVICE_SPEC": "2", "GPU_DEVICE_PLAIN": "3", "SPEC_NUM_TOKENS": "5"})
    assert pool_problems(overridden["services"]) == []


def test_a_broken_pools_shape_would_be_caught(raw: dict[str, Any], compose: dict[str, Any]) -> None:
    assert any("share a GPU" in p for p in pool_problems(interpolate(raw, {"GPU_DEVICE_PLAIN": "0"})["services"]))
    assert any("--gpu-memory-utilization" in p
               for p in pool_problems(interpolate(raw, {"VLLM_POOL_GPU_MEMORY_UTILIZATION": "0.99"})["services"]))
    broken = json.loads(json.dumps(compose))
    broken["services"]["vllm-spec-pool"]["command"].remove("--enable-per-request-metrics")
    assert any("not started like vllm-spec" in p for p in pool_problems(broken["services"]))
    broken = json.loads(json.dumps(compose))
    del broken["services"]["vllm-plain-pool"]["healthcheck"]
    assert any("healthcheck" in p for p in pool_problems(broken["services"]))


def test_the_collector_config_is_complete() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    assert "otlp" in config["receivers"]
    assert {"debug", "prometheus"} <= set(config["exporters"])
    for pipeline in config["service"]["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in config[kind], f"pipeline uses undefined {kind[:-1]} {component}"
    assert config["exporters"]["prometheus"]["endpoint"].endswith(":8889")


def test_the_image_builds_from_python_slim_and_installs_the_project() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\s*$", dockerfile, re.MULTILINE)
    assert re.search(r"pip install .*\.", dockerfile)
    assert "COPY . ." in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".env"} <= set(ignored)


# --- who can read which key ------------------------------------------------------------------------

# The services that may mount each key: the init job that writes it, and the one service that uses it.
# The gateway is a worker too (it registers with the same worker key, bound to the same pool) and faces clients.
KEY_USERS = {"admin.key": {"controlplane-init", "policy-init"},
             "worker.key": {"controlplane-init", "sidecar", "gateway"}}


def _mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each volume or bind mount of a service (short syntax)."""
    return [(volume.split(":")[0], volume.split(":")[1]) for volume in service.get("volumes") or []]


def _key_files(compose: dict[str, Any]) -> dict[str, str]:
    """key file name -> the path controlplane-init writes it to."""
    written = re.findall(r">\s*(\S+\.key)\b", _script(compose["services"]["controlplane-init"]))
    return {Path(path).name: path for path in written}


def _volume_holding(service: dict[str, Any], path: str) -> str:
    """The source of the service's mount that ``path`` lies in (the deepest one)."""
    holding = [(target, source) for source, target in _mounts(service)
               if path == target or path.startswith(target.rstrip("/") + "/")]
    assert holding, f"{path} is on no mount: the key would vanish with the container"
    return max(holding)[1]


def test_only_the_service_that_uses_a_key_can_read_it(compose: dict[str, Any]) -> None:
    """The client-facing sidecar must never see the admin key: each key lives in a volume of its own,
    mounted only by the init job that writes it and the one service that uses it."""
    services = compose["services"]
    files = _key_files(compose)
    assert set(files) == set(KEY_USERS)
    volumes = {name: _volume_holding(services["controlplane-init"], path) for name, path in files.items()}
    assert len(set(volumes.values())) == len(volumes), f"keys share a volume: {volumes}"
    for name, volume in volumes.items():
        assert not volume.startswith((".", "/")), f"{name} is written to a host directory"
        readers = {service for service, spec in services.items() if volume in dict(_mounts(spec))}
        assert readers <= KEY_USERS[name], f"{name} (volume {volume}) is mounted by {sorted(readers)}"
        assert readers == KEY_USERS[name], f"{name} (volume {volume}) is not mounted where it is used"
    # and each user reads it where its volume is mounted
    assert files["admin.key"] in _script(services["policy-init"])
    sidecar_env = _env(services["sidecar"])
    assert sidecar_env["SPECGATE_KEY_FILE"] == files["worker.key"]
    assert _volume_holding(services["sidecar"], files["worker.key"]) == volumes["worker.key"]
    assert _env(services["gateway"])["SPECGATE_KEY_FILE"] == files["worker.key"]
    assert _volume_holding(services["gateway"], files["worker.key"]) == volumes["worker.key"]
    assert _volume_holding(services["policy-init"], files["admin.key"]) == volumes["admin.key"]


def test_the_key_volumes_start_private_to_the_image_user(compose: dict[str, Any]) -> None:
    """An empty named volume takes the owner and mode of its mount point in the image."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    chmod = re.search(r"chmod 700 ([^\n\\]+)", dockerfile)
    assert chmod, "the Dockerfile makes no key directory private"
    private = set(chmod.group(1).split())
    for name, path in _key_files(compose).items():
        target = str(Path(path).parent)
        assert target in private, f"{name}: the mount point {target} is not made mode 700 in the image"
        assert re.search(rf"mkdir -p [^\n]*{re.escape(target)}\b", dockerfile), target


def test_the_sidecar_reads_its_worker_key_from_the_key_file(compose: dict[str, Any], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import sidecar.main

    seen: list[SidecarSettings] = []
    monkeypatch.setattr(sidecar.main, "run", lambda settings, log_level="info": seen.append(settings))
    for key, value in _env(compose["services"]["sidecar"]).items():
        monkeypatch.setenv(key, value)
    key_file = tmp_path / "worker.key"
    key_file.write_text("sgk_from_the_file\n")
    monkeypatch.setenv("SPECGATE_KEY_FILE", str(key_file))
    result = CliRunner().invoke(app, ["sidecar"])
    assert result.exit_code == 0, result.output
    assert seen[0].key == "sgk_from_the_file"
    monkeypatch.setenv("SPECGATE_KEY", "sgk_from_env")  # SPECGATE_WORKER_KEY in .env
    assert CliRunner().invoke(app, ["sidecar"]).exit_code == 0
    assert seen[1].key == "sgk_from_env"
    key_file.unlink()
    monkeypatch.setenv("SPECGATE_KEY", "")
    result = CliRunner().invoke(app, ["sidecar"])
    assert result.exit_code == 2
    assert "cannot read the worker key" in result.output
