"""Bundles: what a worker receives, canonically encoded and signed.

A *revision* is a validated document; its id is the sha256 of its canonical
JSON. A *bundle* is what one worker should run right now: the active revision,
optionally a canary revision with the traffic share it gets, the kill switch
and the fleet's cohort secret. The bundle's ETag is the sha256 of that content's
canonical JSON. What is signed (Ed25519, once per configured key) is the content
plus its *delivery*: the distribution generation, the pool it was computed for
and an expiry, so a bundle captured earlier (before the kill switch went on, or
for another pool) cannot be replayed to a worker as current. A worker verifies
with the public key(s) alone and keeps its previous bundle when anything is off.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from policies.errors import BundleFormatError, BundleSignatureError, PolicyValidationError
from policies.evaluate import CompiledPolicy, compile_policy
from policies.model import PolicyDocument
from policies.shape import Decision, RequestShape, sticky_fraction
from policies.validate import validate_data

BUNDLE_FORMAT = "specgate.bundle/v2"
_CONTENT_FIELDS = frozenset({"format", "policy", "canary", "kill_switch", "cohort_secret"})
_DELIVERY_FIELDS = frozenset({"generation", "pool", "expires_at", "worker_id"})
# Envelopes signed before workers were bound carry no worker_id (they bind the pool only).
_REQUIRED_DELIVERY_FIELDS = _DELIVERY_FIELDS - {"worker_id"}
_ENVELOPE_FIELDS = frozenset({"payload", "etag", "signatures"})


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no insignificant whitespace, UTF-8, shortest float repr."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_document(doc: PolicyDocument) -> dict[str, Any]:
    """The normal form of a document: defaults filled in, absent options dropped.

    Two documents that mean the same thing (one omits ``exploration``, the
    other spells out its defaults) have the same normal form and so the same
    revision id.
    """
    return doc.model_dump(mode="json", by_alias=True, exclude_none=True)


def revision_id(doc: PolicyDocument) -> str:
    return sha256_hex(canonical_json(canonical_document(doc)))


def canonical_yaml(doc: PolicyDocument) -> str:
    """Readable normal form, in the document's own field order, for diffs."""
    return yaml.safe_dump(canonical_document(doc), sort_keys=False, default_flow_style=False,
                          allow_unicode=True, width=100)


@dataclass(frozen=True, slots=True)
class Revision:
    document: PolicyDocument
    id: str

    @classmethod
    def of(cls, document: PolicyDocument) -> Revision:
        return cls(document, revision_id(document))

    def to_dict(self) -> dict[str, Any]:
        return {"revision": self.id, "document": canonical_document(self.document)}


@dataclass(frozen=True, slots=True)
class Canary:
    """A traffic-percentage rollout step: this share of requests runs ``revision``."""

    revision: Revision
    traffic_percent: float
    salt: str

    def __post_init__(self) -> None:
        # Always a float: 10 and 10.0 must sign to the same bytes on both ends.
        object.__setattr__(self, "traffic_percent", float(self.traffic_percent))
        if not 0.0 <= self.traffic_percent <= 100.0:
            raise BundleFormatError(
                f"canary.traffic_percent must be within [0, 100], got {self.traffic_percent}")
        if not self.salt:
            raise BundleFormatError("canary.salt must not be empty")


@dataclass(frozen=True, slots=True)
class BundlePayload:
    policy: Revision
    canary: Canary | None = None
    kill_switch: bool = False
    # HMAC key of the exploration and canary cohorts: every worker must hash request ids alike.
    cohort_secret: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": BUNDLE_FORMAT,
            "cohort_secret": self.cohort_secret,
            "policy": self.policy.to_dict(),
            "canary": None if self.canary is None else {
                **self.canary.revision.to_dict(),
                "traffic_percent": self.canary.traffic_percent,
                "salt": self.canary.salt,
            },
            "kill_switch": self.kill_switch,
        }

    def canonical_bytes(self) -> bytes:
        return canonical_json(self.to_dict())

    @property
    def etag(self) -> str:
        return sha256_hex(self.canonical_bytes())

    @classmethod
    def from_dict(cls, data: Any) -> BundlePayload:
        if not isinstance(data, Mapping):
            raise BundleFormatError("bundle payload must be a JSON object")
        if data.get("format") != BUNDLE_FORMAT:
            raise BundleFormatError(f"bundle format {data.get('format')!r} is not {BUNDLE_FORMAT!r} "
                                    "(this worker and the control plane run incompatible versions)")
        unknown = set(data) - _CONTENT_FIELDS
        if unknown:
            raise BundleFormatError(f"bundle payload has unknown fields: {', '.join(sorted(unknown))}")
        cohort_secret = data.get("cohort_secret", "")
        if not isinstance(cohort_secret, str):
            raise BundleFormatError("bundle cohort_secret must be a string")
        kill_switch = data.get("kill_switch", False)
        if not isinstance(kill_switch, bool):
            raise BundleFormatError("bundle kill_switch must be true or false")
        policy = _revision_from(data.get("policy"), "policy")
        canary_data = data.get("canary")
        canary = None
        if canary_data is not None:
            if not isinstance(canary_data, Mapping):
                raise BundleFormatError("bundle canary must be an object or null")
            percent = canary_data.get("traffic_percent")
            salt = canary_data.get("salt")
            if isinstance(percent, bool) or not isinstance(percent, (int, float)):
                raise BundleFormatError("canary.traffic_percent must be a number")
            if not isinstance(salt, str):
                raise BundleFormatError("canary.salt must be a string")
            canary = Canary(_revision_from(canary_data, "canary"), float(percent), salt)
        return cls(policy, canary, kill_switch, cohort_secret)


@dataclass(frozen=True, slots=True)
class Delivery:
    """What a signature binds a bundle's content to: when, for whom, until when.

    ``generation`` is the control plane's distribution generation (bumped by every change), so a worker
    can refuse an older bundle than one it already accepted; ``pool`` is the pool the bundle was computed
    for and ``worker_id`` the worker (workers of one pool may run different revisions during a rollout, so
    one worker's envelope must not be accepted by another); ``expires_at`` (unix seconds) bounds how long
    a captured bundle can be replayed. The default binds to no pool and is already expired: every worker
    refuses it. An envelope signed before workers were bound (no ``worker_id``) reads as ``""``: bound to
    its pool only.
    """

    generation: int = 0
    pool: str = ""
    expires_at: int = 0
    worker_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"generation": self.generation, "pool": self.pool, "expires_at": self.expires_at,
                "worker_id": self.worker_id}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Delivery:
        generation, pool, expires_at = data.get("generation"), data.get("pool"), data.get("expires_at")
        worker_id = data.get("worker_id", "")
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
            raise BundleFormatError("bundle generation must be a non-negative integer")
        if not isinstance(pool, str):
            raise BundleFormatError("bundle pool must be a string")
        if isinstance(expires_at, bool) or not isinstance(expires_at, int):
            raise BundleFormatError("bundle expires_at must be an integer (unix seconds)")
        if not isinstance(worker_id, str):
            raise BundleFormatError("bundle worker_id must be a string")
        return cls(generation, pool, expires_at, worker_id)


@dataclass(frozen=True, slots=True)
class SignedBundle:
    """A verified envelope: its content and the delivery the signature bound it to."""

    payload: BundlePayload
    delivery: Delivery

    @property
    def etag(self) -> str:
        return self.payload.etag


def _revision_from(data: Any, where: str) -> Revision:
    if not isinstance(data, Mapping):
        raise BundleFormatError(f"bundle {where} must be an object")
    claimed = data.get("revision")
    try:
        document = validate_data(data.get("document"))
    except PolicyValidationError as exc:
        raise BundleFormatError(f"bundle {where} document is invalid: {exc}") from None
    revision = Revision.of(document)
    if claimed != revision.id:
        raise BundleFormatError(
            f"bundle {where} claims revision {claimed!r} but its document hashes to {revision.id!r}")
    return revision


# --- signing ----------------------------------------------------------------------

def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise BundleSignatureError(f"{what} is not valid base64") from None


def key_id(public_key_raw: bytes) -> str:
    return sha256_hex(public_key_raw)[:16]


class SigningKey:
    """The control plane's Ed25519 private key (raw 32 bytes, base64 in settings)."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        raw_public = private_key.public_key().public_bytes_raw()
        self.public_key_b64 = _b64(raw_public)
        self.key_id = key_id(raw_public)

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_b64(cls, text: str) -> SigningKey:
        raw = _unb64(text.strip(), "signing key")
        if len(raw) != 32:
            raise BundleSignatureError(f"an Ed25519 private key is 32 bytes, got {len(raw)}")
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def private_key_b64(self) -> str:
        return _b64(self._key.private_bytes_raw())

    def signature(self, body: bytes) -> dict[str, str]:
        return {"key_id": self.key_id, "signature": _b64(self._key.sign(body))}

    def sign(self, payload: BundlePayload, delivery: Delivery | None = None,
             *, also: Iterable[SigningKey] = ()) -> dict[str, Any]:
        """The signed envelope a worker downloads, signed by this key and then by each of ``also``.

        During a key rotation the control plane signs with both keys, so a worker that trusts either accepts.
        """
        return sign_envelope([self, *also], payload, delivery or Delivery())


def sign_envelope(keys: Iterable[SigningKey], payload: BundlePayload, delivery: Delivery) -> dict[str, Any]:
    """The signed envelope as a JSON object (:func:`envelope_bytes`, parsed)."""
    envelope: dict[str, Any] = json.loads(envelope_bytes(keys, canonical_members(payload), payload.etag, delivery))
    return envelope


def canonical_members(payload: BundlePayload) -> dict[str, bytes]:
    """The canonical JSON of each top-level member of a bundle's content, for :func:`envelope_bytes`."""
    return {key: canonical_json(value) for key, value in payload.to_dict().items()}


def envelope_bytes(keys: Iterable[SigningKey], members: Mapping[str, bytes], etag: str,
                   delivery: Delivery) -> bytes:
    """The envelope :func:`sign_envelope` makes, as JSON bytes, from the content's :func:`canonical_members`.

    A control plane signs one envelope per worker and change; serialising the (possibly large) policy
    documents once per content instead of once per worker keeps that cheap. The signed body is byte for
    byte ``canonical_json`` of content and delivery: members are joined in sorted key order.
    """
    parts = {**members, **{key: canonical_json(value) for key, value in delivery.to_dict().items()}}
    body = b"{" + b",".join(canonical_json(key) + b":" + parts[key] for key in sorted(parts)) + b"}"
    signatures = canonical_json([key.signature(body) for key in keys])
    return b'{"payload":' + body + b',"etag":' + canonical_json(etag) + b',"signatures":' + signatures + b"}"


class BundleVerifier:
    """Checks envelopes against one or more trusted public keys (key rotation)."""

    def __init__(self, public_keys_b64: Iterable[str]) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {}
        for text in public_keys_b64:
            raw = _unb64(text.strip(), "public key")
            if len(raw) != 32:
                raise BundleSignatureError(f"an Ed25519 public key is 32 bytes, got {len(raw)}")
            self._keys[key_id(raw)] = Ed25519PublicKey.from_public_bytes(raw)
        if not self._keys:
            raise BundleSignatureError("no trusted public key configured")

    def verify(self, envelope: Any) -> BundlePayload:
        return self.verify_envelope(envelope).payload

    def verify_envelope(self, envelope: Any) -> SignedBundle:
        """The content and delivery of ``envelope`` if one of its signatures is by a trusted key."""
        if not isinstance(envelope, Mapping):
            raise BundleFormatError("bundle must be a JSON object")
        unknown = set(envelope) - _ENVELOPE_FIELDS
        if unknown:
            raise BundleFormatError(f"bundle envelope has unknown fields: {', '.join(sorted(unknown))} "
                                    f"(expected a {BUNDLE_FORMAT} envelope)")
        signatures = envelope.get("signatures")
        if not signatures:
            raise BundleSignatureError("bundle is unsigned")
        if not isinstance(signatures, list) or not all(isinstance(s, Mapping) for s in signatures):
            raise BundleSignatureError("bundle signatures must be a list of {key_id, signature}")
        payload_data = envelope.get("payload")
        if not isinstance(payload_data, Mapping):
            raise BundleFormatError("bundle payload must be a JSON object")
        try:
            body = canonical_json(payload_data)
        except (TypeError, ValueError):
            raise BundleFormatError("bundle payload is not plain JSON") from None
        ours = [(self._keys[s.get("key_id")], s.get("signature")) for s in signatures
                if isinstance(s.get("key_id"), str) and s.get("key_id") in self._keys]
        if not ours:
            named = [s.get("key_id") for s in signatures]
            raise BundleSignatureError(f"bundle is signed by unknown key(s) {named!r}")
        for key, signature in ours:
            if not isinstance(signature, str):
                raise BundleSignatureError("bundle signature must be a base64 string")
            try:
                key.verify(_unb64(signature, "bundle signature"), body)
            except InvalidSignature:
                raise BundleSignatureError("bundle signature does not match its payload (tampered, "
                                           "or signed by another key)") from None
        content = {k: v for k, v in payload_data.items() if k not in _DELIVERY_FIELDS}
        missing = _REQUIRED_DELIVERY_FIELDS - set(payload_data)
        if missing:
            raise BundleFormatError(f"bundle payload lacks {', '.join(sorted(missing))}")
        payload = BundlePayload.from_dict(content)
        if envelope.get("etag") != payload.etag:
            raise BundleFormatError(
                f"bundle etag {envelope.get('etag')!r} does not match its payload ({payload.etag})")
        return SignedBundle(payload, Delivery.from_dict(payload_data))


# --- the compiled form a worker runs ------------------------------------------------

class CompiledBundle:
    """Everything a worker needs to decide one request, compiled once."""

    __slots__ = ("payload", "etag", "active", "canary", "canary_fraction", "canary_salt", "kill_switch")

    def __init__(self, payload: BundlePayload) -> None:
        self.payload = payload
        self.etag = payload.etag
        secret = payload.cohort_secret
        self.active: CompiledPolicy = compile_policy(payload.policy.document, payload.policy.id,
                                                     cohort_secret=secret)
        self.canary: CompiledPolicy | None = None
        self.canary_fraction = 0.0
        self.canary_salt = ""
        if payload.canary is not None:
            self.canary = compile_policy(payload.canary.revision.document, payload.canary.revision.id,
                                         cohort_secret=secret)
            self.canary_fraction = payload.canary.traffic_percent / 100.0
            self.canary_salt = payload.canary.salt
        self.kill_switch = payload.kill_switch

    def policy_for(self, request_id: str | None) -> CompiledPolicy:
        """The revision a request runs under; without an id it stays on the baseline."""
        if self.canary is not None and request_id is not None:
            if sticky_fraction(request_id, self.canary_salt) < self.canary_fraction:
                return self.canary
        return self.active

    def decide(self, shape: RequestShape) -> Decision:
        policy = self.policy_for(shape.request_id)
        if self.kill_switch:
            return policy.kill_switch_decision
        return policy.decide(shape)
