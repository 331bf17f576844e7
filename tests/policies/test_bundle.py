"""Canonical encoding, revision ids, signed bundles, canaries and the kill switch."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import math
import random
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import (
    BUNDLE_FORMAT,
    BundleError,
    BundleFormatError,
    BundlePayload,
    BundleSignatureError,
    BundleVerifier,
    Canary,
    CompiledBundle,
    PolicyDocument,
    RequestShape,
    Revision,
    SigningKey,
    canonical_document,
    canonical_json,
    canonical_yaml,
    load_policy,
    revision_id,
    validate_data,
)
from tests.support import paths
from tests.support.policy_strategies import raw_documents, shapes, validate_generated

EXAMPLES_DIR = paths.EXAMPLES


def example(name: str) -> PolicyDocument:
    return load_policy((EXAMPLES_DIR / f"{name}.yaml").read_text())


def raw_example(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((EXAMPLES_DIR / f"{name}.yaml").read_text())
    return data


@pytest.fixture(scope="module")
def key() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture(scope="module")
def verifier(key: SigningKey) -> BundleVerifier:
    return BundleVerifier([key.public_key_b64])


def sign_raw(key: SigningKey, payload: dict[str, Any]) -> dict[str, Any]:
    """Sign arbitrary payload data with the key, as a compromised-free signer would.

    Used to show that checks after the signature (etag, revision ids, document
    validity) hold on their own, for payloads a buggy control plane could sign.
    """
    private = Ed25519PrivateKey.from_private_bytes(base64.b64decode(key.private_key_b64()))
    delivery = {"generation": 0, "pool": "", "expires_at": 0, "worker_id": ""}
    signed = {**payload, **{k: v for k, v in delivery.items() if k not in payload}}
    content = {k: v for k, v in signed.items() if k not in delivery}
    body = canonical_json(signed)
    return {
        "payload": signed,
        "etag": hashlib.sha256(canonical_json(content)).hexdigest(),
        "signatures": [{"key_id": key.key_id, "signature": base64.b64encode(private.sign(body)).decode()}],
    }


def over_the_wire(envelope: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(json.dumps(envelope))
    return result


# --- canonical JSON and revision ids -------------------------------------------------

def _reverse_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _reverse_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reverse_keys(v) for v in value]
    return value


def test_canonical_json_ignores_key_order_and_whitespace() -> None:
    a = {"b": [1, {"y": 2, "x": 1}], "a": "caf\u00e9", "c": 0.1}
    b = {"c": 0.1, "a": "caf\u00e9", "b": [1, {"x": 1, "y": 2}]}
    assert canonical_json(a) == canonical_json(b)
    assert canonical_json(a) == '{"a":"caf\u00e9","b":[1,{"x":1,"y":2}],"c":0.1}'.encode()


def test_canonical_json_rejects_nan() -> None:
    with pytest.raises(ValueError, match="JSON compliant"):
        canonical_json({"x": float("nan")})


@pytest.mark.parametrize("name", ["seed", "conservative", "multi-route"])
def test_key_order_does_not_change_the_revision(name: str) -> None:
    raw = raw_example(name)
    reordered = _reverse_keys(raw)
    assert list(reordered) != list(raw)
    assert revision_id(validate_data(reordered)) == revision_id(example(name))


def test_spelled_out_defaults_do_not_change_the_revision() -> None:
    terse = raw_example("seed")
    verbose = copy.deepcopy(terse)
    verbose["exploration"] = {"rate": 0.0}
    verbose["guardrails"] = {"max_p95_itl_regression": 0.1, "max_retry_rate_increase": 0.02,
                             "min_samples": 200}
    verbose["description"] = None
    verbose["plain_engine"] = None
    verbose["rules"][0]["description"] = None
    assert revision_id(validate_data(verbose)) == revision_id(validate_data(terse))

    no_rules = {k: v for k, v in terse.items() if k != "rules"}
    assert revision_id(validate_data(no_rules)) == revision_id(validate_data({**no_rules, "rules": []}))

    unconditional = {**terse, "rules": [{"name": "all", "then": {"engine": "base"}}]}
    assert revision_id(validate_data(unconditional)) == revision_id(validate_data(
        {**terse, "rules": [{"name": "all", "when": {}, "then": {"engine": "base"}}]}))

    with_int = {**terse, "exploration": {"rate": 0}}
    assert revision_id(validate_data(with_int)) == revision_id(validate_data(terse))


def test_one_label_value_and_a_list_of_one_are_the_same_revision() -> None:
    def with_labels(value: Any) -> dict[str, Any]:
        raw = raw_example("seed")
        raw["rules"][0]["when"]["labels"] = {"tier": value}
        return raw

    one = validate_data(with_labels("gold"))
    assert revision_id(one) == revision_id(validate_data(with_labels(["gold"])))
    assert revision_id(one) != revision_id(validate_data(with_labels(["gold", "silver"])))


@pytest.mark.parametrize("name", ["seed", "conservative", "multi-route"])
def test_canonical_forms_read_back_to_the_same_revision(name: str) -> None:
    doc = example(name)
    assert validate_data(canonical_document(doc)) == doc
    assert revision_id(load_policy(canonical_yaml(doc))) == revision_id(doc)
    assert revision_id(load_policy(canonical_json(canonical_document(doc)))) == revision_id(doc)
    assert revision_id(doc) == hashlib.sha256(canonical_json(canonical_document(doc))).hexdigest()


@pytest.mark.parametrize("change", [
    lambda d: d["rules"][1]["when"]["batch_size"].update(max=9),
    lambda d: d["rules"][1]["then"].update(num_speculative_tokens=2),
    lambda d: d["rules"][1]["when"]["route"].append("qa"),
    lambda d: d["rules"].reverse(),
    lambda d: d["engines"]["ngram"].update(num_speculative_tokens=5),
    lambda d: d["exploration"].update(rate=0.06),
    lambda d: d["guardrails"].update(min_samples=301),
    lambda d: d.update(description="changed"),
    lambda d: d["rules"][0].update(description="changed"),
], ids=["batch-max", "rule-k", "route", "rule-order", "engine-k", "rate", "guardrail", "description",
        "rule-description"])
def test_any_change_changes_the_revision(change: Any) -> None:
    raw = raw_example("multi-route")
    edited = copy.deepcopy(raw)
    change(edited)
    assert edited != raw
    try:
        doc = validate_data(edited)
    except Exception as exc:  # pragma: no cover - the edits above keep the document valid
        pytest.fail(f"edit made the document invalid: {exc}")
    assert revision_id(doc) != revision_id(validate_data(raw))


# --- signing -------------------------------------------------------------------------

def _payload(kill_switch: bool = False, percent: float | None = None,
             salt: str = "rollout-1") -> BundlePayload:
    canary = None
    if percent is not None:
        canary = Canary(Revision.of(example("multi-route")), percent, salt)
    return BundlePayload(Revision.of(example("seed")), canary, kill_switch)


@pytest.mark.parametrize("payload", [
    _payload(), _payload(kill_switch=True), _payload(percent=12.5), _payload(percent=100.0),
], ids=["plain", "kill-switch", "canary", "canary-100"])
def test_sign_verify_round_trip(key: SigningKey, verifier: BundleVerifier, payload: BundlePayload) -> None:
    envelope = over_the_wire(key.sign(payload))
    assert [s["key_id"] for s in envelope["signatures"]] == [key.key_id]
    assert envelope["etag"] == payload.etag
    verified = verifier.verify(envelope)
    assert verified == payload
    assert verified.etag == payload.etag
    assert CompiledBundle(verified).etag == envelope["etag"]


def test_round_trip_keeps_the_etag_for_an_integer_traffic_percent(key: SigningKey,
                                                                   verifier: BundleVerifier) -> None:
    # traffic_percent is annotated float, and an int is a valid float: the
    # worker must end up with the ETag the control plane published.
    payload = _payload(percent=10)
    envelope = over_the_wire(key.sign(payload))
    verified = verifier.verify(envelope)
    assert verified.etag == envelope["etag"] == payload.etag


def test_sign_raw_helper_matches_the_library(key: SigningKey) -> None:
    payload = _payload(percent=12.5)
    assert sign_raw(key, payload.to_dict()) == key.sign(payload)


def test_signing_key_survives_base64_round_trip(key: SigningKey, verifier: BundleVerifier) -> None:
    again = SigningKey.from_b64(key.private_key_b64())
    assert again.public_key_b64 == key.public_key_b64
    assert again.key_id == key.key_id
    assert verifier.verify(again.sign(_payload())) == _payload()


@pytest.mark.parametrize("tamper", [
    lambda p: p.update(kill_switch=True),
    lambda p: p["policy"]["document"]["rules"][0]["when"]["batch_size"].update(max=64),
    lambda p: p["policy"]["document"]["engines"]["draft"].update(num_speculative_tokens=4),
    lambda p: p["canary"].update(traffic_percent=100.0),
    lambda p: p["canary"].update(salt="other"),
], ids=["kill-switch", "rule", "engine", "canary-percent", "canary-salt"])
def test_tampered_payload_is_rejected(key: SigningKey, verifier: BundleVerifier, tamper: Any) -> None:
    envelope = over_the_wire(key.sign(_payload(percent=12.5)))
    tamper(envelope["payload"])
    with pytest.raises(BundleSignatureError, match="does not match"):
        verifier.verify(envelope)


@pytest.mark.parametrize("signature", ["<missing>", "", None])
def test_unsigned_bundle_is_rejected(key: SigningKey, verifier: BundleVerifier, signature: Any) -> None:
    envelope = over_the_wire(key.sign(_payload()))
    if signature == "<missing>":
        del envelope["signatures"]
    else:
        envelope["signatures"] = signature
    with pytest.raises(BundleSignatureError, match="unsigned"):
        verifier.verify(envelope)


@pytest.mark.parametrize("signature", ["not base64!", 12345, base64.b64encode(b"short").decode()])
def test_malformed_signature_is_rejected(key: SigningKey, verifier: BundleVerifier, signature: Any) -> None:
    envelope = over_the_wire(key.sign(_payload()))
    envelope["signatures"][0]["signature"] = signature
    with pytest.raises(BundleSignatureError):
        verifier.verify(envelope)


def test_signature_from_another_key_is_rejected(verifier: BundleVerifier) -> None:
    other = SigningKey.generate()
    envelope = over_the_wire(other.sign(_payload()))
    with pytest.raises(BundleSignatureError, match="unknown key"):
        verifier.verify(envelope)


def test_signature_from_another_key_claiming_the_trusted_key_id_is_rejected(
        key: SigningKey, verifier: BundleVerifier) -> None:
    envelope = over_the_wire(SigningKey.generate().sign(_payload()))
    envelope["signatures"][0]["key_id"] = key.key_id
    with pytest.raises(BundleSignatureError, match="does not match"):
        verifier.verify(envelope)


def test_key_rotation_trusts_every_configured_key(key: SigningKey) -> None:
    new = SigningKey.generate()
    both = BundleVerifier([key.public_key_b64, new.public_key_b64])
    assert both.verify(key.sign(_payload())) == _payload()
    assert both.verify(new.sign(_payload())) == _payload()


@pytest.mark.parametrize("keys", [[], ["not base64!"], [base64.b64encode(b"x" * 31).decode()]])
def test_verifier_refuses_bad_key_configuration(keys: list[str]) -> None:
    with pytest.raises(BundleSignatureError):
        BundleVerifier(keys)


@pytest.mark.parametrize("etag", ["0" * 64, None, "<missing>"])
def test_wrong_etag_is_rejected(key: SigningKey, verifier: BundleVerifier, etag: Any) -> None:
    envelope = over_the_wire(key.sign(_payload()))
    if etag == "<missing>":
        del envelope["etag"]
    else:
        envelope["etag"] = etag
    with pytest.raises(BundleFormatError, match="etag"):
        verifier.verify(envelope)


def test_envelope_must_be_an_object(verifier: BundleVerifier) -> None:
    with pytest.raises(BundleFormatError):
        verifier.verify(["not", "an", "object"])


@pytest.mark.parametrize("where", ["policy", "canary"])
def test_document_that_does_not_hash_to_its_revision_is_rejected(
        key: SigningKey, verifier: BundleVerifier, where: str) -> None:
    # Validly signed, right etag: only the revision id check can catch this.
    payload = _payload(percent=12.5).to_dict()
    document = payload[where]["document"]
    document["rules"][0]["when"]["batch_size"] = {"max": 64}
    validate_data(document)  # still a valid document: only its hash is wrong
    envelope = sign_raw(key, payload)
    with pytest.raises(BundleFormatError, match="claims revision"):
        verifier.verify(over_the_wire(envelope))
    # ... and the same payload with a truthful revision id is accepted.
    payload[where]["revision"] = revision_id(validate_data(document))
    verified = verifier.verify(over_the_wire(sign_raw(key, payload)))
    target = verified.policy if where == "policy" else verified.canary.revision  # type: ignore[union-attr]
    assert target.document.rules[0].when.batch_size.max == 64  # type: ignore[union-attr]


@pytest.mark.parametrize("edit", [
    lambda p: p["policy"]["document"]["engines"].clear(),
    lambda p: p.update(format="specgate.bundle/v0"),
    lambda p: p.update(extra=1),
    lambda p: p.update(kill_switch="yes"),
    lambda p: p.update(policy="x"),
    lambda p: p.update(canary=[]),
    lambda p: p["canary"].update(traffic_percent=101.0),
    lambda p: p["canary"].update(traffic_percent=True),
    lambda p: p["canary"].update(salt=""),
    lambda p: p["canary"].update(salt=None),
], ids=["invalid-document", "format", "unknown-field", "kill-switch-type", "policy-type", "canary-type",
        "percent-range", "percent-bool", "empty-salt", "salt-type"])
def test_malformed_payload_is_rejected_even_when_signed(
        key: SigningKey, verifier: BundleVerifier, edit: Any) -> None:
    payload = _payload(percent=12.5).to_dict()
    edit(payload)
    with pytest.raises(BundleFormatError):
        verifier.verify(over_the_wire(sign_raw(key, payload)))


def test_bundle_errors_share_a_base() -> None:
    assert issubclass(BundleFormatError, BundleError)
    assert issubclass(BundleSignatureError, BundleError)
    assert _payload().to_dict()["format"] == BUNDLE_FORMAT


# --- canary split -------------------------------------------------------------------

def _random_ids(n: int, seed: str) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.getrandbits(96):024x}" for _ in range(n)]


@pytest.mark.parametrize("percent", [1.0, 12.5, 50.0, 90.0])
def test_canary_gets_its_traffic_share(percent: float) -> None:
    bundle = CompiledBundle(_payload(percent=percent))
    canary_rev = bundle.payload.canary.revision.id  # type: ignore[union-attr]
    active_rev = bundle.payload.policy.id
    n = 20_000
    on_canary = 0
    for request_id in _random_ids(n, str(percent)):
        decision = bundle.decide(RequestShape(route="chat", batch_size=2, request_id=request_id))
        assert decision.revision in (canary_rev, active_rev)
        if decision.revision == canary_rev:
            on_canary += 1
            assert decision.policy == "fleet"
        else:
            assert decision.policy == "seed"
    p = percent / 100
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(on_canary - n * p) <= 5 * sigma, (on_canary, n * p, sigma)


def test_canary_assignment_is_sticky_per_request_id() -> None:
    bundle = CompiledBundle(_payload(percent=30.0))
    again = CompiledBundle(_payload(percent=30.0))
    for request_id in _random_ids(2000, "sticky"):
        policy = bundle.policy_for(request_id)
        assert bundle.policy_for(request_id) is policy
        assert again.policy_for(request_id).revision == policy.revision
        a = bundle.decide(RequestShape(route="chat", request_id=request_id))
        b = bundle.decide(RequestShape(route="creative", batch_size=50, request_id=request_id))
        assert a.revision == b.revision == policy.revision


def test_canary_salt_gives_an_independent_split() -> None:
    one = CompiledBundle(_payload(percent=50.0, salt="one"))
    two = CompiledBundle(_payload(percent=50.0, salt="two"))
    ids = _random_ids(4000, "salt")
    split_one = [one.policy_for(i) is one.canary for i in ids]
    split_two = [two.policy_for(i) is two.canary for i in ids]
    both = sum(a and b for a, b in zip(split_one, split_two, strict=True))
    # Independent halves overlap on about a quarter of requests.
    assert abs(both - 1000) <= 5 * math.sqrt(4000 * 0.25 * 0.75)


@pytest.mark.parametrize("percent", [0.0, 100.0])
def test_canary_extremes(percent: float) -> None:
    bundle = CompiledBundle(_payload(percent=percent))
    expected = bundle.canary if percent == 100.0 else bundle.active
    assert all(bundle.policy_for(i) is expected for i in _random_ids(2000, "extremes"))


@pytest.mark.parametrize("percent", [50.0, 100.0])
def test_no_request_id_stays_on_the_baseline(percent: float) -> None:
    bundle = CompiledBundle(_payload(percent=percent))
    assert bundle.policy_for(None) is bundle.active
    decision = bundle.decide(RequestShape(route="chat", batch_size=1, request_id=None))
    assert decision.revision == bundle.payload.policy.id
    assert decision.rule == "chat-low-batch"


@pytest.mark.parametrize(("percent", "salt"), [(-0.1, "s"), (100.1, "s"), (50.0, "")])
def test_canary_bounds(percent: float, salt: str) -> None:
    with pytest.raises(BundleFormatError):
        Canary(Revision.of(example("seed")), percent, salt)


# --- kill switch --------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(shape=shapes, percent=st.sampled_from([None, 0.0, 50.0, 100.0]))
def test_kill_switch_sends_every_request_to_the_plain_engine(shape: RequestShape,
                                                             percent: float | None) -> None:
    payload = _payload(kill_switch=True, percent=percent)
    bundle = CompiledBundle(payload)
    decision = bundle.decide(shape)
    assert decision.rule == "kill-switch"
    assert decision.speculate is False
    assert decision.num_speculative_tokens == 0
    assert decision.explored is False
    policy = bundle.policy_for(shape.request_id)
    assert decision.revision == policy.revision
    assert decision.policy == policy.name
    assert decision.engine == "base"  # the plain engine of both seed and fleet


@settings(max_examples=100, deadline=None)
@given(raw=raw_documents(), shape=shapes)
def test_kill_switch_on_generated_documents(raw: dict[str, Any], shape: RequestShape) -> None:
    doc = validate_generated(raw)
    bundle = CompiledBundle(BundlePayload(Revision.of(doc), kill_switch=True))
    decision = bundle.decide(shape)
    assert (decision.engine, decision.speculate, decision.rule, decision.explored) == (
        doc.resolved_plain_engine, False, "kill-switch", False)
    assert doc.engines[decision.engine].method == "none"


def test_kill_switch_uses_the_named_plain_engine() -> None:
    raw = raw_example("multi-route")
    raw["engines"]["safe"] = {"method": "none"}
    raw["plain_engine"] = "safe"
    bundle = CompiledBundle(BundlePayload(Revision.of(validate_data(raw)), kill_switch=True))
    for shape in (RequestShape(), RequestShape(route="chat", batch_size=1, max_tokens=64, request_id="x")):
        decision = bundle.decide(shape)
        assert (decision.engine, decision.speculate, decision.rule) == ("safe", False, "kill-switch")


def test_without_kill_switch_decisions_come_from_the_rules() -> None:
    bundle = CompiledBundle(_payload())
    decision = bundle.decide(RequestShape(route="chat", batch_size=1))
    assert (decision.engine, decision.speculate, decision.rule) == ("draft", True, "chat-low-batch")
