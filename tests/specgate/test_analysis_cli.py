"""``specgate analysis ...`` and ``specgate recommend ...`` against a live control plane."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.settings import ControlPlaneSettings
from policies import RequestShape, compile_policy, load_policy
from specgate.cli import app as cli_app
from tests.support.live import serve
from tests.support.telemetry_data import policy_text, recorded_window, seed


@pytest.fixture
def live(migrated_url: str) -> Iterator[str]:
    settings = ControlPlaneSettings(database_url=migrated_url, guardrail_interval_s=0)
    with serve(create_app(settings)) as url:
        yield url


# What tests.support.telemetry_data.recorded_window stores: per batch size 450 requests, one in three
# explored (the policy speculates up to batch size 4, so there 300 speculative and 150 plain, above it the
# other way round), chat at 1, 2, 3, 6 and 12 plus 6 requests at 20, summarize at 1, 2 and 3; every
# speculative request has 60 of its 90 drafted tokens accepted. Speculation's ITL beats the plain 20 ms on
# chat up to batch size 6 (12-15 ms) and loses at 12 (26 ms) and everywhere on summarize (26 ms).
REQUESTS = {"chat": 5 * 450 + 6, "summarize": 3 * 450}
ACCEPTANCE = 60 / 90
CHAT_BUCKETS = {"1": (300, 150, "wins"), "2": (300, 150, "wins"), "3-4": (300, 150, "wins"),
                "5-8": (150, 300, "wins"), "9-16": (150, 300, "loses"), "17-32": (2, 4, "insufficient evidence")}

SUMMARY_LINE = re.compile(r"route=(?P<route>\S+) +n=(?P<n>\d+) +acc=(?P<acc>\S+) "
                          r"itl p50/p95=(?P<p50>\S+)/(?P<p95>\S+)ms e2e p95=(?P<e2e>\S+)ms "
                          r"retries=(?P<retries>\S+) err=(?P<err>\S+)")
SPEEDUP_LINE = re.compile(r"(?P<route>\S+) +batch (?P<range>\S+) +(?P<measure>e2e|itl) speedup (?P<ratio>\S+) "
                          r"\[(?P<low>\S+), "
                          r"(?P<high>\S+)\] +n=(?P<spec>\d+)/(?P<plain>\d+) +theory=(?P<theory>\S+) "
                          r"(?P<verdict>.+) \((?P<source>\w+)\)")
RECOMMENDATION_LINE = re.compile(r"\[(?P<confidence>\w+)\] (?P<id>[0-9a-f]{20})  (?P<title>.+)")
APPLIED_LINE = re.compile(r"draft revision (?P<revision>[0-9a-f]{64}) \(seq (?P<seq>\d+)\): (?P<message>.+)")


def _shown(text: str, value: float | None) -> bool:
    """Whether ``text`` is how the CLI prints ``value`` (three significant digits; ``-`` for none)."""
    if value is None:
        return text == "-"
    return float(text) == pytest.approx(value, rel=5e-3, abs=1e-12)


def _lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.strip()]


def test_summary_speedups_recommend_offline_and_apply(live: str, migrated_url: str, tmp_path: Path,
                                                      make_key: Callable[[Scope, str], str]) -> None:
    (rid,) = seed(migrated_url, policy_text())
    recorded_window(migrated_url, rid)
    key = make_key(Scope.admin, "cli-admin")
    env = {"SPECGATE_URL": live, "SPECGATE_KEY": key}
    runner = CliRunner()

    def run(*args: str) -> tuple[int, str]:
        result = runner.invoke(cli_app, list(args), env=env)
        return result.exit_code, result.output

    with httpx.Client(base_url=live, headers={"Authorization": f"Bearer {key}"}, timeout=30) as api:
        # summary: --json is the API's answer for the same query, and the text prints its numbers
        summary = api.get("/v1/analysis/summary", params={"group_by": "route"}).json()
        code, out = run("analysis", "summary", "--group-by", "route", "--json")
        assert code == 0, out
        assert json.loads(out) == summary
        rows = {row["key"]["route"]: row for row in summary["rows"]}
        assert {route: row["requests"] for route, row in rows.items()} == REQUESTS
        assert {route: row["acceptance_rate"] for route, row in rows.items()} == pytest.approx(
            {"chat": ACCEPTANCE, "summarize": ACCEPTANCE})
        code, out = run("analysis", "summary", "--group-by", "route")
        assert code == 0, out
        printed = [SUMMARY_LINE.fullmatch(line.rstrip()) for line in _lines(out)]
        assert all(printed), out
        assert [m["route"] for m in printed if m] == list(rows)
        for m in printed:
            assert m is not None
            row = rows[m["route"]]
            assert int(m["n"]) == row["requests"]
            for text, value in ((m["acc"], row["acceptance_rate"]), (m["p50"], row["itl_ms"]["p50"]),
                                (m["p95"], row["itl_ms"]["p95"]), (m["e2e"], row["e2e_ms"]["p95"]),
                                (m["retries"], row["retry_rate"]), (m["err"], row["error_rate"])):
                assert _shown(text, value), (m.group(0), text, value)

        # speedups: the same, and the verdicts the recorded window must give
        query = {"policy": "seed", "route": "chat"}
        speedups = api.get("/v1/analysis/speedups", params=query).json()
        code, out = run("analysis", "speedups", "--policy", "seed", "--route", "chat", "--json")
        assert code == 0, out
        assert json.loads(out) == speedups
        assert {r["batch_range"]: (r["n_speculative"], r["n_plain"], r["verdict"]) for r in speedups["rows"]} \
            == CHAT_BUCKETS
        code, out = run("analysis", "speedups", "--policy", "seed", "--route", "chat")
        assert code == 0, out
        printed = [SPEEDUP_LINE.fullmatch(line.rstrip()) for line in _lines(out)]
        assert all(printed), out
        assert len(printed) == len(speedups["rows"])
        for m, row in zip(printed, speedups["rows"], strict=True):
            assert m is not None
            est = row[f"{row['measure']}_speedup"]  # the interval the verdict read
            assert (m["route"], m["range"], m["verdict"], m["source"]) == ("chat", row["batch_range"], row["verdict"],
                                                                            row["source"])
            assert m["measure"] == row["measure"]
            assert (int(m["spec"]), int(m["plain"])) == (row["n_speculative"], row["n_plain"])
            assert [float(m[f]) for f in ("ratio", "low", "high")] == pytest.approx(
                [est["ratio"], est["low"], est["high"]], abs=0.005)
            assert _shown(m["theory"], row["theory"]["speedup"])

        # recommendations: chat's threshold goes up to the last winning bucket, summarize is excluded
        listing = api.get("/v1/recommendations", params={"policy": "seed"}).json()
        code, out = run("recommend", "list", "--policy", "seed", "--json")
        assert code == 0, out
        assert json.loads(out) == listing
        listed = listing["recommendations"]
        assert [(r["kind"], r["route"], r["edit"]) for r in listed] == [
            ("raise_threshold", "chat", {"kind": "set_batch_max", "route": "chat", "batch_max": 8}),
            ("exclude_route", "summarize", {"kind": "exclude_route", "route": "summarize"})]
        code, out = run("recommend", "list", "--policy", "seed")
        assert code == 0, out
        header, *lines = _lines(out)
        assert header == f"for the active revision {rid} of seed; head {rid} (apply with --head {rid})"
        assert len(lines) == 2 * len(listed), out
        for head, message, rec in zip(lines[::2], lines[1::2], listed, strict=True):
            m = RECOMMENDATION_LINE.fullmatch(head)
            assert m is not None, head
            assert (m["confidence"], m["id"], m["title"]) == (rec["confidence"], rec["id"], rec["title"])
            assert message.strip() == rec["message"]

        # offline on the exported cells: the same recommendations as the control plane's, ids included
        cells = tmp_path / "cells.json"
        code, out = run("analysis", "cells", "--policy", "seed", "--out", str(cells))
        assert code == 0, out
        exported = api.get("/v1/analysis/cells", params={"policy": "seed"}).json()
        assert json.loads(cells.read_text()) == exported
        assert out.strip() == f"{len(exported['cells'])} cells written to {cells}"
        policy_file = tmp_path / "policy.yaml"
        policy_file.write_text(policy_text())
        code, out = run("recommend", "offline", "--cells", str(cells), "--policy-file", str(policy_file), "--json")
        assert code == 0, out
        assert json.loads(out) == listed

        # apply: a draft revision (not active) with the edit, built on the head the listing showed
        raise_chat = listed[0]
        code, out = run("recommend", "apply", raise_chat["id"], "--policy", "seed", "--head", "f" * 64)
        assert code == 1, out
        assert "Precondition failed" in out
        assert f"If-Match: the head is {rid} [stale]" in out
        code, out = run("recommend", "apply", raise_chat["id"], "--policy", "seed", "--head", listing["head"])
        assert code == 0, out
        applied = APPLIED_LINE.fullmatch(out.strip())
        assert applied is not None, out
        revision = api.get(f"/v1/revisions/{applied['revision']}").json()
        assert (revision["policy"], revision["seq"], revision["message"], revision["active"]) == (
            "seed", int(applied["seq"]), applied["message"], False)
        assert int(applied["seq"]) == 2
        # the edit splits the rule chat shares with summarize: chat speculates up to 8, summarize still up to 4
        decide = compile_policy(load_policy(json.dumps(revision["document"]))).decide
        assert {(route, size): decide(RequestShape(route=route, batch_size=size)).engine
                for route in ("chat", "summarize") for size in (4, 5, 8, 9)} == {
            ("chat", 4): "draft", ("chat", 5): "draft", ("chat", 8): "draft", ("chat", 9): "base",
            ("summarize", 4): "draft", ("summarize", 5): "base", ("summarize", 8): "base", ("summarize", 9): "base"}
        assert api.get("/v1/policies/seed").json()["active_revision_id"] == rid

    code, out = run("recommend", "apply", "f" * 20, "--policy", "seed")
    assert code == 1
    assert "does not hold" in out

    code, out = run("analysis", "summary", "--group-by", "colour")
    assert code == 1
    assert "group_by[0]" in out
    code, out = run("recommend", "offline", "--cells", str(tmp_path / "missing.json"), "--policy-file",
                    str(policy_file))
    assert code == 2
    assert "cannot read the input" in out


def test_summary_prints_the_shadow_comparisons_of_the_groups_that_have_them(
        live: str, migrated_url: str, make_key: Callable[[Scope, str], str]) -> None:
    from tests.support.telemetry_data import T0, event, store

    (rid,) = seed(migrated_url, policy_text())
    events = []
    for i in range(40):
        e = event(revision=rid, route="extract", time=T0, structured=True if i < 10 else None)
        if i < 25:  # 24 of 25 matched; the one that differs did after 31 tokens
            e.update(shadow_match=i > 0, shadow_first_diff=31 if i == 0 else None,
                     shadow_check_passed=None if i >= 5 else i != 1)
            if i < 10:
                e.update(structured_valid=True, shadow_structured_valid=i % 2 == 0)
        events.append(e)
    events += [event(revision=rid, route="chat", time=T0) for _ in range(5)]
    store(migrated_url, events)
    result = CliRunner().invoke(cli_app, ["analysis", "summary", "--group-by", "route"],
                                env={"SPECGATE_URL": live, "SPECGATE_KEY": make_key(Scope.viewer, "cli-viewer")})
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line.rstrip() for line in _lines(result.output)}
    # a group without comparisons prints what it printed before
    assert SUMMARY_LINE.fullmatch(lines["route=chat"])
    figures, _, shadow = lines["route=extract"].partition(" shadow ")
    assert SUMMARY_LINE.fullmatch(figures)
    assert shadow == ("24/25 matched 96.0% [80.5%, 99.3%] first_diff=31 structured valid served/plain=1/0.5 of 10 "
                      "check failed 1/5")
