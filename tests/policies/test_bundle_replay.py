"""The v2 bundle envelope: delivery (generation, pool, expiry) under the signature, several signing keys,
strict format checks, and the cohort secret carried to the compiled policies (issue 16, findings 4 and 10)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from policies import (
    BUNDLE_FORMAT,
    BundleFormatError,
    BundlePayload,
    BundleSignatureError,
    BundleVerifier,
    CompiledBundle,
    Delivery,
    RequestShape,
    Revision,
    SigningKey,
    canonical_json,
    canonical_members,
    envelope_bytes,
    interpret,
    load_policy,
)
from tests.support import paths


def _multi_route() -> Revision:
    return Revision.of(load_policy((paths.EXAMPLES / "multi-route.yaml").read_text()))


def _payload(*, kill_switch: bool = False, cohort_secret: str = "") -> BundlePayload:
    return BundlePayload(_multi_route(), None, kill_switch, cohort_secret)


DELIVERY = Delivery(generation=7, pool="pool-a", expires_at=2_000_000_000, worker_id="w1")


def test_delivery_is_signed_but_not_part_of_the_etag() -> None:
    key = SigningKey.generate()
    payload = _payload()
    envelope = key.sign(payload, DELIVERY)
    signed = BundleVerifier([key.public_key_b64]).verify_envelope(envelope)
    assert signed.delivery == DELIVERY
    assert signed.payload == payload
    # The same content delivered later, elsewhere, keeps its ETag: If-None-Match and caches still work.
    later = key.sign(payload, Delivery(9, "pool-b", 2_000_000_100))
    assert later["etag"] == envelope["etag"] == payload.etag
    assert later["signatures"] != envelope["signatures"]


@pytest.mark.parametrize(("field", "value"), [("generation", 8), ("pool", "pool-b"), ("expires_at", 2_100_000_000),
                                                ("worker_id", "w2")])
def test_editing_the_delivery_breaks_the_signature(field: str, value: Any) -> None:
    key = SigningKey.generate()
    envelope = key.sign(_payload(), DELIVERY)
    envelope["payload"][field] = value
    with pytest.raises(BundleSignatureError, match="does not match"):
        BundleVerifier([key.public_key_b64]).verify_envelope(envelope)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("generation", -1, "generation"), ("generation", True, "generation"), ("generation", "7", "generation"),
    ("pool", None, "pool"), ("expires_at", 1.5, "expires_at"), ("worker_id", 7, "worker_id")])
def test_malformed_delivery_is_refused_even_when_signed(field: str, value: Any, match: str) -> None:
    key = SigningKey.generate()
    envelope = key.sign(_payload(), DELIVERY)
    payload = copy.deepcopy(envelope["payload"])
    payload[field] = value
    # Re-signed, so only the delivery's own checks can catch it.
    body = canonical_json(payload)
    envelope = {"payload": payload, "etag": envelope["etag"], "signatures": [key.signature(body)]}
    with pytest.raises(BundleFormatError, match=match):
        BundleVerifier([key.public_key_b64]).verify_envelope(envelope)


def test_a_v1_envelope_is_refused_with_a_clear_error() -> None:
    key = SigningKey.generate()
    envelope = key.sign(_payload(), DELIVERY)
    # The v1 shape: one key_id and signature at the top.
    v1 = {"payload": envelope["payload"], "etag": envelope["etag"], **envelope["signatures"][0]}
    with pytest.raises(BundleFormatError, match="unknown fields: key_id, signature"):
        BundleVerifier([key.public_key_b64]).verify_envelope(v1)


def test_an_unknown_format_is_refused() -> None:
    data = _payload().to_dict()
    assert data["format"] == BUNDLE_FORMAT == "specgate.bundle/v2"
    data["format"] = "specgate.bundle/v1"
    with pytest.raises(BundleFormatError, match=r"specgate\.bundle/v1"):
        BundlePayload.from_dict(data)


def test_a_missing_delivery_is_refused() -> None:
    key = SigningKey.generate()
    payload = _payload().to_dict()
    envelope = {"payload": payload, "etag": _payload().etag,
                "signatures": [key.signature(canonical_json(payload))]}
    with pytest.raises(BundleFormatError, match="lacks expires_at, generation, pool"):
        BundleVerifier([key.public_key_b64]).verify_envelope(envelope)


def test_two_keys_sign_and_a_verifier_pinned_to_either_accepts() -> None:
    old, new = SigningKey.generate(), SigningKey.generate()
    envelope = new.sign(_payload(), DELIVERY, also=[old])
    assert [s["key_id"] for s in envelope["signatures"]] == [new.key_id, old.key_id]
    for pinned in (old, new):
        assert BundleVerifier([pinned.public_key_b64]).verify(envelope) == _payload()
    # Once the old key stops signing, a sidecar pinned only to it refuses.
    with pytest.raises(BundleSignatureError, match="unknown key"):
        BundleVerifier([old.public_key_b64]).verify(new.sign(_payload(), DELIVERY))


def test_a_bad_signature_by_a_trusted_key_is_not_excused_by_another() -> None:
    old, new = SigningKey.generate(), SigningKey.generate()
    envelope = new.sign(_payload(), DELIVERY, also=[old])
    envelope["signatures"][1]["signature"] = envelope["signatures"][0]["signature"]
    with pytest.raises(BundleSignatureError, match="does not match"):
        BundleVerifier([old.public_key_b64, new.public_key_b64]).verify(envelope)


def test_the_cohort_secret_is_content_and_signed() -> None:
    assert _payload(cohort_secret="a").etag != _payload(cohort_secret="b").etag
    key = SigningKey.generate()
    envelope = key.sign(_payload(cohort_secret="a"), DELIVERY)
    envelope["payload"]["cohort_secret"] = "b"
    with pytest.raises(BundleSignatureError):
        BundleVerifier([key.public_key_b64]).verify(envelope)


def test_the_cohort_secret_moves_requests_between_exploration_cohorts() -> None:
    revision = _multi_route()
    ids = [f"req-{i}" for i in range(2000)]

    def explored(secret: str) -> set[str]:
        bundle = CompiledBundle(_payload(cohort_secret=secret))
        return {i for i in ids if bundle.decide(RequestShape(request_id=i)).explored}

    one, two, public = explored("s" * 64), explored("t" * 64), explored("")
    assert one
    assert two
    assert public
    assert one != two
    assert one != public
    # The compiled bundle decides exactly as the reference interpreter given the same secret.
    for i in ids[:300]:
        shape = RequestShape(request_id=i)
        assert (CompiledBundle(_payload(cohort_secret="s" * 64)).decide(shape)
                == interpret(revision.document, shape, revision.id, cohort_secret="s" * 64))


@pytest.mark.parametrize("canary_percent", [None, 12.5])
def test_envelope_bytes_from_canonical_members_are_the_signed_envelope(canary_percent: float | None) -> None:
    # The control plane serialises a content's members once and joins them per worker: the signed body must
    # stay byte for byte canonical JSON of content and delivery, or sidecars would refuse every envelope.
    from policies import Canary

    old, new = SigningKey.generate(), SigningKey.generate()
    canary = None if canary_percent is None else Canary(_multi_route(), canary_percent, "salt-é")
    payload = BundlePayload(_multi_route(), canary, True, "secret-ü")
    delivery = Delivery(generation=2**40, pool="pool-é", expires_at=2_000_000_000, worker_id="w/1")
    raw = envelope_bytes([new, old], canonical_members(payload), payload.etag, delivery)
    signed = {**payload.to_dict(), **delivery.to_dict()}
    body = canonical_json(signed)
    assert json.loads(raw) == {"payload": signed, "etag": payload.etag,
                               "signatures": [new.signature(body), old.signature(body)]}
    for key in (old, new):
        signed = BundleVerifier([key.public_key_b64]).verify_envelope(json.loads(raw))
        assert (signed.payload, signed.delivery) == (payload, delivery)
    assert raw[len(b'{"payload":'):raw.index(b',"etag":')] == body
