"""The worker's policy store: what an update reports, and lock-free reads."""

from __future__ import annotations

import copy
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from policies import (
    BundlePayload,
    Canary,
    CompiledBundle,
    PolicyStore,
    RequestShape,
    Revision,
    validate_data,
)
from tests.support import paths

EXAMPLES_DIR = paths.EXAMPLES


def raw(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((EXAMPLES_DIR / f"{name}.yaml").read_text())
    return data


def bundle(doc: dict[str, Any], *, canary: dict[str, Any] | None = None, percent: float = 10.0,
           kill_switch: bool = False) -> CompiledBundle:
    c = None if canary is None else Canary(Revision.of(validate_data(canary)), percent, "salt")
    return CompiledBundle(BundlePayload(Revision.of(validate_data(doc)), c, kill_switch))


def test_first_update_reports_everything_as_added() -> None:
    store = PolicyStore()
    assert store.current is None
    b = bundle(raw("multi-route"))
    update = store.update(b)
    assert store.current is b
    assert update.changed
    assert (update.previous_etag, update.etag) == (None, b.etag)
    assert (update.revision_before, update.revision_after) == (None, b.active.revision)
    assert (update.kill_switch_before, update.kill_switch_after) == (None, False)
    assert update.rules_added == ("no-structured", "extract-ngram", "chat-draft-small-batch",
                                  "chat-draft-medium-batch", "creative-plain")
    assert update.rules_removed == update.rules_changed == ()
    assert update.engines_changed == ("base", "draft", "ngram")


def test_same_etag_is_unchanged_and_keeps_the_current_bundle() -> None:
    first = bundle(raw("seed"))
    store = PolicyStore(first)
    same = bundle(raw("seed"))  # compiled again, same payload
    assert same is not first
    assert same.etag == first.etag
    update = store.update(same)
    assert not update.changed
    assert store.current is first
    assert update.previous_etag == update.etag == first.etag
    assert update.revision_before == update.revision_after
    assert update.rules_added == update.rules_removed == update.rules_changed == update.engines_changed == ()
    assert update.summary().startswith("unchanged")


def test_rule_and_engine_changes_are_reported() -> None:
    before = raw("multi-route")
    after = copy.deepcopy(before)
    rules = {r["name"]: r for r in after["rules"]}
    rules["extract-ngram"]["when"]["batch_size"]["max"] = 6  # changed
    after["rules"].remove(rules["creative-plain"])  # removed
    after["rules"].append({"name": "code-ngram", "when": {"route": ["code"]},  # added
                           "then": {"engine": "ngram"}})
    after["engines"]["ngram"]["num_speculative_tokens"] = 5  # engine changed
    after["engines"]["mtp"] = {"method": "mtp", "num_speculative_tokens": 1}  # engine added
    store = PolicyStore(bundle(before))
    old = store.current
    assert old is not None
    update = store.update(bundle(after))
    assert update.changed
    assert update.previous_etag == old.etag
    assert update.revision_before == old.active.revision != update.revision_after
    assert update.rules_added == ("code-ngram",)
    assert update.rules_removed == ("creative-plain",)
    assert update.rules_changed == ("extract-ngram",)
    assert update.engines_changed == ("mtp", "ngram")
    summary = update.summary()
    for part in ("rules added: code-ngram", "rules removed: creative-plain", "rules changed: extract-ngram",
                 "engines changed: mtp, ngram"):
        assert part in summary

    # Removing an engine is a change too (drop the rules' use of it first).
    smaller = copy.deepcopy(after)
    del smaller["engines"]["mtp"]
    assert store.update(bundle(smaller)).engines_changed == ("mtp",)


def test_reordering_rules_changes_the_revision_but_no_rule() -> None:
    before = raw("multi-route")
    after = copy.deepcopy(before)
    after["rules"][1], after["rules"][2] = after["rules"][2], after["rules"][1]
    store = PolicyStore(bundle(before))
    update = store.update(bundle(after))
    assert update.changed
    assert update.revision_before != update.revision_after
    assert update.rules_added == update.rules_removed == update.rules_changed == ()


@pytest.mark.parametrize(("before", "after"), [(False, True), (True, False)])
def test_kill_switch_flip_is_a_change(before: bool, after: bool) -> None:
    store = PolicyStore(bundle(raw("seed"), kill_switch=before))
    update = store.update(bundle(raw("seed"), kill_switch=after))
    assert update.changed
    assert (update.kill_switch_before, update.kill_switch_after) == (before, after)
    assert update.revision_before == update.revision_after
    assert update.rules_added == update.rules_removed == update.rules_changed == update.engines_changed == ()
    assert f"kill switch {'on' if after else 'off'}" in update.summary()
    assert store.current is not None
    assert store.current.kill_switch is after


def test_canary_start_and_end_are_reported() -> None:
    store = PolicyStore(bundle(raw("seed")))
    started = store.update(bundle(raw("seed"), canary=raw("multi-route")))
    canary_rev = Revision.of(validate_data(raw("multi-route"))).id
    assert started.changed
    assert (started.canary_before, started.canary_after) == (None, canary_rev)
    assert "canary" in started.summary()
    widened = store.update(bundle(raw("seed"), canary=raw("multi-route"), percent=50.0))
    assert widened.changed  # same revisions, different traffic share: a new etag
    assert widened.canary_before == widened.canary_after == canary_rev
    ended = store.update(bundle(raw("seed")))
    assert (ended.canary_before, ended.canary_after) == (canary_rev, None)


# --- concurrency --------------------------------------------------------------------

@pytest.fixture
def fast_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _variants() -> list[CompiledBundle]:
    out = []
    for i in range(6):
        doc = raw("multi-route")
        doc["name"] = f"fleet-{i}"
        doc["rules"][1]["when"]["batch_size"]["max"] = 4 + i
        canary = raw("seed") if i % 2 else None
        if canary is not None:
            canary["name"] = f"seed-{i}"
        out.append(bundle(doc, canary=canary, percent=50.0, kill_switch=(i == 5)))
    return out


@pytest.mark.usefixtures("fast_switching")
def test_readers_never_see_a_torn_or_missing_bundle() -> None:
    bundles = _variants()
    by_identity = {id(b): b for b in bundles}
    store = PolicyStore(bundles[0])
    stop = threading.Event()
    failures: list[str] = []
    seen_etags: set[str] = set()
    reads = [0]
    updates: list[Any] = []

    def writer(offset: int) -> None:
        i = offset
        while not stop.is_set():
            updates.append(store.update(bundles[i % len(bundles)]))
            i += 1

    def reader(n: int) -> None:
        shapes = [RequestShape(route=r, batch_size=b, max_tokens=64, request_id=f"{n}-{b}")
                  for r in ("extract", "chat", "creative") for b in (1, 6, 9)]
        count = 0
        while not stop.is_set():
            for shape in shapes:
                current = store.current
                if current is None:
                    failures.append("read None")
                    return
                if id(current) not in by_identity:
                    failures.append("read a bundle that was never stored")
                    return
                decision = current.decide(shape)
                policy = current.policy_for(shape.request_id)
                allowed = {current.active.revision}
                if current.canary is not None:
                    allowed.add(current.canary.revision)
                if decision.revision not in allowed or decision.revision != policy.revision:
                    failures.append(f"decision {decision} does not belong to bundle {current.etag}")
                if decision.policy != policy.name:
                    failures.append(f"decision {decision} names another policy than {policy.name}")
                if (decision.rule == "kill-switch") != current.kill_switch:
                    failures.append(f"kill switch mismatch in {decision}")
                seen_etags.add(current.etag)
                count += 1
        reads[0] += count

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(2)]
    threads += [threading.Thread(target=reader, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()
    assert not failures, failures[:5]
    assert reads[0] > 1000
    assert len(seen_etags) >= 3, "the readers should have seen the bundle change under them"
    changed = [u for u in updates if u.changed]
    assert len(changed) > 10
    # The lock orders writers: every reported change starts from a real
    # predecessor, never from the bundle it installs.
    for u in changed:
        assert u.previous_etag != u.etag
    for u in updates:
        if not u.changed:
            assert u.previous_etag == u.etag
