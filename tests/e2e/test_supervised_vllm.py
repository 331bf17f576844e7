"""Engine supervision on the testbed: ``specgate sidecar --supervise`` runs real vLLM CPU engines (a plain one
and a draft-model one, started by the sidecar, not by the session's fleet) behind a real control plane.

A revision that changes K restarts the draft engine while every request is answered (chat on the plain
engine meanwhile), the running server's ``--speculative-config`` then carries the new K, and the control plane
shows the worker converged on it; a revision whose draft model this worker does not have is refused by vLLM,
the engine goes back to the previous arguments and serves on, and the failure reaches the control plane: the
worker is not converged and the audit log says why.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from controlplane.migrations_state import upgrade
from controlplane.models import Policy
from policies import load_policy
from sidecar.supervisor import config_hash, engine_argv
from testbed import engines
from tests.support import paths
from tests.support.e2e import Ask, ControlPlaneProcess, Load, SidecarProcess, wait_until
from tests.support.factories import add_revision, seed_policy
from tests.support.fleet_rows import session_for

if str(paths.ROOT) not in sys.path:
    sys.path.insert(0, str(paths.ROOT))
supervise_bench = importlib.import_module("bench.supervise")

pytestmark = pytest.mark.engines

POLICY = """apiVersion: specgate/v1
name: supervised
engines:
  base: {method: none}
  draft: {method: draft_model, model: %(draft)s, num_speculative_tokens: %(k)d}
rules:
  - name: chat-draft
    when: {route: [chat]}
    then: {engine: draft}
default: {engine: base}
"""
WORKER = "supervised-1"
# vLLM CPU engines with the testbed's models take 30-90 s to come up on two busy cores.
RESTART_TIMEOUT_S = 600.0


def policy_text(k: int, draft: str = "testbed/draft") -> str:
    return POLICY % {"k": k, "draft": draft}


def api(cp: ControlPlaneProcess, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, cp.base + path, timeout=30, headers={"Authorization": f"Bearer {cp.admin_token}"},
                         **kwargs)


def worker(cp: ControlPlaneProcess) -> dict[str, Any]:
    items = api(cp, "GET", "/v1/workers").json()["items"]
    found = [w for w in items if w["id"] == WORKER]
    return found[0] if found else {}


def draft_report(cp: ControlPlaneProcess) -> dict[str, Any]:
    engines_reported = {e["engine"]: e for e in worker(cp).get("supervised_engines", [])}
    return engines_reported.get("draft", {})


def command_line_on(port: int) -> str:
    """The command line of the vLLM server started with ``--port PORT`` (the supervisor's child)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--port" in argv and argv.index(b"--port") + 1 < len(argv) and argv[argv.index(b"--port") + 1] == \
                str(port).encode() and any(b"api_server" in part for part in argv):
            return " ".join(part.decode() for part in argv)
    return ""


def test_supervised_vllm_engines_follow_the_policy_and_a_refused_revision_leaves_them_serving(
        tmp_path: Path) -> None:
    database_url = f"sqlite:///{tmp_path / 'cp.db'}"
    upgrade(database_url)
    texts = [policy_text(2, draft="testbed/missing-draft"), policy_text(2), policy_text(3)]
    policy_id, ids = seed_policy(database_url, texts[0], name="supervised")
    with session_for(database_url) as session:
        row = session.get(Policy, policy_id)
        assert row is not None
        ids += [add_revision(session, row, text, activate=True).id for text in texts[1:]]
    missing, k2, k3 = ids

    base_port = engines.free_base_port(("base", "draft"), 18950)
    config = supervise_bench.supervise_config(base_port, tmp_path / "engine-logs")
    supervise_file = tmp_path / "engines.yaml"
    supervise_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    draft_port = config.engines["draft"].port
    expected_hash = {revision: config_hash(engine_argv(config, "draft", load_policy(text)))
                     for revision, text in zip(ids, texts, strict=True)}

    cp = ControlPlaneProcess(database_url, tmp_path)
    cp.start()
    sidecar = SidecarProcess(cp, {}, tmp_path, worker_id=WORKER)
    sidecar.args += ["--supervise", str(supervise_file)]
    try:
        sidecar.start()

        def runs(revision: str) -> bool:
            w, draft = worker(cp), draft_report(cp)
            return bool(w) and w["converged"] and draft.get("revision") == revision and draft["state"] == "serving"

        wait_until(lambda: runs(k3), RESTART_TIMEOUT_S, "the supervised engines up on K=3", interval=0.5)
        assert draft_report(cp)["config_hash"] == expected_hash[k3]
        assert '"num_speculative_tokens":3' in command_line_on(draft_port)
        # the sidecar waited for the first bundle: the draft engine started once, on the policy's arguments
        assert (tmp_path / "engine-logs" / "draft.log").read_text(errors="replace").count(" start draft: ") == 1

        # One request at a time, 1.5 s apart. A starting vLLM server imports torch, whose MKL counts cores by
        # moving the process onto each allowed core in turn; the plain engine's worker, pinned to core 0,
        # busy-polls for 1 s after each request it serves, and a process moved onto core 0 meanwhile was not
        # scheduled there for minutes (a restart sat in sched_setaffinity until the test gave up). With pauses
        # longer than that busy second, core 0 goes idle between requests and the new server gets its turn.
        with Load(sidecar.url, 1, lambda i: Ask("chat" if i % 2 else "classify", i, max_tokens=6),
                  tag="supervised", pause_s=1.5) as load:
            load.wait_for(2)
            rolled = api(cp, "POST", "/v1/policies/supervised/rollback",
                         json={"revision": k2, "reason": "e2e: K 3 -> 2"})
            assert rolled.status_code == 200, rolled.text
            wait_until(lambda: runs(k2), RESTART_TIMEOUT_S, "the draft engine restarted on K=2", interval=0.5)
            restarted = time.time()
            load.wait_for_sent_after(restarted, 2)

            refused = api(cp, "POST", "/v1/policies/supervised/rollback",
                          json={"revision": missing, "reason": "e2e: a draft model this worker does not have"})
            assert refused.status_code == 200, refused.text

            def failure_audited() -> bool:
                events = api(cp, "GET", "/v1/audit", params={"action": "worker.engine_restart_failed"}).json()
                return bool(events["items"]) and draft_report(cp).get("state") == "serving"

            wait_until(failure_audited, RESTART_TIMEOUT_S, "the refused restart reported", interval=0.5)
            back = time.time()
            load.wait_for_sent_after(back, 4)
        answers = load.answers

        failed = [(a.ask.route, a.status, a.error) for a in answers if not a.ok]
        assert failed == [], failed
        chat = [a for a in answers if a.ask.route == "chat"]
        # while the draft engine restarted, chat was answered by the plain engine
        assert any(a.fallback for a in chat if a.sent_at < restarted), [a.fallback for a in chat]
        # after the refused revision, chat ran on the draft engine again (back on K=2's arguments)
        after = [a for a in chat if a.sent_at > back]
        assert after
        assert all(a.decision.get("engine") == "draft" and not a.fallback for a in after), \
            [(a.decision, a.fallback) for a in after]

        draft = draft_report(cp)
        # back on K=2's arguments: the worker runs the refused revision's bundle, its engine does not
        assert (draft["revision"], draft["config_hash"]) == (k2, expected_hash[k2])
        assert (draft["restarts"], draft["failed_restarts"]) == (1, 1)
        assert "did not come up" in draft["last_error"]
        w = worker(cp)
        assert (w["active_revision"], w["engines_converged"], w["converged"]) == (missing, False, False)
        (event,) = api(cp, "GET", "/v1/audit", params={"action": "worker.engine_restart_failed"}).json()["items"]
        assert (event["target_id"], event["after"]["revision"]) == (WORKER, k2)
        assert '"num_speculative_tokens":2' in command_line_on(draft_port)
        assert "testbed/missing-draft" in (tmp_path / "engine-logs" / "draft.log").read_text(errors="replace")
        print("\nsupervised engines:", json.dumps(worker(cp)["supervised_engines"]))
    finally:
        log = sidecar.stop()
        cp.stop(grace_s=0.5)
        if "Traceback" in log:
            print(f"\nthe sidecar logged a traceback:\n{log[-4000:]}")
    # the engines ended with the sidecar
    wait_until(lambda: not command_line_on(draft_port), 60, "the draft engine stopped with the sidecar")
