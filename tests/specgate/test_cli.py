"""The ``specgate`` command line, end to end against a live control plane (uvicorn in a thread).

Client commands run in-process through Typer's CliRunner and talk HTTP to the server; the
server-side ones (``keys create``, ``db ...``) get ``SPECGATE_DATABASE_URL``. ``specgate up``
runs as a real process, stopped with SIGINT as a person would.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.db import make_engine
from controlplane.migrations_state import migration_status
from controlplane.models import Worker
from controlplane.settings import ControlPlaneSettings
from specgate.cli import app as cli_app
from tests.support import paths
from tests.support.auth import bearer
from tests.support.cli import line_queue, specgate_command
from tests.support.factories import seed_policy, seed_text
from tests.support.fleet_rows import session_for
from tests.support.live import ctrl_c_as_at_a_terminal, free_port, serve
from tests.support.policy_texts import INVALID_POLICY as INVALID

ROOT = paths.ROOT



@pytest.fixture
def live(settings: ControlPlaneSettings) -> Iterator[str]:
    with serve(create_app(settings)) as url:
        yield url


@pytest.fixture
def token(make_key: Callable[[Scope, str], str]) -> str:
    return make_key(Scope.admin, "cli-admin")


Run = Callable[..., Result]


@pytest.fixture
def run(live: str, token: str) -> Run:
    """``run("killswitch", "status")``: the CLI with SPECGATE_URL and SPECGATE_KEY pointing at the server."""

    def invoke(*args: str, env: dict[str, str | None] | None = None) -> Result:
        return CliRunner().invoke(cli_app, list(args),
                                  env={"SPECGATE_URL": live, "SPECGATE_KEY": token, **(env or {})})

    return invoke


def api(live: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=live, headers=bearer(token), timeout=10)


def as_json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- server side ---------------------------------------------------------------------------------

def test_keys_create_prints_a_token_that_works(run: Run, live: str, settings: ControlPlaneSettings) -> None:
    env = {"SPECGATE_DATABASE_URL": settings.database_url}
    result = run("keys", "create", "--scope", "viewer", "--name", "ci-reader", env=env)
    assert result.exit_code == 0, result.output
    # stdout is the token alone, so `KEY=$(specgate keys create ...)` works; the notice is on stderr.
    assert re.fullmatch(r"sgk_\S+\n", result.stdout)
    assert "created viewer key 'ci-reader'" in result.stderr
    new_token = result.stdout.strip()
    with api(live, new_token) as client:
        assert client.get("/v1/policies").status_code == 200
        assert client.put("/v1/killswitch", json={"enabled": True, "reason": "x"}).status_code == 403
    # The CLI itself works with it too (read-only commands).
    assert as_json(run("killswitch", "status", "--json", env={"SPECGATE_KEY": new_token}))["enabled"] is False

    blank = run("keys", "create", "--scope", "admin", "--name", "  ", env=env)
    assert blank.exit_code == 2
    assert "--name must not be empty" in blank.stderr


def test_db_current_and_upgrade(database_url: str) -> None:
    runner = CliRunner()
    env = {"SPECGATE_DATABASE_URL": database_url}
    before = runner.invoke(cli_app, ["db", "current"], env=env)
    assert before.exit_code == 1, before.output
    assert re.search(r"current: None\nhead: +\w+", before.stdout)

    upgraded = runner.invoke(cli_app, ["db", "upgrade"], env=env)
    assert upgraded.exit_code == 0, upgraded.output
    assert upgraded.stdout.strip() == "database at head"

    after = runner.invoke(cli_app, ["db", "current"], env=env)
    assert after.exit_code == 0, after.output
    engine = make_engine(database_url)
    try:
        current, head = migration_status(engine)
    finally:
        engine.dispose()
    assert current == head
    assert after.stdout.splitlines() == [f"current: {head}", f"head:    {head}"]


# --- apply ---------------------------------------------------------------------------------------

def test_apply_creates_then_is_unchanged_then_prints_the_diff(run: Run, live: str, token: str,
                                                              tmp_path: Path) -> None:
    doc = write(tmp_path / "seed.yaml", seed_text("seed", threshold=4))
    first = run("apply", "-f", str(doc), "-m", "first version", "--pool", "a")
    assert first.exit_code == 0, first.output
    assert "created policy seed" in first.stdout
    assert re.search(r"revision [0-9a-f]{12} \(#1\) of seed created", first.stdout)
    with api(live, token) as client:
        policy = client.get("/v1/policies/seed").json()
        assert policy["pool"] == "a"
        assert policy["revision_count"] == 1
        assert policy["active_revision_id"] == policy["head_revision_id"]  # the first revision is active
        rev1 = policy["head_revision_id"]
        assert client.get(f"/v1/revisions/{rev1}").json()["message"] == "first version"

    again = run("apply", "-f", str(doc))
    assert again.exit_code == 0, again.output
    assert again.stdout.strip() == f"unchanged: seed is already at revision {rev1[:12]}"

    write(doc, seed_text("seed", threshold=8))
    edited = run("apply", "-f", str(doc), "-m", "raise the threshold")
    assert edited.exit_code == 0, edited.output
    assert re.search(r"revision [0-9a-f]{12} \(#2\) of seed created", edited.stdout)
    lines = edited.stdout.splitlines()
    assert "-      max: 4" in lines
    assert "+      max: 8" in lines
    with api(live, token) as client:
        policy = client.get("/v1/policies/seed").json()
    assert policy["revision_count"] == 2
    assert policy["active_revision_id"] == rev1  # later revisions are drafts until rolled out
    assert policy["head_revision_id"] != rev1


def test_apply_of_an_invalid_file_exits_2_with_paths(run: Run, live: str, token: str, tmp_path: Path) -> None:
    result = run("apply", "-f", str(write(tmp_path / "broken.yaml", INVALID)))
    assert result.exit_code == 2, result.output
    assert "is invalid" in result.stderr
    assert re.search(r"rules\[0\]\.then\.engine \(line 8\): .*drfat.* \[undefined_engine\]", result.stderr)
    assert "rules[0].when.batch_size" in result.stderr
    with api(live, token) as client:
        assert client.get("/v1/policies/broken").status_code == 404  # nothing was sent

    missing = run("apply", "-f", str(tmp_path / "nope.yaml"))
    assert missing.exit_code == 2
    assert "cannot read" in missing.stderr


# --- rollouts, rollback, kill switch -------------------------------------------------------------

@pytest.fixture
def revisions(settings: ControlPlaneSettings) -> list[str]:
    """Policy `seed` (no pool): the first revision active, the second a draft."""
    _, ids = seed_policy(settings.database_url, extra_revisions=(seed_text(threshold=8),))
    return ids


def test_rollout_promote_names_the_step_it_moves_on_from(run: Run, revisions: list[str]) -> None:
    _, rev2 = revisions
    rid = as_json(run("rollout", "start", "seed", rev2, "--steps", "10,50,100", "--reason", "canary",
                      "--json"))["id"]
    # Without --expected-step: the step read just before, said on stderr.
    stepped = run("rollout", "promote", rid, "--json")
    assert json.loads(stepped.stdout)["current_step"] == 1
    assert "promoting from step 0 (10%)" in stepped.stderr
    # A step that is no longer current (someone promoted since it was shown) is refused; nothing moves.
    stale = run("rollout", "promote", rid, "--expected-step", "0")
    assert stale.exit_code == 1
    assert "current step: 1" in stale.stderr
    assert "expected_step" in stale.stderr
    assert as_json(run("rollout", "status", rid, "--json"))["current_step"] == 1
    assert as_json(run("rollout", "promote", rid, "--expected-step", "1", "--json"))["current_step"] == 2


def test_rollout_start_pause_resume_promote_and_status(run: Run, live: str, token: str,
                                                       revisions: list[str]) -> None:
    rev1, rev2 = revisions
    started = as_json(run("rollout", "start", "seed", rev2, "--steps", "50,100", "--mode", "workers",
                          "--reason", "canary the higher threshold", "--json"))
    rid = started["id"]
    assert (started["state"], started["current_percent"], started["mode"]) == ("running", 50.0, "workers")
    assert started["reason"] == "canary the higher threshold"

    assert as_json(run("rollout", "pause", rid, "--json"))["state"] == "paused"
    refused = run("rollout", "promote", rid)
    assert refused.exit_code == 1
    assert "current state: paused" in refused.stderr
    assert as_json(run("rollout", "status", rid, "--json"))["state"] == "paused"  # nothing changed

    assert as_json(run("rollout", "resume", rid, "--reason", "metrics fine", "--json"))["state"] == "running"
    stepped = as_json(run("rollout", "promote", rid, "--json"))
    assert (stepped["state"], stepped["current_step"], stepped["current_percent"]) == ("running", 1, 100.0)
    shown = run("rollout", "status", rid)  # YAML by default
    assert shown.exit_code == 0, shown.output
    assert "state: running" in shown.stdout.splitlines()

    done = as_json(run("rollout", "promote", rid, "--json"))
    assert done["state"] == "completed"
    assert done["allowed_actions"] == []
    with api(live, token) as client:
        assert client.get("/v1/policies/seed").json()["active_revision_id"] == rev2

    listing = as_json(run("rollout", "status", "--policy", "seed", "--json"))
    assert [r["id"] for r in listing["items"]] == [rid]
    assert listing["next_cursor"] is None

    # The way back is a new rollout, which can be aborted; an abort needs a reason.
    back = as_json(run("rollout", "start", "seed", rev1, "--steps", "100", "--reason", "back", "--json"))
    no_reason = run("rollout", "abort", back["id"])
    assert no_reason.exit_code == 2
    assert "--reason" in no_reason.output
    aborted = as_json(run("rollout", "abort", back["id"], "--reason", "changed my mind", "--json"))
    assert aborted["state"] == "aborted"
    again = run("rollout", "resume", back["id"])
    assert again.exit_code == 1
    assert "current state: aborted" in again.stderr
    with api(live, token) as client:
        assert client.get("/v1/policies/seed").json()["active_revision_id"] == rev2


def test_rollout_start_refusals(run: Run, revisions: list[str]) -> None:
    _, rev2 = revisions
    no_reason = run("rollout", "start", "seed", rev2)
    assert no_reason.exit_code == 2
    assert "--reason" in no_reason.output
    bad_steps = run("rollout", "start", "seed", rev2, "--steps", "10,x", "--reason", "r")
    assert bad_steps.exit_code == 2
    assert "--steps must be comma-separated numbers" in bad_steps.stderr
    refused = run("rollout", "start", "seed", rev2, "--steps", "50,20", "--reason", "r")
    assert refused.exit_code == 1
    assert "steps[1]" in refused.stderr
    assert "[not_increasing]" in refused.stderr


def test_rollback(run: Run, live: str, token: str, revisions: list[str]) -> None:
    rev1, rev2 = revisions
    rid = as_json(run("rollout", "start", "seed", rev2, "--reason", "try", "--json"))["id"]
    result = as_json(run("rollback", "seed", rev2, "--reason", "go straight there", "--json"))
    assert (result["previous_revision"], result["active_revision"]) == (rev1, rev2)
    assert result["ended_rollout"]["id"] == rid
    assert result["ended_rollout"]["state"] == "rolled_back"
    with api(live, token) as client:
        assert client.get("/v1/policies/seed").json()["active_revision_id"] == rev2

    same = run("rollback", "seed", rev2, "--reason", "again")
    assert same.exit_code == 1
    assert "already" in same.stderr
    unknown = run("rollback", "nope", rev1, "--reason", "x")
    assert unknown.exit_code == 1
    assert "does not exist" in unknown.stderr


def test_killswitch_on_off_status(run: Run) -> None:
    assert as_json(run("killswitch", "status", "--json"))["enabled"] is False
    on = as_json(run("killswitch", "on", "--reason", "incident 42", "--json"))
    assert (on["enabled"], on["changed"], on["reason"]) == (True, True, "incident 42")
    assert as_json(run("killswitch", "on", "--reason", "twice", "--json"))["changed"] is False
    status = run("killswitch", "status")
    assert status.exit_code == 0, status.output
    assert "enabled: true" in status.stdout.splitlines()
    off = as_json(run("killswitch", "off", "--reason", "resolved", "--json"))
    assert (off["enabled"], off["changed"]) == (False, True)
    assert run("killswitch", "on").exit_code == 2  # --reason is required


def test_json_prints_what_the_server_answered(run: Run, live: str, token: str, revisions: list[str]) -> None:
    rid = as_json(run("rollout", "start", "seed", revisions[1], "--reason", "try", "--json"))["id"]
    with api(live, token) as client:
        for args, path in ((["rollout", "status", rid], f"/v1/rollouts/{rid}"),
                           (["rollout", "status", "--policy", "seed"], "/v1/rollouts?policy=seed"),
                           (["killswitch", "status"], "/v1/killswitch"),
                           (["analysis", "guardrails", rid], f"/v1/rollouts/{rid}/guardrails")):
            answered = client.get(path)
            assert answered.status_code == 200, answered.text
            # every member, those the client's models leave out included (policy_id, target, ...)
            assert as_json(run(*args, "--json")) == answered.json(), args
    assert "policy_id" in as_json(run("rollout", "status", rid, "--json"))


def test_workers_lists_a_registered_worker(run: Run, live: str, settings: ControlPlaneSettings,
                                           make_key: Callable[[Scope, str], str]) -> None:
    seed_policy(settings.database_url)
    worker = bearer(make_key(Scope.worker, "pool-a"))
    with httpx.Client(base_url=live, headers=worker, timeout=10) as client:
        r = client.post("/v1/workers/register", json={"id": "gpu-node-7", "pool": "a", "labels": {"zone": "z1"}})
        assert r.status_code == 201, r.text
        expected = r.json()["expected_etag"]
    assert expected

    before = run("workers")
    assert before.exit_code == 0, before.output
    lines = before.stdout.splitlines()
    assert lines[0] == "converged: False"
    [row] = [line for line in lines if line.startswith("gpu-node-7")]
    assert "pool=a" in row
    assert f"expected={expected[:12]}" in row
    assert row.endswith("converging")

    with httpx.Client(base_url=live, headers=worker, timeout=10) as client:
        r = client.post("/v1/workers/gpu-node-7/heartbeat", json={"active_etag": expected})
        assert r.status_code == 200, r.text
    after = run("workers")
    assert after.stdout.splitlines()[0] == "converged: True"
    [row] = [line for line in after.stdout.splitlines() if line.startswith("gpu-node-7")]
    assert row.endswith(" ok")
    assert f"etag={expected[:12]}" in row

    data = as_json(run("workers", "--pool", "a", "--json"))
    assert [w["id"] for w in data["workers"]] == ["gpu-node-7"]
    assert data["fleet"]["overall"]["converged"] is True
    assert as_json(run("workers", "--pool", "b", "--json"))["workers"] == []


def test_workers_shows_gateways_and_their_replicas(run: Run, live: str, settings: ControlPlaneSettings,
                                                  make_key: Callable[[Scope, str], str]) -> None:
    seed_policy(settings.database_url)
    keys = {"gw-1": bearer(make_key(Scope.worker, "key-gw")), "node-1": bearer(make_key(Scope.worker, "key-node"))}
    replicas = [{"engine": "draft", "replica": "10.0.0.5:8000", "state": "healthy", "in_flight": 3, "running": 4.0,
                 "waiting": 0.0, "consecutive_failures": 0, "ejections": 0, "returns": 0, "next_probe_in_s": None},
                {"engine": "base", "replica": "10.0.0.6:8000", "state": "ejected", "in_flight": 0, "running": None,
                 "waiting": None, "consecutive_failures": 3, "ejections": 1, "returns": 0, "next_probe_in_s": 7.5}]
    with httpx.Client(base_url=live, timeout=10) as client:
        for wid, kind in (("gw-1", "gateway"), ("node-1", "worker")):
            r = client.post("/v1/workers/register", json={"id": wid, "pool": "a", "kind": kind}, headers=keys[wid])
            assert r.status_code == 201, r.text
        r = client.post("/v1/workers/gw-1/heartbeat", json={"replicas": replicas}, headers=keys["gw-1"])
        assert r.status_code == 200, r.text
    out = run("workers", "--kind", "gateway", "--replicas").stdout.splitlines()
    [row] = [line for line in out if line.startswith("gw-1")]
    assert " gateway " in row
    assert not [line for line in out if line.startswith("node-1")]
    [draft] = [line for line in out if "10.0.0.5:8000" in line]
    assert "healthy" in draft
    assert "in flight 3, running 4, waiting 0" in draft
    [base] = [line for line in out if "10.0.0.6:8000" in line]
    assert "ejected" in base
    assert "next probe in 8 s" in base
    every = run("workers").stdout
    assert "node-1" in every
    assert "10.0.0.5" not in every  # replicas only when asked for


def test_workers_shows_supervised_engines_and_who_waits_for_them(run: Run, live: str,
                                                                   settings: ControlPlaneSettings,
                                                                   make_key: Callable[[Scope, str], str]) -> None:
    _, (revision,) = seed_policy(settings.database_url)
    worker = bearer(make_key(Scope.worker, "pool-a"))
    with httpx.Client(base_url=live, headers=worker, timeout=10) as client:
        expected = client.post("/v1/workers/register", json={"id": "sup-1", "pool": "a"}).json()["expected_etag"]
        engine = {"engine": "draft", "state": "serving", "config_hash": "00ff", "revision": "r-previous",
                  "restarts": 2, "failed_restarts": 1, "crashes": 0, "last_error": "it exited with 1"}
        checked = {**engine, "tokenizer": {"aligned": False, "draft": "/m/d", "differences": ["eos differs"]}}
        r = client.post("/v1/workers/sup-1/heartbeat", json={"active_revision": revision, "active_etag": expected,
                                                             "supervised_engines": [checked]})
        assert r.status_code == 200, r.text
    out = run("workers", "--engines").stdout.splitlines()
    [row] = [line for line in out if line.startswith("sup-1")]
    assert row.endswith("engines behind")  # serving, but on the previous revision's arguments
    [draft] = [line for line in out if line.strip().startswith("draft")]
    assert "runs r-previous" in draft
    assert "restarts 2, failed 1, crashes 0; tokenizer misaligned: eos differs; last error: it exited with 1" in draft
    assert "r-previous" not in run("workers").stdout  # engines only when asked for
    with httpx.Client(base_url=live, headers=worker, timeout=10) as client:
        r = client.post("/v1/workers/sup-1/heartbeat", json={"supervised_engines": [
            {**engine, "state": "restarting", "revision": None, "last_error": None}]})
        assert r.status_code == 200, r.text
    out = run("workers", "--engines").stdout.splitlines()
    [row] = [line for line in out if line.startswith("sup-1")]
    assert row.endswith("engines restarting")
    [draft] = [line for line in out if line.strip().startswith("draft")]
    assert "runs -" in draft


def test_workers_follows_every_page(run: Run, settings: ControlPlaneSettings) -> None:
    ids = [f"w{i:03d}" for i in range(150)]  # the API pages by 100
    with session_for(settings.database_url) as session:
        session.add_all(Worker(id=i, pool="a", labels={}, engines={}) for i in ids)
    assert sorted(w["id"] for w in as_json(run("workers", "--json"))["workers"]) == ids
    rows = [line for line in run("workers").stdout.splitlines() if line.startswith("w")]
    assert len(rows) == 150


# --- failures of the connection and of the key ----------------------------------------------------

def test_unreachable_control_plane_exits_3(tmp_path: Path) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    runner = CliRunner()
    env = {"SPECGATE_URL": None, "SPECGATE_KEY": None}
    for args in (["killswitch", "status"], ["workers"], ["rollout", "status", "r1"],
                 ["apply", "-f", str(write(tmp_path / "seed.yaml", seed_text()))]):
        result = runner.invoke(cli_app, [*args, "--url", nowhere, "--key", "sgk_x"], env=env)
        assert result.exit_code == 3, (args, result.output)
        assert f"cannot reach the control plane at {nowhere}" in result.stderr


def test_missing_key_exits_2_and_a_wrong_one_exits_1(live: str, tmp_path: Path) -> None:
    runner = CliRunner()
    env: dict[str, str | None] = {"SPECGATE_URL": live, "SPECGATE_KEY": None}
    for args in (["killswitch", "status"], ["workers"], ["rollback", "seed", "r", "--reason", "x"],
                 ["apply", "-f", str(write(tmp_path / "seed.yaml", seed_text()))]):
        result = runner.invoke(cli_app, args, env=env)
        assert result.exit_code == 2, (args, result.output)
        assert "no API key: pass --key or set SPECGATE_KEY" in result.stderr
    wrong = runner.invoke(cli_app, ["killswitch", "status", "--key", "sgk_not-a-key"], env=env)
    assert wrong.exit_code == 1, wrong.output
    assert "Missing or invalid API key" in wrong.stderr


# --- specgate up ---------------------------------------------------------------------------------





def test_up_serves_the_examples_with_a_working_admin_key_and_stops_on_sigint(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen([*specgate_command(), "up", "--no-engines", "--data-dir", str(tmp_path / "data"),
                             "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ctrl_c_as_at_a_terminal)
    assert proc.stdout is not None
    assert proc.stderr is not None
    errors = proc.stderr
    try:
        out = line_queue(proc.stdout)
        banner: list[str] = []
        deadline = time.monotonic() + 60
        while not any(line.lstrip().startswith("admin key") for line in banner):
            assert proc.poll() is None, f"specgate up exited early ({proc.returncode}): {errors.read()}"
            assert time.monotonic() < deadline, "no banner within 60 s:\n" + "".join(banner)
            try:
                banner.append(out.get(timeout=0.5))
            except queue.Empty:
                continue
        text = "".join(banner)
        assert "specgate is up" in text
        base = re.search(r"control plane +(\S+)", text)
        key = re.search(r"admin key +(sgk_\S+)", text)
        assert base, text
        assert key, text
        assert base.group(1) == f"http://127.0.0.1:{port}"
        assert (tmp_path / "data" / "specgate.db").exists()

        with httpx.Client(base_url=base.group(1), headers=bearer(key.group(1)), timeout=10) as client:
            listed = client.get("/v1/policies")
            assert listed.status_code == 200, listed.text
            policies = {p["name"]: p for p in listed.json()}
            assert set(policies) == {"seed", "fleet", "conservative"}
            assert {n: p["pool"] for n, p in policies.items()} == {"seed": None, "fleet": "fleet",
                                                                    "conservative": "batch"}
            assert all(p["active_revision_id"] for p in policies.values())
            # An admin key: it may create keys.
            assert client.post("/v1/keys", json={"name": "x", "scope": "viewer"}).status_code == 201

        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
        assert time.monotonic() - stopped_at < 10
        assert proc.returncode == 0, errors.read()
        rest = []
        while not out.empty():
            rest.append(out.get())
        assert "stopping..." in "".join(rest)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base.group(1)}/healthz", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_refuses_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(cli_app, ["up", "--no-engines", "--data-dir", str(tmp_path), "--port", str(port)],
                                    env={"SPECGATE_DATABASE_URL": None})
    assert result.exit_code == 2, result.output
    assert f"127.0.0.1:{port} is in use" in result.stderr
