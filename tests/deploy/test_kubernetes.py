"""deploy/kubernetes/ (the kustomize base): the Kubernetes schemas, and what the manifests must mean.

No cluster and no kubectl are needed: a small loader reads kustomization.yaml the way ``kubectl apply -k``
does for the fields this base uses (resources, configMapGenerator, namespace, labels, images), every
resource is validated against the JSON schemas of pinned Kubernetes versions (the ``kubernetes-validate``
package ships them; strict: an unknown field is an error), and the manifests are checked against the code
they feed: the gateway's environment must build the sidecar's settings with the StatefulSets' per-pod
names as its replicas, the control plane's its settings, every Service must select pods, every probe a
port its container exposes, the autoscaler and the disruption budget the gateway.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from controlplane.settings import ControlPlaneSettings
from sidecar.settings import SidecarSettings
from tests.support import paths
from tests.support.deploy import flags_of, interpolate, parse_cli, sidecar_settings_of

ROOT = paths.ROOT
BASE = ROOT / "deploy" / "kubernetes"
# The oldest Kubernetes this base is meant for and the newest the pinned kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
# The fields of kustomization.yaml the loader understands; anything else must be taught to it first.
KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "labels", "resources", "configMapGenerator", "images"}
# The Secrets the manifests reference by name (docs/deploy-gpu.md says how to create each), with a
# stand-in value per key for building settings here.
SECRETS = {
    ("specgate-database", "url"): "postgresql+psycopg://specgate:pw@postgres.example:5432/specgate",
    ("specgate-signing-key", "signing-key"): "",
    ("specgate-signing-key", "previous"): "",
    ("specgate-worker-key", "worker.key"): "sgk_stand_in",
    ("specgate-hf-token", "token"): "",
}
POD_NAME = "specgate-gateway-5d9c7b7f9-x2x4q"


# --- the loader -------------------------------------------------------------------------------------


def _generated_config_map(generator: dict[str, Any], directory: Path) -> dict[str, Any]:
    data: dict[str, str] = {}
    for literal in generator.get("literals", []):
        key, sep, value = literal.partition("=")
        assert sep, f"configMapGenerator {generator['name']}: {literal!r} is not KEY=VALUE"
        data[key] = value
    for source in generator.get("files", []):
        key, sep, name = source.partition("=")
        path = directory / (name if sep else key)
        assert path.is_file(), f"configMapGenerator {generator['name']}: {path} does not exist"
        # kustomize refuses files outside the kustomization's directory (its default load restrictor)
        assert path.resolve().is_relative_to(directory.resolve()), f"{source}: outside {directory}"
        data[key if sep else path.name] = path.read_text()
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data}


def load_kustomization(directory: Path) -> list[dict[str, Any]]:
    """The resources ``kubectl kustomize DIRECTORY`` would emit (without name hashes and label additions)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert set(kustomization) <= KUSTOMIZE_FIELDS, f"unknown fields: {set(kustomization) - KUSTOMIZE_FIELDS}"
    resources: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        assert path.exists(), f"{directory}/kustomization.yaml names {entry}, which does not exist"
        if path.is_dir():
            resources.extend(load_kustomization(path))
        else:
            documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
            assert documents, f"{entry} holds no resource"
            resources.extend(documents)
    resources.extend(_generated_config_map(g, directory) for g in kustomization.get("configMapGenerator", []))
    if "namespace" in kustomization:
        for resource in resources:
            if resource["kind"] != "Namespace":
                assert resource["metadata"].get("namespace", kustomization["namespace"]) == \
                    kustomization["namespace"], f"{resource['kind']}/{resource['metadata']['name']}"
    return resources


@pytest.fixture(scope="module")
def kustomization() -> dict[str, Any]:
    return yaml.safe_load((BASE / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def resources() -> list[dict[str, Any]]:
    return load_kustomization(BASE)


def find(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def workloads(resources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in resources if r["kind"] in ("Deployment", "StatefulSet", "Job")]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def container(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (main,) = pod_spec(find(resources, kind, name))["containers"]
    return main


# --- the kustomization and the schemas ----------------------------------------------------------------


def test_the_kustomization_lists_every_manifest(kustomization: dict[str, Any]) -> None:
    inputs = {source.partition("=")[2] or source for g in kustomization.get("configMapGenerator", [])
              for source in g.get("files", [])}
    on_disk = {p.name for p in BASE.glob("*.y*ml")} - {"kustomization.yaml"} - inputs
    assert on_disk == set(kustomization["resources"]), "a manifest is not in resources, or one is missing"


def test_the_loader_catches_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [gone.yaml]\n")
    with pytest.raises(AssertionError, match=r"gone\.yaml"):
        load_kustomization(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "kind: Kustomization\nconfigMapGenerator:\n  - name: x\n    files: [config.yaml=../outside.yaml]\n")
    (tmp_path.parent / "outside.yaml").write_text("a: 1\n")
    with pytest.raises(AssertionError, match="outside"):
        load_kustomization(tmp_path)


def test_the_resources_are_the_expected_ones(resources: list[dict[str, Any]]) -> None:
    names = sorted((r["kind"], r["metadata"]["name"]) for r in resources)
    assert len(names) == len(set(names)), "a kind/name pair is defined twice"
    assert set(names) == {
        ("Namespace", "specgate"),
        ("Job", "specgate-migrate"), ("Deployment", "specgate-controlplane"), ("Service", "specgate-controlplane"),
        ("Deployment", "specgate-gateway"), ("Service", "specgate-gateway"),
        ("HorizontalPodAutoscaler", "specgate-gateway"), ("PodDisruptionBudget", "specgate-gateway"),
        ("StatefulSet", "vllm-spec"), ("Service", "vllm-spec"), ("StatefulSet", "vllm-plain"),
        ("Service", "vllm-plain"), ("Deployment", "otel-collector"), ("Service", "otel-collector"),
        ("ConfigMap", "otel-collector-config"), ("ConfigMap", "vllm-model"),
    }


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_resource_validates_against_the_kubernetes_schema(resources: list[dict[str, Any]],
                                                                version: str) -> None:
    for resource in resources:
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(map(str, exc.path))
            pytest.fail(f"{resource['kind']}/{resource['metadata']['name']} on {version}: {where}: {exc.message}")


def test_the_schema_catches_mistakes(resources: list[dict[str, Any]]) -> None:
    gateway = copy.deepcopy(find(resources, "Deployment", "specgate-gateway"))
    gateway["spec"]["template"]["spec"]["contianers"] = gateway["spec"]["template"]["spec"].pop("containers")
    hpa = copy.deepcopy(find(resources, "HorizontalPodAutoscaler", "specgate-gateway"))
    hpa["spec"]["minReplicas"] = "two"
    pool = copy.deepcopy(find(resources, "StatefulSet", "vllm-spec"))
    pool["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    for broken in (gateway, hpa, pool):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_no_secret_value_is_in_the_repository(resources: list[dict[str, Any]],
                                              kustomization: dict[str, Any]) -> None:
    assert not [r for r in resources if r["kind"] == "Secret"]
    assert "secretGenerator" not in kustomization
    referenced = set()
    for workload in workloads(resources):
        for volume in pod_spec(workload).get("volumes", []):
            if "secret" in volume:
                referenced.update((volume["secret"]["secretName"], item["key"]) for item in volume["secret"]["items"])
        for spec in containers(workload):
            for variable in spec.get("env", []):
                value = variable.get("value", "")
                assert not re.search(r"sgk_|://[^/@\s]+:[^/@\s]+@", value), f"{variable['name']} holds a secret"
                ref = variable.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    referenced.add((ref["name"], ref["key"]))
    assert referenced == set(SECRETS)
    # and the documentation says how to make each
    doc = (ROOT / "docs" / "deploy-gpu.md").read_text()
    assert [name for name, _ in SECRETS if name not in doc] == []


# --- what selects and reaches what ----------------------------------------------------------------------


def _labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def wiring_problems(resources: list[dict[str, Any]]) -> list[str]:
    """Services that select no pods or a port no container names, workloads whose selector misses their pods."""
    problems = []
    for workload in workloads(resources):
        if workload["kind"] == "Job":
            continue
        if not _selects(workload["spec"]["selector"]["matchLabels"], _labels(workload)):
            problems.append(f"{workload['metadata']['name']}: its selector does not match its pod labels")
    for service in (r for r in resources if r["kind"] == "Service"):
        name = service["metadata"]["name"]
        selected = [w for w in workloads(resources) if _selects(service["spec"]["selector"], _labels(w))]
        if len(selected) != 1:
            problems.append(f"Service {name} selects {len(selected)} workloads")
            continue
        ports = {p["name"] for c in pod_spec(selected[0])["containers"] for p in c.get("ports", [])}
        numbers = {p["containerPort"] for c in pod_spec(selected[0])["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            if port["targetPort"] not in ports | numbers:
                problems.append(f"Service {name}: targetPort {port['targetPort']} is no container port")
    return problems


def test_services_select_their_pods_and_ports(resources: list[dict[str, Any]]) -> None:
    assert wiring_problems(resources) == []


def test_a_broken_selector_or_port_would_be_caught(resources: list[dict[str, Any]]) -> None:
    broken = copy.deepcopy(resources)
    find(broken, "Service", "vllm-plain")["spec"]["selector"]["app.kubernetes.io/component"] = "plian"
    find(broken, "Service", "specgate-gateway")["spec"]["ports"][0]["targetPort"] = "htp"
    _labels(find(broken, "Deployment", "otel-collector"))["app.kubernetes.io/name"] = "collector"
    problems = wiring_problems(broken)
    assert any("vllm-plain selects 0" in p for p in problems)
    assert any("targetPort htp" in p for p in problems)
    assert any("otel-collector: its selector" in p for p in problems)


def probe_problems(resources: list[dict[str, Any]]) -> list[str]:
    problems = []
    for workload in workloads(resources):
        for spec in containers(workload):
            ports = {p.get("name") for p in spec.get("ports", [])} | {p["containerPort"] for p in spec.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                action = spec.get(probe, {}).get("httpGet") or spec.get(probe, {}).get("tcpSocket")
                if action and action["port"] not in ports:
                    problems.append(f"{workload['metadata']['name']}/{spec['name']}: {probe} on port "
                                    f"{action['port']}, which the container does not expose")
    return problems


def test_probes_point_at_exposed_ports(resources: list[dict[str, Any]]) -> None:
    assert probe_problems(resources) == []
    broken = copy.deepcopy(resources)
    container(broken, "StatefulSet", "vllm-spec")["readinessProbe"]["httpGet"]["port"] = 8001
    assert probe_problems(broken) == ["vllm-spec/vllm: readinessProbe on port 8001, which the container does not "
                                      "expose"]


def test_long_running_containers_have_probes_and_resources(resources: list[dict[str, Any]]) -> None:
    for workload in workloads(resources):
        for spec in containers(workload):
            where = f"{workload['metadata']['name']}/{spec['name']}"
            assert {"cpu", "memory"} <= set(spec["resources"]["requests"]), where
            assert "memory" in spec["resources"]["limits"], where
        if workload["kind"] != "Job":
            for spec in pod_spec(workload)["containers"]:
                assert {"readinessProbe", "livenessProbe"} <= set(spec), workload["metadata"]["name"]


def test_volumes_and_config_maps_are_defined(resources: list[dict[str, Any]]) -> None:
    config_maps = {r["metadata"]["name"] for r in resources if r["kind"] == "ConfigMap"}
    for workload in workloads(resources):
        declared = {v["name"] for v in pod_spec(workload).get("volumes", [])}
        declared |= {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for volume in pod_spec(workload).get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
        for spec in containers(workload):
            for mount in spec.get("volumeMounts", []):
                assert mount["name"] in declared, f"{workload['metadata']['name']}: volume {mount['name']}"
            for source in spec.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps


def test_the_specgate_and_collector_pods_run_locked_down(resources: list[dict[str, Any]]) -> None:
    for workload in workloads(resources):
        pod = pod_spec(workload)
        assert pod["automountServiceAccountToken"] is False, workload["metadata"]["name"]
        for spec in containers(workload):
            security = spec["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]
            if not spec["image"].startswith("vllm/"):  # the vLLM image runs as root: vllm-spec.yaml says why
                assert pod["securityContext"]["runAsNonRoot"] is True, spec["name"]
                assert pod["securityContext"]["runAsUser"] != 0
                assert security["readOnlyRootFilesystem"] is True, spec["name"]


def test_the_collector_config_is_the_compose_deployments(resources: list[dict[str, Any]]) -> None:
    compose_config = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    generated = find(resources, "ConfigMap", "otel-collector-config")["data"]["config.yaml"]
    assert yaml.safe_load(generated) == compose_config
    collector = container(resources, "Deployment", "otel-collector")
    (config_arg,) = [a for a in collector["args"] if a.startswith("--config=")]
    (mount,) = collector["volumeMounts"]
    assert config_arg == f"--config={mount['mountPath']}/config.yaml"
    ports = {p["containerPort"] for p in collector["ports"]}
    for endpoint in (compose_config["receivers"]["otlp"]["protocols"]["http"]["endpoint"],
                     compose_config["exporters"]["prometheus"]["endpoint"],
                     compose_config["extensions"]["health_check"]["endpoint"]):
        assert int(endpoint.rpartition(":")[2]) in ports


# --- the vLLM pools ---------------------------------------------------------------------------------------


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in a container's args."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], arg) for arg in args]


def vllm_command(resources: list[dict[str, Any]], name: str) -> list[str]:
    spec = container(resources, "StatefulSet", name)
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        env.update(find(resources, "ConfigMap", source["configMapRef"]["name"])["data"])
    return _expand(spec["args"], env)


def replica_urls(resources: list[dict[str, Any]], name: str) -> list[str]:
    """The per-pod DNS names of a StatefulSet's replicas, on its headless Service's port."""
    statefulset = find(resources, "StatefulSet", name)
    service = find(resources, "Service", statefulset["spec"]["serviceName"])
    (port,) = service["spec"]["ports"]
    return [f"http://{name}-{i}.{service['metadata']['name']}:{port['port']}"
            for i in range(statefulset["spec"]["replicas"])]


@pytest.mark.parametrize("name", ["vllm-spec", "vllm-plain"])
def test_the_pools_are_statefulsets_behind_headless_services(resources: list[dict[str, Any]], name: str) -> None:
    statefulset = find(resources, "StatefulSet", name)
    service = find(resources, "Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None", "a ClusterIP Service would hide the replicas from the gateway"
    assert _selects(service["spec"]["selector"], _labels(statefulset))
    spec = container(resources, "StatefulSet", name)
    assert spec["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert spec["readinessProbe"]["httpGet"]["path"] == "/health"
    command = spec["command"] + vllm_command(resources, name)
    assert command[:2] == ["vllm", "serve"]
    (port,) = service["spec"]["ports"]
    assert command[command.index("--port") + 1] == str(port["port"])
    assert float(command[command.index("--gpu-memory-utilization") + 1]) <= 0.95


def test_the_pools_start_like_the_compose_twins(resources: list[dict[str, Any]]) -> None:
    """Same model, same flags and the same defaults as docker-compose.yml's vllm-spec and vllm-plain."""
    compose = interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), {})
    for pool, twin in (("vllm-spec", "vllm-spec"), ("vllm-plain", "vllm-plain")):
        mine, theirs = flags_of(vllm_command(resources, pool)), flags_of(compose["services"][twin]["command"])
        assert vllm_command(resources, pool)[0] == compose["services"][twin]["command"][0]
        # the memory share differs on purpose: a pool replica has its GPU to itself
        mine.pop("--gpu-memory-utilization")
        theirs.pop("--gpu-memory-utilization")
        speculative = (json.loads(mine.pop("--speculative-config", None) or "null"),
                       json.loads(theirs.pop("--speculative-config", None) or "null"))
        assert speculative[0] == speculative[1], pool
        assert mine == theirs, pool
        assert container(resources, "StatefulSet", pool)["image"] == compose["services"][twin]["image"]
    assert "--per-request-spec-decode-metrics" not in vllm_command(resources, "vllm-plain")


# --- the gateway --------------------------------------------------------------------------------------------


def container_env(resources: list[dict[str, Any]], spec: dict[str, Any]) -> dict[str, str]:
    """A container's environment as the kubelet would set it, with stand-ins for Secrets and the pod name."""
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        env.update(find(resources, "ConfigMap", source["configMapRef"]["name"])["data"])
    for variable in spec.get("env", []):
        if "value" in variable:
            env[variable["name"]] = variable["value"]
            continue
        source = variable["valueFrom"]
        if "secretKeyRef" in source:
            value = SECRETS[(source["secretKeyRef"]["name"], source["secretKeyRef"]["key"])]
            if value or not source["secretKeyRef"].get("optional"):
                env[variable["name"]] = value
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[variable["name"]] = POD_NAME
        else:
            raise AssertionError(f"{variable['name']}: no stand-in for {source}")
    return env


def _settings_from(env: dict[str, str], settings: type[Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    for variable in list(os.environ):
        if variable.startswith("SPECGATE_"):
            monkeypatch.delenv(variable)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    prefix = settings.model_config["env_prefix"]
    unknown = {k for k in env if k.startswith(prefix) and k[len(prefix):].lower() not in settings.model_fields}
    assert not unknown, f"read by no field of {settings.__name__}: {sorted(unknown)}"
    return settings()


def gateway_settings(resources: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> SidecarSettings:
    """What the gateway container runs with: its command line over its environment, through the real CLI."""
    spec = container(resources, "Deployment", "specgate-gateway")
    env = container_env(resources, spec)
    _settings_from(env, SidecarSettings, monkeypatch)  # every SPECGATE_ variable is a field
    return sidecar_settings_of(spec["command"] + spec.get("args", []), env, monkeypatch)


def gateway_problems(resources: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    settings = gateway_settings(resources, monkeypatch)
    problems = []
    if settings.kind != "gateway" or not settings.replica_scope:
        problems.append(f"kind {settings.kind}, replica scope {settings.replica_scope}")
    pools = {"draft": replica_urls(resources, "vllm-spec"), "base": replica_urls(resources, "vllm-plain")}
    if settings.engines != pools:
        problems.append(f"engines {settings.engines} are not the pools' replicas {pools}")
    return problems


def test_the_gateway_settings_name_every_pool_replica(resources: list[dict[str, Any]],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert gateway_problems(resources, monkeypatch) == []
    assert replica_urls(resources, "vllm-spec") == ["http://vllm-spec-0.vllm-spec:8000",
                                                    "http://vllm-spec-1.vllm-spec:8000"]


def test_a_pool_scaled_without_the_gateway_would_be_caught(resources: list[dict[str, Any]],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    broken = copy.deepcopy(resources)
    find(broken, "StatefulSet", "vllm-plain")["spec"]["replicas"] = 2
    assert any("not the pools' replicas" in p for p in gateway_problems(broken, monkeypatch))
    broken = copy.deepcopy(resources)
    find(broken, "Service", "vllm-spec")["metadata"]["name"] = "vllm-speculative"
    find(broken, "StatefulSet", "vllm-spec")["spec"]["serviceName"] = "vllm-speculative"
    assert any("not the pools' replicas" in p for p in gateway_problems(broken, monkeypatch))


def _service_url(resources: list[dict[str, Any]], url: str) -> dict[str, Any]:
    """The Service a URL reaches (by its short name) and the port it names; fails when there is none."""
    parts = urlsplit(url)
    service = find(resources, "Service", parts.hostname or "")
    assert parts.port in {p["port"] for p in service["spec"]["ports"]}, url
    return service


def test_the_gateway_reaches_the_control_plane_collector_and_its_key(resources: list[dict[str, Any]],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    spec = container(resources, "Deployment", "specgate-gateway")
    env = container_env(resources, spec)
    settings = gateway_settings(resources, monkeypatch)
    assert settings.worker_id == POD_NAME  # each gateway registers as a worker of its own
    assert _service_url(resources, settings.control_plane)["metadata"]["name"] == "specgate-controlplane"
    assert _service_url(resources, env["OTEL_EXPORTER_OTLP_ENDPOINT"])["metadata"]["name"] == "otel-collector"
    # it listens on the port it exposes, and reads its key where the Secret is mounted
    listen_port = int(settings.listen.rpartition(":")[2])
    assert listen_port in {p["containerPort"] for p in spec["ports"]}
    mounts = {m["name"]: m["mountPath"] for m in spec["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(find(resources, "Deployment", "specgate-gateway"))["volumes"]}
    key_volume = volumes["worker-key"]["secret"]
    assert str(settings.key_file) == f"{mounts['worker-key']}/{key_volume['items'][0]['path']}"
    # the image's user reads it through the pod's group, nobody else can
    assert key_volume["defaultMode"] & 0o007 == 0
    assert pod_spec(find(resources, "Deployment", "specgate-gateway"))["securityContext"]["fsGroup"] == 10001
    # a writable state directory on a read-only root
    assert any(str(settings.state_dir) == path for path in mounts.values())
    parse_cli(spec["command"][1:])


def test_the_autoscaler_and_disruption_budget_hold_the_gateway(resources: list[dict[str, Any]]) -> None:
    gateway = find(resources, "Deployment", "specgate-gateway")
    hpa = find(resources, "HorizontalPodAutoscaler", "specgate-gateway")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "specgate-gateway"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    # CPU utilisation is relative to the request, and the autoscaler owns the replica count
    assert container(resources, "Deployment", "specgate-gateway")["resources"]["requests"]["cpu"]
    assert "replicas" not in gateway["spec"]
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    pdb = find(resources, "PodDisruptionBudget", "specgate-gateway")
    selected = [w["metadata"]["name"] for w in workloads(resources)
                if _selects(pdb["spec"]["selector"]["matchLabels"], _labels(w))]
    assert selected == ["specgate-gateway"]
    assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"], "a drain could never evict a gateway"


# --- the control plane ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "name"), [("Job", "specgate-migrate"), ("Deployment", "specgate-controlplane")])
def test_the_control_plane_settings_build(resources: list[dict[str, Any]], kind: str, name: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for spec in containers(find(resources, kind, name)):
        settings = _settings_from(container_env(resources, spec), ControlPlaneSettings, monkeypatch)
        assert settings.database_url == SECRETS[("specgate-database", "url")]


def test_migrations_run_in_a_job_and_the_control_plane_waits_for_them(resources: list[dict[str, Any]]) -> None:
    job = find(resources, "Job", "specgate-migrate")
    (migrate,) = pod_spec(job)["containers"]
    assert migrate["command"] == ["specgate", "db", "upgrade"]
    parse_cli(migrate["command"][1:])
    deployment = find(resources, "Deployment", "specgate-controlplane")
    (wait,) = pod_spec(deployment)["initContainers"]
    assert "specgate db current" in wait["command"][-1]
    parse_cli(["db", "current"])
    serve = container(resources, "Deployment", "specgate-controlplane")
    assert serve["command"][:2] == ["specgate", "serve"]
    assert "--no-migrate" in serve["command"]
    parse_cli(serve["command"][1:])
    # the Service and the probes use the port it serves on
    port = int(serve["command"][serve["command"].index("--port") + 1])
    assert port in {p["containerPort"] for p in serve["ports"]}
    assert serve["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {image["name"] for image in yaml.safe_load((BASE / "kustomization.yaml").read_text())["images"]} <= \
        {c["image"].partition(":")[0] for w in workloads(resources) for c in containers(w)}
