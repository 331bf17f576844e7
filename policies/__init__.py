"""specgate's policy library: read, validate, evaluate, sign and render policies.

A pure library: no web framework, no database, no network. The sidecar and
the control plane both build on it, and the shared test vectors in
``tests/vectors`` pin its behaviour.
"""

from policies.bundle import (
    BUNDLE_FORMAT,
    BundlePayload,
    BundleVerifier,
    Canary,
    CompiledBundle,
    Delivery,
    Revision,
    SignedBundle,
    SigningKey,
    canonical_document,
    canonical_json,
    canonical_members,
    canonical_yaml,
    envelope_bytes,
    revision_id,
    sign_envelope,
)
from policies.errors import (
    BundleError,
    BundleFormatError,
    BundleSignatureError,
    ErrorCode,
    FieldError,
    PolicyError,
    PolicyValidationError,
    RequestShapeError,
)
from policies.evaluate import CompiledPolicy, compile_policy, interpret
from policies.model import API_VERSION, PolicyDocument
from policies.shape import Decision, RequestShape, sticky_fraction
from policies.store import PolicyStore, StoreUpdate
from policies.validate import MAX_DOCUMENT_BYTES, load_policy, pydantic_error_code, validate_data

__all__ = [
    "API_VERSION",
    "BUNDLE_FORMAT",
    "MAX_DOCUMENT_BYTES",
    "BundleError",
    "BundleFormatError",
    "BundlePayload",
    "BundleSignatureError",
    "BundleVerifier",
    "Canary",
    "CompiledBundle",
    "Delivery",
    "SignedBundle",
    "canonical_members",
    "envelope_bytes",
    "sign_envelope",
    "CompiledPolicy",
    "Decision",
    "ErrorCode",
    "FieldError",
    "PolicyDocument",
    "PolicyError",
    "PolicyStore",
    "PolicyValidationError",
    "RequestShape",
    "RequestShapeError",
    "Revision",
    "SigningKey",
    "StoreUpdate",
    "canonical_document",
    "canonical_json",
    "canonical_yaml",
    "compile_policy",
    "interpret",
    "load_policy",
    "pydantic_error_code",
    "revision_id",
    "sticky_fraction",
    "validate_data",
]
