"""Bundles: what a worker receives, canonically encoded and signed.

A *revision* is a validated document; its id is the sha256 of its canonical
JSON. A *bundle* is what one worker should run right now: the active revision,
optionally a canary revision with the traffic share it gets, and the kill
switch. The bundle's ETag is the sha256 of its canonical JSON, and the control
plane signs those exact bytes with Ed25519; a worker verifies them with the
public key alone, and keeps its previous bundle when anything is off.
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

BUNDLE_FORMAT = "specgate.bundle/v1"


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": BUNDLE_FORMAT,
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
            raise BundleFormatError(f"bundle format {data.get('format')!r} is not {BUNDLE_FORMAT!r}")
        unknown = set(data) - {"format", "policy", "canary", "kill_switch"}
        if unknown:
            raise BundleFormatError(f"bundle payload has unknown fields: {', '.join(sorted(unknown))}")
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
        return cls(policy, canary, kill_switch)


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

    def sign(self, payload: BundlePayload) -> dict[str, Any]:
        """The signed envelope a worker downloads."""
        body = payload.canonical_bytes()
        return {
            "payload": payload.to_dict(),
            "etag": sha256_hex(body),
            "key_id": self.key_id,
            "signature": _b64(self._key.sign(body)),
        }


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
        if not isinstance(envelope, Mapping):
            raise BundleFormatError("bundle must be a JSON object")
        signature = envelope.get("signature")
        if not signature:
            raise BundleSignatureError("bundle is unsigned")
        if not isinstance(signature, str):
            raise BundleSignatureError("bundle signature must be a base64 string")
        key = self._keys.get(str(envelope.get("key_id")))
        if key is None:
            raise BundleSignatureError(f"bundle is signed by unknown key {envelope.get('key_id')!r}")
        payload_data = envelope.get("payload")
        try:
            body = canonical_json(payload_data)
        except (TypeError, ValueError):
            raise BundleFormatError("bundle payload is not plain JSON") from None
        try:
            key.verify(_unb64(signature, "bundle signature"), body)
        except InvalidSignature:
            raise BundleSignatureError("bundle signature does not match its payload (tampered, "
                                       "or signed by another key)") from None
        etag = sha256_hex(body)
        if envelope.get("etag") != etag:
            raise BundleFormatError(
                f"bundle etag {envelope.get('etag')!r} does not match its payload ({etag})")
        return BundlePayload.from_dict(payload_data)


# --- the compiled form a worker runs ------------------------------------------------

class CompiledBundle:
    """Everything a worker needs to decide one request, compiled once."""

    __slots__ = ("payload", "etag", "active", "canary", "canary_fraction", "canary_salt", "kill_switch")

    def __init__(self, payload: BundlePayload) -> None:
        self.payload = payload
        self.etag = payload.etag
        self.active: CompiledPolicy = compile_policy(payload.policy.document, payload.policy.id)
        self.canary: CompiledPolicy | None = None
        self.canary_fraction = 0.0
        self.canary_salt = ""
        if payload.canary is not None:
            self.canary = compile_policy(payload.canary.revision.document, payload.canary.revision.id)
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
