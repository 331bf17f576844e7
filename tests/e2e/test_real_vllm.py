"""End to end against real vLLM: control plane + ``specgate sidecar`` + vLLM CPU engines ``base`` and ``draft``.

Each test runs on SQLite and on PostgreSQL. The engines start once per session (see ``conftest.py``); the
engine-kill test comes last and covers both databases with one kill, so no engine is started twice.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema
import pytest

from tests.support.e2e import (
    EXTRACT_SCHEMA,
    SEED_POLICY,
    Answer,
    Ask,
    Load,
    SidecarProcess,
    Stack,
    StackBuilder,
    StackFactory,
    parse_decision,
    prom_samples,
    prom_sum,
    send,
)

pytestmark = pytest.mark.engines

SPEC_RULE = "chat-low-batch"  # the seed policy's one rule: chat, batch <= 4, no structured output -> draft
SPEC_FIELDS = {  # telemetry column -> vLLM's metrics.speculative_decoding field
    "spec_draft_tokens": "num_draft_tokens",
    "spec_accepted_tokens": "num_accepted_draft_tokens",
    "spec_acceptance_rate": "draft_acceptance_rate",
    "spec_mean_acceptance_length": "mean_acceptance_length",
    "spec_steps": "num_spec_steps",
}
ENGINE_FIELDS = {"engine_ttft_ms": "time_to_first_token_ms", "engine_itl_ms": "mean_itl_ms",
                 "engine_queue_ms": "queue_time_ms"}


def as_timestamp(stamp: dt.datetime) -> float:
    """A stored time (UTC; naive as the databases return it) as a POSIX timestamp."""
    return (stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC)).timestamp()


def admitted_at(row: dict[str, Any]) -> float:
    """The row's ``time``: the sidecar's wall clock when it admitted the request."""
    return as_timestamp(row["time"])


def admin(stack: Stack, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, stack.cp.base + path, timeout=30,
                         headers={"Authorization": f"Bearer {stack.cp.admin_token}"}, **kwargs)


def spec_counters(fleet_metrics: str) -> dict[str, float]:
    return {"drafted": prom_sum(fleet_metrics, "vllm:spec_decode_num_draft_tokens_total"),
            "accepted": prom_sum(fleet_metrics, "vllm:spec_decode_num_accepted_tokens_total")}


def assert_header_matches_row(answer: Answer, row: dict[str, Any]) -> None:
    d = answer.decision
    assert (d["engine"], d["rule"], d["policy"], d["revision"], d["explored"], d.get("replica")) == (
        row["decided_engine"], row["rule"], row["policy"], row["revision"], "true" if row["explored"] else "false",
        row["replica"]), \
        (answer.request_id, d, {k: row[k] for k in ("decided_engine", "rule", "policy", "revision", "explored",
                                                    "replica")})


# --- 1. the seed policy, the decision header, SQL telemetry and the engine's own numbers --------------------

def test_seed_policy_routes_low_batch_chat_to_draft_and_structured_output_to_base(make_stack: StackFactory) -> None:
    stack = make_stack()
    revision = stack.revisions[-1]
    before = spec_counters(stack.fleet.metrics("draft"))
    asks = ([Ask("chat", i) for i in range(6)] + [Ask("chat", 10 + i, stream=True) for i in range(2)]
            + [Ask("chat", 20 + i, structured=True, max_tokens=96) for i in range(2)]
            + [Ask("extract", 0, structured=True, max_tokens=96), Ask("extract", 1, stream=True, max_tokens=48)])
    t0 = time.monotonic()
    with httpx.Client(timeout=120) as client:
        answers = [send(client, stack.sidecar.url, ask, "seed") for ask in asks]  # one at a time: batch size 1
    took = time.monotonic() - t0
    assert all(a.ok for a in answers), [(a.status, a.error) for a in answers if not a.ok]
    rows = stack.rows_by_request(len(answers))
    after = spec_counters(stack.fleet.metrics("draft"))

    for a in answers:
        row = rows[a.request_id]
        speculative = a.ask.route == "chat" and not a.ask.structured
        expected = ("draft", SPEC_RULE) if speculative else ("base", "default")
        assert (a.decision["engine"], a.decision["rule"]) == expected, (a.ask, a.decision)
        assert a.decision["revision"] == revision
        assert a.fallback is None
        assert_header_matches_row(a, row)
        assert row["engine"] == row["decided_engine"] == expected[0]
        assert (row["route"], row["stream"], row["structured_output"]) == (a.ask.route, a.ask.stream, a.ask.structured)
        assert row["batch_size"] <= 4
        assert (row["status"], row["http_status"], row["fallback"], row["retries"]) == ("ok", 200, False, 0)
        assert a.usage is not None
        assert (row["prompt_tokens"], row["completion_tokens"]) == (a.usage["prompt_tokens"],
                                                                    a.usage["completion_tokens"])
        # The engine's per-request numbers, as the engine sent them, against what was stored.
        assert a.metrics is not None, f"no engine metrics in the answer to {a.ask}"
        for column, key in ENGINE_FIELDS.items():
            if a.metrics.get(key) is None:
                assert row[column] is None, (column, row[column], a.metrics)
            else:
                assert row[column] == pytest.approx(a.metrics[key], rel=1e-9, abs=1e-9), (column, a.metrics)
        if speculative:
            assert a.spec is not None, a.metrics
            for column, key in SPEC_FIELDS.items():
                assert row[column] == pytest.approx(a.spec[key], rel=1e-9), (column, row[column], a.spec)
        else:
            assert a.spec is None
            assert all(row[column] is None for column in SPEC_FIELDS)
        if a.ask.structured:  # the sidecar's quality signal: did the output parse and match the schema?
            try:
                valid = jsonschema.Draft202012Validator(EXTRACT_SCHEMA).is_valid(json.loads(a.text))
            except ValueError:
                valid = False
            assert row["structured_valid"] is valid, a.text
        else:
            assert row["structured_valid"] is None

    # The engine's own counters moved by exactly what the stored events say: no request was lost or made up.
    draft_rows = [r for r in rows.values() if r["engine"] == "draft"]
    drafted = sum(r["spec_draft_tokens"] for r in draft_rows)
    accepted = sum(r["spec_accepted_tokens"] for r in draft_rows)
    assert after["drafted"] - before["drafted"] == drafted
    assert after["accepted"] - before["accepted"] == accepted
    assert accepted > 0, "the draft model never agreed with the target: no real speculation happened"
    base_structured = sum(1 for r in rows.values() if r["structured_output"] and r["structured_valid"])
    print(f"\n{len(answers)} requests one at a time in {took:.1f} s; draft acceptance on chat "
          f"{accepted}/{drafted} = {accepted / drafted:.2f}; structured outputs valid {base_structured}/"
          f"{sum(1 for r in rows.values() if r['structured_output'])}")


# --- 2. higher concurrency: the batch-size rule -------------------------------------------------------------

def test_at_higher_concurrency_the_batch_size_rule_sends_chat_to_base(make_stack: StackFactory) -> None:
    stack = make_stack()
    workers, per_worker = 12, 3
    t0 = time.monotonic()
    with Load(stack.sidecar.url, workers, lambda i: Ask("chat", i, max_tokens=16), per_worker=per_worker,
              tag="batch") as load:
        answers = load.join()
    took = time.monotonic() - t0
    assert len(answers) == workers * per_worker
    assert all(a.ok for a in answers), [(a.status, a.error) for a in answers if not a.ok]
    rows = stack.rows_by_request(len(answers))
    for a in answers:
        row = rows[a.request_id]
        assert_header_matches_row(a, row)
        expected = ("draft", SPEC_RULE) if row["batch_size"] <= 4 else ("base", "default")
        assert (a.decision["engine"], a.decision["rule"]) == expected, (row["batch_size"], a.decision)
        assert row["engine"] == expected[0]
        assert a.fallback is None
    sizes = Counter(r["batch_size"] for r in rows.values())
    busy = sum(n for size, n in sizes.items() if size > 4)
    assert busy >= len(answers) // 2, sizes
    assert max(sizes) >= 8, sizes
    metrics = stack.sidecar.metrics()
    assert prom_sum(metrics, "specgate_sidecar_decisions_total", engine="base", rule="default") == busy
    print(f"\n{len(answers)} chat requests at concurrency {workers} in {took:.1f} s; batch sizes "
          f"{dict(sorted(sizes.items()))}; {busy} to base by the batch rule, {len(answers) - busy} to draft")


# --- 3. rollback and kill switch on a live sidecar ------------------------------------------------------------

REGRESSED = SEED_POLICY.replace("route: [chat]", "route: [classify]").replace(SPEC_RULE, "classify-low-batch")


class StateWatcher:
    """Polls the sidecar's /metrics (its active revision and kill switch) every 20 ms and notes when each state
    appeared: a second view of the swap, besides the sidecar's log."""

    def __init__(self, sidecar: SidecarProcess) -> None:
        self.sidecar = sidecar
        self.seen: list[tuple[float, tuple[str, bool]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="state-watcher")

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                try:
                    text = client.get(self.sidecar.url + "/metrics").text
                except httpx.HTTPError:
                    continue
                now = time.time()
                revisions = [ls["revision"] for ls, v in prom_samples(text, "specgate_sidecar_active_revision")
                             if ls.get("role") == "active" and v == 1]
                state = (revisions[0] if revisions else "", prom_sum(text, "specgate_sidecar_kill_switch") == 1)
                if not self.seen or self.seen[-1][1] != state:
                    self.seen.append((now, state))
                self._stop.wait(0.02)

    @contextmanager
    def running(self) -> Iterator[StateWatcher]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(10)

    def first_seen(self, state: tuple[str, bool], after: float) -> float | None:
        return next((t for t, s in self.seen if s == state and t >= after), None)


@dataclass
class Change:
    name: str
    state: tuple[str, bool]  # (active revision, kill switch) after the change
    engine: str
    rule: str
    sent: float = 0.0
    answered: float = 0.0


def test_rollback_and_kill_switch_change_routing_on_a_live_sidecar_within_a_second(
        make_stack: StackFactory) -> None:
    stack = make_stack([SEED_POLICY, REGRESSED])  # the regressed revision is live: chat is not speculated
    good, regressed = stack.revisions
    initial = Change("initial", (regressed, False), "base", "default")
    changes = [
        Change("rollback", (good, False), "draft", SPEC_RULE),
        Change("kill switch on", (good, True), "base", "kill-switch"),
        Change("kill switch off", (good, False), "draft", SPEC_RULE),
    ]
    calls: dict[str, Callable[[], httpx.Response]] = {
        "rollback": lambda: admin(stack, "POST", "/v1/policies/seed/rollback",
                                  json={"revision": good, "reason": "e2e: the regressed revision"}),
        "kill switch on": lambda: admin(stack, "PUT", "/v1/killswitch", json={"enabled": True, "reason": "e2e"}),
        "kill switch off": lambda: admin(stack, "PUT", "/v1/killswitch", json={"enabled": False, "reason": "e2e"}),
    }
    watcher = StateWatcher(stack.sidecar)
    with watcher.running(), Load(stack.sidecar.url, 2, lambda i: Ask("chat", i, max_tokens=6),
                                 tag="switch") as load:
        load.wait_for(4)
        for change in changes:
            change.sent = time.time()
            response = calls[change.name]()
            change.answered = time.time()
            assert response.status_code == 200, response.text
            # Keep the load going past the 1 s bound, until a few requests were sent (and so admitted) after it.
            load.wait_for_sent_after(change.answered + 1.0, 3)
        answers = load.stop()
    assert all(a.ok for a in answers), [(a.status, a.error) for a in answers if not a.ok]
    rows = stack.rows_by_request(len(answers))
    swaps = stack.sidecar.swaps()

    phases = [initial, *changes]
    report = []
    for a in answers:
        row = rows[a.request_id]
        assert_header_matches_row(a, row)
        state = (row["revision"], row["kill_switch"])
        phase = next((p for p in phases if p.state == state), None)
        assert phase is not None, state
        assert (row["decided_engine"], row["rule"], row["engine"]) == (phase.engine, phase.rule, phase.engine)
    admitted = sorted((admitted_at(r), (r["revision"], r["kill_switch"])) for r in rows.values())
    for k, phase in enumerate(phases):
        # Every request admitted from 1 s after the change's API call returned until the next call was sent
        # ran on the new state (and there were some); in the second of grace, the old or the new one.
        start = phase.answered + 1.0 if k else float("-inf")
        end = phases[k + 1].sent if k + 1 < len(phases) else float("inf")
        settled = [s for t, s in admitted if start < t < end]
        assert settled, (f"no request admitted between 1 s after the {phase.name} and the next change",
                         [(round(t - phase.answered, 3), s) for t, s in admitted])
        assert all(s == phase.state for s in settled), (phase.name, Counter(settled))
        if k:
            grace = [s for t, s in admitted if phase.sent <= t <= start]
            assert all(s in (phases[k - 1].state, phase.state) for s in grace), (phase.name, Counter(grace))
    for k, change in enumerate(changes):
        before, after = phases[k], change
        # The sidecar's own log says when it swapped (its clock, millisecond resolution).
        swap = next((t for t, summary in swaps if t >= change.sent - 0.01 and _summary_is(summary, before, after)),
                    None)
        assert swap is not None, (change.name, swaps)
        first = min(t for t, s in admitted if s == after.state and t >= change.sent)
        polled = watcher.first_seen(after.state, change.sent)
        report.append(f"{change.name}: API call {1000 * (change.answered - change.sent):.0f} ms; swap "
                      f"{1000 * (swap - change.answered):+.0f} ms after its answer (log), "
                      + (f"{1000 * (polled - change.answered):+.0f} ms (/metrics poll); " if polled else "")
                      + f"first request on the new policy admitted {1000 * (first - change.answered):+.0f} ms after")
        assert swap - change.answered < 1.0, report[-1]
    print("\n" + "\n".join(report))


def _summary_is(summary: str, before: Change, after: Change) -> bool:
    if before.state[0] != after.state[0]:
        return f"revision {before.state[0][:12]} -> {after.state[0][:12]}" in summary
    return f"kill switch {'on' if after.state[1] else 'off'}" in summary


# --- 4. the control plane goes away mid-load ----------------------------------------------------------------

def _mixed(i: int) -> Ask:
    return [Ask("chat", i, max_tokens=16), Ask("chat", i, stream=True, max_tokens=16),
            Ask("extract", i, max_tokens=24), Ask("chat", i, structured=True, max_tokens=24)][i % 4]


def test_the_control_plane_stops_mid_load_the_sidecar_serves_on_and_every_event_arrives_once(
        make_stack: StackFactory) -> None:
    stack = make_stack()
    revision = stack.revisions[-1]
    with Load(stack.sidecar.url, 2, _mixed, tag="outage") as load:
        load.wait_for(8)
        down = time.time()
        stack.cp.stop()  # SIGTERM: it stops taking connections at once, cuts its long-polls after 5 s
        stopped = time.time()
        n = load.count()
        load.wait_for(n + 12)
        assert httpx.get(stack.sidecar.url + "/readyz", timeout=5).status_code == 200
        depth = prom_sum(stack.sidecar.metrics(), "specgate_sidecar_telemetry_queue_depth")
        restart = time.time()
        stack.cp.start()
        up = time.time()
        n = load.count()
        load.wait_for(n + 8)
        answers = load.stop()
    assert all(a.ok for a in answers), [(a.status, a.error) for a in answers if not a.ok]
    # Served while no control plane ran: from the moment its process had exited. Between SIGTERM and that
    # moment it drains (long-polls are cut after 5 s) and may still take a batch on a connection it serves, so
    # a request sent then can be stored before the restart (seen once, 6.9 s before it, on 2 busy cores).
    during = [a for a in answers if stopped < a.sent_at and a.done_at < up]
    assert len(during) >= 10
    for a in answers:  # served on the last-known-good policy throughout
        speculative = a.ask.route == "chat" and not a.ask.structured
        assert (a.decision["engine"], a.decision["revision"]) == ("draft" if speculative else "base", revision)
    t0 = time.monotonic()
    rows = stack.rows_by_request(len(answers), timeout=90)  # each request exactly once
    drained = time.monotonic() - t0
    assert set(rows) == {a.request_id for a in answers}
    for a in answers:
        assert_header_matches_row(a, rows[a.request_id])
    late = [rows[a.request_id] for a in during]
    # They had waited in the spool: received once the control plane was started again. `restart` is the bound,
    # not `up`: `up` is read after the test's own health poll answered, which on loaded cores came later than
    # the sidecar's first retry (a CI run on 2 busy cores failed an `up - 0.5` bound that way).
    early = [(r["request_id"], round(as_timestamp(r["received_at"]) - restart, 3)) for r in late
             if as_timestamp(r["received_at"]) < restart]
    assert not early, early
    assert prom_sum(stack.sidecar.metrics(), "specgate_sidecar_telemetry_queue_depth") == 0
    print(f"\n{len(answers)} requests, {len(during)} while the control plane was down for {up - down:.1f} s "
          f"(stopping {stopped - down:.1f} s, starting {up - restart:.1f} s) "
          f"(telemetry queue {depth:.0f} deep then); all {len(rows)} events stored once, the last "
          f"{drained:.1f} s after the load ended")


# --- 5. the speculative engine dies mid-load ---------------------------------------------------------------
# One kill serves both databases: a stack on each, under load at once, so the engine (a minute or more to
# start) is killed once per session. Last in the module; a later test that needs it starts it again.

# Speculate on chat at any batch size: six requests in flight on one engine must all be meant for it.
ALWAYS_DRAFT = SEED_POLICY.replace("batch_size: {max: 4}", "batch_size: {max: 64}")


# What a SIGKILLed engine looks like to the sidecar: a request in flight sees its connection close, a new one
# is refused. Nothing else (a 5xx, a read timeout) may be the reason of a fallback here.
ENGINE_GONE = {"upstream_disconnected", "connect_error"}
# Once the sidecar has ejected the dead engine (sidecar/replicas.py), requests go to base without trying it.
EJECTED = "pool_unavailable"


def test_the_speculative_engine_is_killed_mid_load_requests_fall_back_and_none_fail_on_both_databases(
        build_stack: StackBuilder, both_databases: dict[str, str]) -> None:
    stacks = {db: build_stack(url, [ALWAYS_DRAFT]) for db, url in both_databases.items()}
    fleet = next(iter(stacks.values())).fleet
    workers = 3
    # Non-streaming only: a stream whose first bytes reached the client cannot move to another engine.
    loads = {db: Load(stack.sidecar.url, workers, lambda i: Ask("chat", i, max_tokens=32), tag=f"kill-{db}")
             for db, stack in stacks.items()}
    with contextlib.ExitStack() as running:
        for load in loads.values():
            running.enter_context(load)
        for load in loads.values():
            load.wait_for(5)
        killed = fleet.kill("draft")
        gone = time.time()  # kill() returns once the engine's port is closed: from here a connection is refused
        counts = {db: load.count() for db, load in loads.items()}
        for db, load in loads.items():
            load.wait_for(counts[db] + 12)
        answers = {db: load.stop() for db, load in loads.items()}

    report = []
    for db, stack in stacks.items():
        got = answers[db]
        # Every request was answered, with text: none failed. The policy chose draft for every one.
        assert [(a.request_id, a.status, a.error) for a in got if not (a.ok and a.text)] == [], db
        assert {a.decision["engine"] for a in got} == {"draft"}, db
        fallbacks = {a.request_id: parse_decision(a.fallback) for a in got if a.fallback is not None}
        assert all(f["engine"] == "base" and f["reason"] in ENGINE_GONE | {EJECTED}
                   for f in fallbacks.values()), (db, fallbacks)
        # Before the kill the draft engine served; after it every request fell back to base. Of the 12 answers
        # awaited after the kill, at most one per worker was sent before it.
        before = [a for a in got if a.done_at < killed]
        after = [a for a in got if a.sent_at > gone]
        assert len(before) >= 5, db
        assert [a.fallback for a in before if a.fallback is not None] == [], db
        assert len(after) >= 12 - workers, (db, len(after))
        # Sent after the kill: refused connections, retried on base, until the failures (or the scrapes that
        # could not connect) ejected the engine; from then on straight to base, with nothing tried.
        reasons_after = [fallbacks.get(a.request_id, {}).get("reason") for a in sorted(after, key=lambda a: a.sent_at)]
        assert set(reasons_after) <= {"connect_error", EJECTED}, (db, reasons_after)
        assert reasons_after[-1] == EJECTED, (db, reasons_after)
        assert reasons_after.count("connect_error") <= 3 + workers, (db, reasons_after)

        # Telemetry: exactly one row per answered request, saying what its headers said.
        rows = stack.rows_by_request(len(got))
        assert set(rows) == {a.request_id for a in got}, db
        for a in got:
            row = rows[a.request_id]
            assert_header_matches_row(a, row)
            fallback = fallbacks.get(a.request_id)
            expected = (("ok", "draft", False, 0, None) if fallback is None
                        else ("ok", "base", True, 0 if fallback["reason"] == EJECTED else 1, fallback["reason"]))
            assert (row["status"], row["engine"], row["fallback"], row["retries"], row["fallback_reason"]) \
                == expected, (db, a.request_id, a.fallback)
            if fallback is not None:  # base does not speculate: no draft numbers for a fallback
                assert row["spec_draft_tokens"] is None, (db, a.request_id)

        # The sidecar's own counters: one failed try on draft per fallback that tried it, one answer from base
        # per fallback, and the draft engine ejected.
        reasons = Counter(f["reason"] for f in fallbacks.values())
        metrics = stack.sidecar.metrics()
        assert {ls["reason"]: v for ls, v in prom_samples(metrics, "specgate_sidecar_fallbacks_total")} == reasons
        assert prom_sum(metrics, "specgate_sidecar_upstream_errors_total", engine="draft") == \
            len(fallbacks) - reasons[EJECTED]
        assert prom_sum(metrics, "specgate_sidecar_requests_total", engine="base", status="ok") == len(fallbacks)
        assert prom_sum(metrics, "specgate_sidecar_replica_healthy", engine="draft") == 0
        assert prom_sum(metrics, "specgate_sidecar_replica_ejections_total", engine="draft") == 1

        in_flight = sum(1 for a in got if a.fallback is not None and a.sent_at < killed)
        report.append(f"{db}: {len(got)} requests, {len(before)} done before the kill; {len(fallbacks)} fell back "
                      f"to base ({in_flight} of them in flight at the kill; {dict(reasons)}), none failed")
    print("\n" + "\n".join(report))
