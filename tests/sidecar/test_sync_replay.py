"""The sidecar refuses replayed, foreign and expired bundles (issue 16, finding 4) and follows key rotations
(finding 10): what it accepts, what it keeps serving, and what survives a restart."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from policies import BundlePayload, Delivery, PolicyStore, Revision, SigningKey, canonical_json, load_policy
from sidecar.metrics import SidecarMetrics
from sidecar.replicas import InFlight
from sidecar.settings import SidecarSettings
from sidecar.sync import PolicySync, _Rejected
from tests.support import paths

POOL = "pool-a"


def _payload(kill_switch: bool = False) -> BundlePayload:
    return BundlePayload(Revision.of(load_policy((paths.EXAMPLES / "multi-route.yaml").read_text())),
                         None, kill_switch, "c" * 64)


def _envelope(key: SigningKey, *, kill_switch: bool = False, generation: int = 1, pool: str = POOL,
              expires_in: float = 3600, also: tuple[SigningKey, ...] = (), worker_id: str = "w1") -> bytes:
    delivery = Delivery(generation, pool, int(time.time() + expires_in), worker_id)
    return json.dumps(key.sign(_payload(kill_switch), delivery, also=also)).encode()


def _sync(state: Path, *trusted: SigningKey, refused: dict[str, int] | None = None) -> PolicySync:
    settings = SidecarSettings(control_plane="http://127.0.0.1:9", worker_id="w1", pool=POOL,
                               engines={"base": "http://127.0.0.1:9/a", "draft": "http://127.0.0.1:9/b"},
                               public_keys=[k.public_key_b64 for k in trusted], state_dir=state)
    sync = PolicySync(settings, PolicyStore(), refused=refused)
    sync._verifier = sync._local_verifier()
    state.mkdir(parents=True, exist_ok=True)
    return sync


async def _apply(sync: PolicySync, raw: bytes) -> bool:
    """Whether the bundle was accepted."""
    try:
        await sync._apply(raw, json.loads(raw)["etag"])
    except _Rejected:
        return False
    return True


def _kept_the_kill_switch_and_refused(sync: PolicySync, reason: str, logged: str) -> None:
    assert sync.store.current is not None
    assert sync.store.current.kill_switch is True
    assert sync.refused == {reason: 1}
    assert sync.last_error is not None
    assert logged in sync.last_error


def test_a_bundle_replayed_from_before_the_kill_switch_is_refused_and_the_newer_stays(tmp_path: Path) -> None:
    key = SigningKey.generate()
    metrics = SidecarMetrics(PolicyStore(), InFlight())
    sync = _sync(tmp_path, key, refused=metrics.bundle_refused)
    before = _envelope(key, generation=4)  # captured before the kill switch went on
    after = _envelope(key, kill_switch=True, generation=5)

    async def scenario() -> None:
        assert await _apply(sync, before)
        assert await _apply(sync, after)
        assert not await _apply(sync, before)

    asyncio.run(scenario())
    _kept_the_kill_switch_and_refused(sync, "stale_generation", "stale_generation")
    assert sync.status()["generation"] == 5
    body = metrics.render()[0].decode()
    assert 'specgate_sidecar_bundle_refused_total{reason="stale_generation"} 1.0' in body


def test_the_same_bundle_again_is_a_no_op_not_a_refusal(tmp_path: Path) -> None:
    key = SigningKey.generate()
    sync = _sync(tmp_path, key)

    async def scenario() -> None:
        assert await _apply(sync, _envelope(key, generation=3))
        # Same generation and content: re-signed with a later expiry bucket, as a long-poll herd would get.
        assert await _apply(sync, _envelope(key, generation=3, expires_in=7200))

    asyncio.run(scenario())
    assert sync.refused == {}
    assert sync.updates == 1


@pytest.mark.parametrize(("delivery", "reason"), [
    ({"generation": 3, "pool": "pool-b"}, "other_worker"),
    # same pool, another worker's envelope: during a workers-mode rollout it may carry the canary
    ({"generation": 9, "worker_id": "w2"}, "other_worker"),
    ({"generation": 9, "expires_in": -1}, "expired"),
])
def test_another_pools_or_an_expired_bundle_is_refused_while_the_current_keeps_serving(
        tmp_path: Path, delivery: dict[str, Any], reason: str) -> None:
    key = SigningKey.generate()
    sync = _sync(tmp_path, key)

    async def scenario() -> None:
        assert await _apply(sync, _envelope(key, generation=2))
        assert not await _apply(sync, _envelope(key, kill_switch=True, **delivery))

    asyncio.run(scenario())
    assert sync.refused == {reason: 1}
    assert sync.store.current is not None
    assert sync.store.current.kill_switch is False
    assert sync.high_water == 2


def test_a_pool_bound_envelope_without_a_worker_is_still_accepted(tmp_path: Path) -> None:
    # Envelopes signed before workers were bound (and last-known-good files holding one) bind the pool only.
    key = SigningKey.generate()
    sync = _sync(tmp_path, key)
    envelope = json.loads(_envelope(key, generation=2, worker_id=""))
    del envelope["payload"]["worker_id"]  # as an older control plane signed it
    envelope["signatures"] = [key.signature(canonical_json(envelope["payload"]))]

    assert asyncio.run(_apply(sync, json.dumps(envelope).encode()))
    assert sync.refused == {}
    assert sync.high_water == 2


def test_the_high_water_generation_survives_a_restart_and_an_expired_lkg_still_serves(tmp_path: Path) -> None:
    key = SigningKey.generate()
    first = _sync(tmp_path, key)

    async def scenario() -> None:
        assert await _apply(first, _envelope(key, generation=4))
        # Accepted while current; it expires while the sidecar is down.
        assert await _apply(first, _envelope(key, kill_switch=True, generation=6, expires_in=2))
        await asyncio.sleep(2.1)
        again = _sync(tmp_path, key)
        await again._load_lkg()
        assert again.store.current is not None
        assert again.store.current.kill_switch is True
        assert again.high_water == 6
        assert not await _apply(again, _envelope(key, generation=5))
        assert again.refused == {"stale_generation": 1}
        assert again.store.current.kill_switch is True

    asyncio.run(scenario())


def test_the_persisted_high_water_moves_on_when_only_the_generation_changes(tmp_path: Path) -> None:
    key = SigningKey.generate()
    first = _sync(tmp_path, key)

    async def scenario() -> None:
        assert await _apply(first, _envelope(key, generation=4))
        assert await _apply(first, _envelope(key, generation=8))  # another pool's change: same content
        again = _sync(tmp_path, key)
        await again._load_lkg()
        assert again.high_water == 8

    asyncio.run(scenario())


def test_a_sidecar_pinned_to_the_old_key_follows_a_rotation_until_the_old_key_is_dropped(tmp_path: Path) -> None:
    old, new = SigningKey.generate(), SigningKey.generate()
    sync = _sync(tmp_path, old)

    async def scenario() -> None:
        assert await _apply(sync, _envelope(old, generation=1))
        # Rotated: the new key signs first, the old one still signs too.
        assert await _apply(sync, _envelope(new, kill_switch=True, generation=2, also=(old,)))
        # The previous key dropped: the sidecar refuses and keeps its last-known-good.
        assert not await _apply(sync, _envelope(new, generation=3))

    asyncio.run(scenario())
    _kept_the_kill_switch_and_refused(sync, "invalid", "unknown key")


@pytest.mark.parametrize("edit", [
    lambda e: e.update(key_id="x", signature="y"),
    lambda e: e["payload"].update(format="specgate.bundle/v1"),
], ids=["v1-envelope", "v1-format"])
def test_an_old_format_bundle_is_refused(tmp_path: Path, edit: Any) -> None:
    key = SigningKey.generate()
    sync = _sync(tmp_path, key)
    envelope = json.loads(_envelope(key))
    edit(envelope)

    async def scenario() -> None:
        assert not await _apply(sync, json.dumps(envelope).encode())

    asyncio.run(scenario())
    assert sync.refused == {"invalid": 1}
    assert sync.store.current is None
