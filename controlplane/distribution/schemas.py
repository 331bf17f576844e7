"""Response models of the distribution API: the signed bundle envelope and the public key to verify it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class BundleEnvelope(BaseModel):
    """What GET /v1/bundle returns: the payload and its Ed25519 signature."""

    payload: dict[str, Any] = Field(description="policies.BundlePayload: format, policy, canary, kill_switch")
    etag: str = Field(description="sha256 of the payload's canonical JSON; also the ETag header")
    key_id: str
    signature: str = Field(description="Ed25519 over the payload's canonical JSON, base64")


class PublicKeyRead(BaseModel):
    public_key: str = Field(description="raw 32-byte Ed25519 public key, base64")
    key_id: str
    algorithm: Literal["Ed25519"] = "Ed25519"
