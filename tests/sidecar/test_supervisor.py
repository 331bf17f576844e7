"""The engine supervisor (sidecar/supervisor.py) against FAKE engine processes
(``tests.support.fake_engine_server``: not vLLM; each answers with the speculative config it was started with).

The real-vLLM counterpart is in tests/e2e; these check the state machine: start from rendered arguments,
drain and restart on a policy that changes them while the other engine answers, a restart whose new
arguments do not come up goes back to the old ones, and engines end with the sidecar.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

import policies
from sidecar.supervisor import EngineSupervisor, SuperviseError, engine_argv, load_supervise_file
from tests.support import paths
from tests.support.cli import specgate_command
from tests.support.fake_upstream import closed_port
from tests.support.model_dirs import write_model
from tests.support.sidecars import LoopThread, SidecarFactory, wait_for

POLICY = """apiVersion: specgate/v1
name: supervised
engines:
  base: {method: none}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: %(k)d}
rules:
  - name: chat-draft
    when: {route: [chat]}
    then: {engine: draft}
default: {engine: base}
"""


def policy(k: int = 3, model: str = "models/draft") -> policies.PolicyDocument:
    return policies.load_policy((POLICY % {"k": k}).replace("models/draft", model))


def bundle(doc: policies.PolicyDocument) -> policies.CompiledBundle:
    return policies.CompiledBundle(policies.BundlePayload(policies.Revision.of(doc)))


def supervise_file(tmp_path: Path, **overrides: Any) -> Path:
    draft_dir = tmp_path / "local-draft"
    draft_dir.mkdir(exist_ok=True)
    env = {"PYTHONPATH": str(paths.ROOT), "FAKE_ENGINE_TOKEN_DELAY_S": "0.01"}
    data: dict[str, Any] = {
        "command": [sys.executable, "-m", "tests.support.fake_engine_server"],
        "engines": {"base": {"model": str(tmp_path / "target"), "port": closed_port(), "env": env,
                             "args": ["--dtype", "float32"]},
                    "draft": {"model": str(tmp_path / "target"), "port": closed_port(), "env": env}},
        "models": {"models/draft": str(draft_dir)},
        "drain_timeout_s": 5, "start_timeout_s": 30, "stop_timeout_s": 5, "log_dir": str(tmp_path / "logs"),
        **overrides,
    }
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def chat(url: str, **headers: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers={"X-Specgate-Route": "chat", **headers},
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)


def served_config(response: httpx.Response) -> dict[str, Any]:
    """The speculative config of the fake engine that answered ({} for a plain one)."""
    return json.loads(response.json()["choices"][0]["message"]["content"])


def decision(response: httpx.Response) -> dict[str, str]:
    return dict(part.split("=", 1) for part in response.headers["x-specgate-decision"].split("; "))


@pytest.fixture
def supervised(tmp_path: Path, loop_thread: LoopThread, make_sidecar: SidecarFactory) -> Any:
    config = load_supervise_file(supervise_file(tmp_path))
    first = policy(3)
    sidecar = make_sidecar(engines={name: config.url(name) for name in config.engines}, bundle=bundle(first))
    supervisor = EngineSupervisor(config, sidecar.app.pools, tmp_path)

    async def start() -> None:
        supervisor.start(first, "r3")

    loop_thread.run(start())
    wait_for(lambda: all(r["state"] == "serving" for r in supervisor.report()), timeout=30)
    yield sidecar, supervisor, config, tmp_path
    loop_thread.run(supervisor.stop(), timeout=30)


def test_engines_start_with_the_rendered_arguments_and_the_local_draft_path(supervised: Any) -> None:
    sidecar, supervisor, config, tmp_path = supervised
    answer = chat(sidecar.url)
    assert decision(answer)["engine"] == "draft"
    assert served_config(answer) == {"method": "draft_model", "model": str(tmp_path / "local-draft"),
                                     "num_speculative_tokens": 3}
    plain = httpx.post(sidecar.url + "/v1/chat/completions", headers={"X-Specgate-Route": "other"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert served_config(plain) == {}
    reports = {r["engine"]: r for r in supervisor.report()}
    assert reports["draft"]["config_hash"] == supervisor.engines["draft"].report()["config_hash"]
    assert reports["base"]["pid"] is not None
    base = config.engines["base"]
    assert engine_argv(config, "base", policy(3)) == [
        *config.command, "--model", base.model, "--host", "127.0.0.1", "--port", str(base.port),
        "--dtype", "float32", "--enable-per-request-metrics"]
    assert (Path(config.log_dir or "") / "draft.log").read_text().count("FAKE engine up") == 1


def test_a_policy_that_changes_k_restarts_the_draft_engine_while_the_plain_engine_answers(
        supervised: Any, loop_thread: LoopThread) -> None:
    sidecar, supervisor, _, _ = supervised
    before = supervisor.engines["draft"].report()
    results: list[httpx.Response] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            results.append(chat(sidecar.url))

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        time.sleep(0.3)
        loop_thread.run(supervisor.apply(policy(2), "r2"), timeout=60)
        time.sleep(0.3)
    finally:
        stop.set()
        worker.join(30)
    assert results
    assert all(r.status_code == 200 for r in results), [r.status_code for r in results]
    configs = [served_config(r).get("num_speculative_tokens") for r in results]
    assert None in configs  # while the draft engine restarted, chat ran on the plain engine
    assert configs[0] == 3
    assert configs[-1] == 2
    # never an old answer after a new one: the old engine was drained before the new one started
    assert configs.index(2) > max(i for i, k in enumerate(configs) if k == 3)
    after = supervisor.engines["draft"].report()
    assert (after["state"], after["restarts"], after["failed_restarts"]) == ("serving", 1, 0)
    assert after["config_hash"] != before["config_hash"]
    assert after["pid"] != before["pid"]
    # what the heartbeat tells the control plane: the engine runs the new revision's arguments
    assert (before["revision"], after["revision"]) == ("r3", "r2")
    # the plain engine's arguments did not change: it was left alone, and they are the new revision's too
    base = supervisor.engines["base"].report()
    assert (base["restarts"], base["revision"]) == (0, "r2")


def test_in_flight_requests_finish_before_the_restart(supervised: Any, loop_thread: LoopThread) -> None:
    sidecar, supervisor, _, _ = supervised
    slow: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: slow.append(chat(sidecar.url, **{"X-Fake-Token-Delay": "0.05"})))
    worker.start()
    wait_for(lambda: sidecar.app.pools.in_flight(supervisor.engines["draft"].url) == 1)
    loop_thread.run(supervisor.apply(policy(2)), timeout=60)
    worker.join(30)
    assert slow[0].status_code == 200
    assert served_config(slow[0])["num_speculative_tokens"] == 3  # answered whole by the old engine


def test_new_arguments_that_do_not_come_up_go_back_to_the_old_ones_and_say_why(
        supervised: Any, loop_thread: LoopThread) -> None:
    sidecar, supervisor, config, _ = supervised
    loop_thread.run(supervisor.apply(policy(3, model="models/missing-draft"), "r-bad"), timeout=60)
    report = supervisor.engines["draft"].report()
    assert (report["state"], report["restarts"], report["failed_restarts"]) == ("serving", 0, 1)
    # back on r3's arguments, and it says so: the worker has not converged on r-bad
    assert report["revision"] == "r3"
    assert supervisor.engines["base"].report()["revision"] == "r-bad"
    assert "the new arguments did not come up: it exited with 1" in report["last_error"]
    assert "back on the previous ones" in report["last_error"]
    assert report["error_revision"] == "r-bad"  # the error is about r-bad's arguments, not the r3 it runs
    assert "draft model 'models/missing-draft' not found" in (Path(config.log_dir or "") / "draft.log").read_text()
    answer = chat(sidecar.url)
    assert served_config(answer)["num_speculative_tokens"] == 3
    metrics = httpx.get(sidecar.url + "/metrics").text
    assert "specgate_sidecar_replica_healthy" in metrics


def test_the_supervise_file_is_checked_field_by_field(tmp_path: Path) -> None:
    path = supervise_file(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["engines"]["draft"]["port"] = 70000
    data["engines"]["base"]["gpu"] = 0
    data["engines"]["base"]["host"] = "[::1]"
    data["engines"]["base"]["env"] = {"A=B": "1"}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SuperviseError) as info:
        load_supervise_file(path)
    assert "engines.draft.port" in str(info.value)
    assert "engines.base.gpu" in str(info.value)
    assert "engines.base.host" in str(info.value)
    assert "engines.base.env.A=B" in str(info.value)
    data = yaml.safe_load(supervise_file(tmp_path).read_text())
    data["engines"]["Draft Model!"] = data["engines"].pop("draft")
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SuperviseError, match=r"engines\.Draft Model!"):
        load_supervise_file(path)
    data = yaml.safe_load(supervise_file(tmp_path).read_text())
    data["engines"]["draft"]["port"] = data["engines"]["base"]["port"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SuperviseError, match="two engines on one host and port"):
        load_supervise_file(path)
    path.write_text("command: [\n")
    with pytest.raises(SuperviseError, match="cannot read it"):
        load_supervise_file(path)


def test_the_cli_refuses_a_bad_file_and_engines_given_twice(tmp_path: Path) -> None:
    path = supervise_file(tmp_path, drain_timeout_s=-1)
    result = subprocess.run([*specgate_command(), "sidecar", "--supervise", str(path), "--key", "sgk_x"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "drain_timeout_s" in result.stderr
    good = supervise_file(tmp_path)
    result = subprocess.run([*specgate_command(), "sidecar", "--supervise", str(good), "--key", "sgk_x",
                             "--engine", "base=http://127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--supervise names the engines; leave out --engine" in result.stderr


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_engines_end_with_the_sidecar_even_when_it_is_killed(tmp_path: Path) -> None:
    path = supervise_file(tmp_path)
    config = load_supervise_file(path)
    proc = subprocess.Popen([*specgate_command(), "sidecar", "--supervise", str(path), "--key", "sgk_x",
                             "--control-plane", f"http://127.0.0.1:{closed_port()}", "--state-dir",
                             str(tmp_path / "state"), "--listen", f"127.0.0.1:{closed_port()}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        # no policy yet (no control plane, no last-known-good bundle): the engines start without speculation
        wait_for(lambda: all(_answers(config.url(name)) for name in config.engines), timeout=60)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: not any(_answers(config.url(name)) for name in config.engines), timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_new_bundle_in_the_store_restarts_the_engine_it_changes(supervised: Any, loop_thread: LoopThread) -> None:
    # What the sidecar wires up: the supervisor watches the policy store the bundle sync fills.
    sidecar, supervisor, _, _ = supervised

    async def watch() -> None:
        supervisor.watch(lambda: sidecar.store.current, every_s=0.05)

    loop_thread.run(watch())
    sidecar.store.update(bundle(policy(2)))
    wait_for(lambda: supervisor.engines["draft"].report()["restarts"] == 1, timeout=30)
    assert served_config(chat(sidecar.url))["num_speculative_tokens"] == 2
    assert supervisor.engines["draft"].report()["revision"] == sidecar.store.current.active.revision


def test_a_policy_applied_while_the_engines_start_waits_for_them(tmp_path: Path, loop_thread: LoopThread,
                                                                 make_sidecar: SidecarFactory) -> None:
    config = load_supervise_file(supervise_file(tmp_path))
    sidecar = make_sidecar(engines={name: config.url(name) for name in config.engines}, bundle=bundle(policy(3)))
    supervisor = EngineSupervisor(config, sidecar.app.pools, tmp_path)

    async def start_then_apply() -> None:
        supervisor.start(policy(3))
        assert {r["state"] for r in supervisor.report()} == {"starting"}
        await supervisor.apply(policy(2))

    try:
        loop_thread.run(start_then_apply(), timeout=60)
        draft = supervisor.engines["draft"].report()
        # started with the first arguments, restarted once with the second (whether or not the first were up
        # yet), and only then routed to
        assert (draft["state"], draft["restarts"], draft["failed_restarts"]) == ("serving", 1, 0)
        assert served_config(chat(sidecar.url))["num_speculative_tokens"] == 2
        log_text = (Path(config.log_dir or "") / "draft.log").read_text()
        assert log_text.count(" start draft: ") == 2
        assert '"num_speculative_tokens": 3}' not in log_text.split(" start draft: ")[2]
        base = supervisor.engines["base"].report()
        assert (base["state"], base["restarts"]) == ("serving", 0)
    finally:
        loop_thread.run(supervisor.stop(), timeout=30)


def test_an_engine_that_dies_while_serving_is_started_again(supervised: Any, loop_thread: LoopThread) -> None:
    sidecar, supervisor, _, _ = supervised

    async def watch() -> None:
        supervisor.watch(lambda: sidecar.store.current, every_s=0.05)

    loop_thread.run(watch())
    first = supervisor.engines["draft"].report()["pid"]
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: supervisor.engines["draft"].report()["crashes"] == 1
             and supervisor.engines["draft"].report()["state"] == "serving", timeout=30)
    report = supervisor.engines["draft"].report()
    assert report["pid"] != first
    assert "exited with -9 while serving" in report["last_error"]
    assert report["error_revision"] == "r3"  # a crash of the arguments it runs
    assert served_config(chat(sidecar.url))["num_speculative_tokens"] == 3


def test_arguments_that_failed_are_not_tried_again_for_every_bundle(supervised: Any,
                                                                    loop_thread: LoopThread) -> None:
    _, supervisor, _, _ = supervised
    bad = policy(3, model="models/missing-draft")
    loop_thread.run(supervisor.apply(bad), timeout=60)
    loop_thread.run(supervisor.apply(bad), timeout=60)  # e.g. a canary step or the kill switch: a new bundle
    report = supervisor.engines["draft"].report()
    assert (report["failed_restarts"], report["state"]) == (1, "serving")


def test_a_policy_this_worker_cannot_render_is_reported_and_the_next_one_clears_it(
        supervised: Any, loop_thread: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    import sidecar.supervisor as supervisor_module
    from policies.render import RenderError

    _, supervisor, _, _ = supervised
    changes: list[str] = []
    supervisor.on_change = lambda: changes.append("changed")
    real = supervisor_module.vllm_serve_args

    def refuse(doc: Any, name: str, **kwargs: Any) -> list[str]:
        if doc.engines[name].method != "none" and doc.engines[name].num_speculative_tokens == 5:
            raise RenderError("no such thing here")
        return real(doc, name, **kwargs)

    monkeypatch.setattr(supervisor_module, "vllm_serve_args", refuse)
    with pytest.raises(RenderError):
        loop_thread.run(supervisor.apply(policy(5), "r5"), timeout=60)
    report = supervisor.engines["draft"].report()
    assert (report["revision"], report["restarts"], report["state"]) == ("r3", 0, "serving")
    assert report["last_error"] == ("revision r5 cannot be rendered for this worker: no such thing here; "
                                    "the engines keep their arguments")
    assert changes  # reported at once
    loop_thread.run(supervisor.apply(policy(2), "r2"), timeout=60)
    report = supervisor.engines["draft"].report()
    assert (report["revision"], report["restarts"], report["last_error"]) == ("r2", 1, None)


def _supervising_sidecar(tmp_path: Path, control_plane: str, token: str, worker_id: str) -> Any:
    from sidecar.main import Sidecar
    from sidecar.settings import SidecarSettings

    return Sidecar(SidecarSettings(control_plane=control_plane, key=token, worker_id=worker_id, pool="default",
                                   supervise=supervise_file(tmp_path), state_dir=tmp_path / "state",
                                   heartbeat_s=0.2), use_env_otel=False)


async def _all_serving(sidecar: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(r["state"] == "serving" for r in sidecar.supervisor.report()):
        assert time.monotonic() < deadline, (sidecar.supervisor.report(), sidecar.sync.last_error)
        await asyncio.sleep(0.1)


def test_a_supervising_sidecar_starts_its_engines_once_on_the_control_planes_policy(tmp_path: Path) -> None:
    from controlplane.migrations_state import upgrade
    from tests.support.factories import seed_policy
    from tests.support.live import WORKER_ID, ControlPlane

    database_url = f"sqlite:///{tmp_path / 'cp.db'}"
    upgrade(database_url)
    _, (revision,) = seed_policy(database_url, POLICY % {"k": 3}, name="supervised")
    cp = ControlPlane(database_url)
    cp.start()
    sidecar = _supervising_sidecar(tmp_path, cp.base, cp.worker_token, WORKER_ID)

    async def scenario() -> None:
        await asyncio.wait_for(sidecar.start(), 5)  # the engines start in the background
        assert sidecar.supervisor is not None
        try:
            await _all_serving(sidecar)
            draft = sidecar.supervisor.engines["draft"]
            assert draft.revision == revision
            assert '"num_speculative_tokens":3' in " ".join(draft.argv)
            log_text = (tmp_path / "logs" / "draft.log").read_text()
            assert log_text.count(" start draft: ") == 1  # not started plain, then restarted
            deadline = time.monotonic() + 10
            while not (await cp.worker() or {}).get("converged"):
                assert time.monotonic() < deadline, await cp.worker()
                await asyncio.sleep(0.1)
            worker = await cp.worker()
            assert worker is not None
            assert [e["revision"] for e in worker["supervised_engines"]] == [revision, revision]
        finally:
            await sidecar.stop()

    try:
        asyncio.run(scenario())
    finally:
        cp.stop()


def test_without_a_control_plane_the_engines_wait_held_then_start_plain(tmp_path: Path) -> None:
    sidecar = _supervising_sidecar(tmp_path, f"http://127.0.0.1:{closed_port()}", "sgk_x", "w-alone")
    sidecar.first_policy_wait_s = 1.0

    async def scenario() -> None:
        started = time.monotonic()
        await asyncio.wait_for(sidecar.start(), 5)
        assert sidecar.supervisor is not None
        try:
            # held from the start: nothing is routed to an engine that is not running
            assert {r["state"] for r in sidecar.app.pools.report()} == {"held"}
            # a control plane that does not answer may be starting beside the worker: waited for
            await asyncio.sleep(0.5)
            assert {r["state"] for r in sidecar.supervisor.report()} == {"stopped"}
            await _all_serving(sidecar)
            assert time.monotonic() - started >= 1.0
            draft = sidecar.supervisor.engines["draft"]
            assert draft.revision is None
            assert "--speculative-config" not in draft.argv
        finally:
            await sidecar.stop()

    asyncio.run(scenario())


def test_a_control_plane_that_answers_without_a_bundle_ends_the_wait(tmp_path: Path) -> None:
    from controlplane.migrations_state import upgrade
    from tests.support.live import WORKER_ID, ControlPlane

    database_url = f"sqlite:///{tmp_path / 'cp.db'}"
    upgrade(database_url)  # no policy: the control plane has no bundle for this worker
    cp = ControlPlane(database_url)
    cp.start()
    sidecar = _supervising_sidecar(tmp_path, cp.base, cp.worker_token, WORKER_ID)
    sidecar.first_policy_wait_s = 120.0

    async def scenario() -> None:
        await sidecar.start()
        assert sidecar.supervisor is not None
        try:
            await _all_serving(sidecar)
            assert sidecar.sync.connected
        finally:
            await sidecar.stop()

    try:
        asyncio.run(scenario())
    finally:
        cp.stop()


def test_a_long_error_is_cut_to_what_the_heartbeat_may_carry() -> None:
    from controlplane.worker.schemas import SupervisedEngineReport
    from sidecar.supervisor import MAX_REPORTED_ERROR, EngineState
    from sidecar.sync import SUPERVISED_REPORT_FIELDS

    state = EngineState("draft", "http://127.0.0.1:1", argv=["vllm", "serve"], state="failed",
                        last_error="\x1b[31mred\x1b[0m\tline\n" + "x" * 5000)
    report = state.report()
    assert len(report["last_error"]) == MAX_REPORTED_ERROR
    assert report["last_error"].endswith("...")
    # terminal escapes are not passed on (they would reach `specgate workers --engines`), newlines and tabs are
    assert report["last_error"].startswith("?[31mred?[0m\tline\n")
    # what the sidecar sends is what the control plane takes
    SupervisedEngineReport.model_validate({k: v for k, v in report.items() if k in SUPERVISED_REPORT_FIELDS})


def test_the_first_policy_does_not_restart_a_plain_engine(tmp_path: Path) -> None:
    config = load_supervise_file(supervise_file(tmp_path))
    assert engine_argv(config, "base", None) == engine_argv(config, "base", policy(3))
    assert engine_argv(config, "draft", None) != engine_argv(config, "draft", policy(3))


def test_supervise_from_the_environment_names_the_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.settings import SidecarSettings

    path = supervise_file(tmp_path)
    monkeypatch.setenv("SPECGATE_SUPERVISE", str(path))
    config = load_supervise_file(path)
    assert SidecarSettings().engines == {name: [config.url(name)] for name in config.engines}
    with pytest.raises(ValueError, match="leave out --engine"):
        SidecarSettings(engines={"base": "http://127.0.0.1:1"})


# --- tokenizer alignment of the draft model (pairs.tokenizers) -------------------------------------------------

WORDS = [f"w{i}" for i in range(50)]


def _start(tmp_path: Path, loop_thread: LoopThread, make_sidecar: SidecarFactory, *,
           draft_tokens: list[str], **entry: Any) -> tuple[Any, EngineSupervisor, Path]:
    """Engines whose target has WORDS and whose local draft has ``draft_tokens``; started on policy(3)."""
    write_model(tmp_path / "target", WORDS)
    write_model(tmp_path / "local-draft", draft_tokens)
    path = supervise_file(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["engines"]["draft"].update(entry)
    path.write_text(yaml.safe_dump(data))
    config = load_supervise_file(path)
    sidecar = make_sidecar(engines={name: config.url(name) for name in config.engines}, bundle=bundle(policy(3)))
    supervisor = EngineSupervisor(config, sidecar.app.pools, tmp_path)

    async def start() -> None:
        supervisor.start(policy(3), "r3")

    loop_thread.run(start())
    wait_for(lambda: supervisor.engines["base"].state == "serving"
             and supervisor.engines["draft"].state in ("serving", "failed"), timeout=30)
    return sidecar, supervisor, Path(config.log_dir or "")


def test_an_aligned_draft_starts_and_says_so(tmp_path: Path, loop_thread: LoopThread,
                                             make_sidecar: SidecarFactory) -> None:
    sidecar, supervisor, _ = _start(tmp_path, loop_thread, make_sidecar, draft_tokens=WORDS)
    try:
        report = supervisor.engines["draft"].report()
        assert report["state"] == "serving"
        assert report["tokenizer"] == {"aligned": True, "draft": str(tmp_path / "local-draft"), "differences": [],
                                       "notes": []}
        assert supervisor.engines["base"].report()["tokenizer"] is None  # no draft model
        assert served_config(chat(sidecar.url))["num_speculative_tokens"] == 3
        sidecar.app.metrics.supervisor = supervisor  # as the sidecar's start does with --supervise
        metrics = httpx.get(sidecar.url + "/metrics").text
        assert 'specgate_sidecar_engine_tokenizer_aligned{engine="draft"} 1.0' in metrics
        assert 'specgate_sidecar_engine_tokenizer_aligned{engine="base"}' not in metrics
        serving = f'specgate_sidecar_engine_serving{{config_hash="{report["config_hash"]}",engine="draft"}} 1.0'
        assert serving in metrics
        assert 'specgate_sidecar_engine_restarts_total{engine="draft",outcome="failed"} 0.0' in metrics
    finally:
        loop_thread.run(supervisor.stop(), timeout=30)


def test_a_misaligned_draft_is_refused_and_its_requests_go_to_the_plain_engine(
        tmp_path: Path, loop_thread: LoopThread, make_sidecar: SidecarFactory) -> None:
    sidecar, supervisor, logs = _start(tmp_path, loop_thread, make_sidecar, draft_tokens=[*WORDS, "extra"])
    try:
        report = supervisor.engines["draft"].report()
        assert report["state"] == "failed"
        assert report["tokenizer"]["aligned"] is False
        assert report["tokenizer"]["differences"][0] == "draft has 54 tokens, target 53"
        assert "has another tokenizer than the target" in report["last_error"]
        assert "heterogeneous_vocabulary: true" in report["last_error"]
        assert not (logs / "draft.log").exists()  # never started
        answer = chat(sidecar.url)
        assert answer.status_code == 200
        assert answer.headers.get("x-specgate-fallback")
        assert served_config(answer) == {}
        sidecar.app.metrics.supervisor = supervisor
        metrics = httpx.get(sidecar.url + "/metrics").text
        assert 'specgate_sidecar_engine_tokenizer_aligned{engine="draft"} 0.0' in metrics
        assert 'specgate_sidecar_engine_serving{config_hash="",engine="draft"} 0.0' in metrics
    finally:
        loop_thread.run(supervisor.stop(), timeout=30)


def test_heterogeneous_vocabulary_lets_a_misaligned_draft_start_and_still_reports_it(
        tmp_path: Path, loop_thread: LoopThread, make_sidecar: SidecarFactory) -> None:
    _, supervisor, _ = _start(tmp_path, loop_thread, make_sidecar, draft_tokens=[*WORDS, "extra"],
                              heterogeneous_vocabulary=True)
    try:
        report = supervisor.engines["draft"].report()
        assert report["state"] == "serving"
        assert report["tokenizer"]["aligned"] is False
    finally:
        loop_thread.run(supervisor.stop(), timeout=30)


def test_a_policy_that_brings_a_misaligned_draft_keeps_the_engine_on_its_arguments(
        tmp_path: Path, loop_thread: LoopThread, make_sidecar: SidecarFactory) -> None:
    sidecar, supervisor, _ = _start(tmp_path, loop_thread, make_sidecar, draft_tokens=WORDS)
    other = write_model(tmp_path / "other-draft", ["zz", *WORDS[1:]])
    try:
        before = supervisor.engines["draft"].report()
        supervisor.config.models["models/other"] = str(other)
        loop_thread.run(supervisor.apply(policy(3, model="models/other"), "r-other"), timeout=60)
        report = supervisor.engines["draft"].report()
        assert (report["state"], report["revision"], report["config_hash"]) == ("serving", "r3",
                                                                                before["config_hash"])
        assert (report["restarts"], report["failed_restarts"]) == (0, 1)
        assert "2 ids differ" in report["last_error"]
        assert "keeps its previous arguments" in report["last_error"]
        assert report["error_revision"] == "r-other"
        assert report["tokenizer"]["draft"] == str(other)
        assert served_config(chat(sidecar.url))["model"] == str(tmp_path / "local-draft")
    finally:
        loop_thread.run(supervisor.stop(), timeout=30)


def test_a_draft_replaced_in_place_is_checked_again_and_a_bad_directory_is_not_checked(
        tmp_path: Path, loop_thread: LoopThread, make_sidecar: SidecarFactory) -> None:
    _, supervisor, _ = _start(tmp_path, loop_thread, make_sidecar, draft_tokens=WORDS)
    try:
        draft_dir = tmp_path / "local-draft"
        time.sleep(0.01)  # a new modification time
        write_model(draft_dir, [*WORDS, "extra"])
        loop_thread.run(supervisor.apply(policy(2), "r2"), timeout=60)
        report = supervisor.engines["draft"].report()
        assert report["tokenizer"]["aligned"] is False  # not the first check's answer, cached
        assert (report["revision"], report["failed_restarts"]) == ("r3", 1)
        # A chat template that is not text: reported as not checked, never a supervision failure.
        write_model(draft_dir, WORDS)
        (draft_dir / "chat_template.jinja").write_bytes(b"\xff\xfe not text")
        loop_thread.run(supervisor.apply(policy(4), "r4"), timeout=60)
        report = supervisor.engines["draft"].report()
        assert report["tokenizer"]["aligned"] is None
        assert report["tokenizer"]["differences"][0].startswith("not checked: ")
        assert (report["state"], report["revision"]) == ("serving", "r4")
    finally:
        loop_thread.run(supervisor.stop(), timeout=30)
