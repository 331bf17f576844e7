"""Response models of the distribution API: the signed bundle envelope and the public key to verify it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class Signature(BaseModel):
    key_id: str
    signature: str = Field(description="Ed25519 over the payload's canonical JSON, base64")


class BundleEnvelope(BaseModel):
    """What GET /v1/bundle returns: the payload and one Ed25519 signature per configured signing key."""

    payload: dict[str, Any] = Field(description="specgate.bundle/v2: format, policy, canary, kill_switch, "
                                    "cohort_secret (the content) and generation, pool, expires_at (the delivery)")
    etag: str = Field(description="sha256 of the content's canonical JSON (without the delivery fields); "
                      "also the ETag header")
    signatures: list[Signature] = Field(description="current key first; the previous one too during a rotation")


class PublicKeyEntry(BaseModel):
    public_key: str = Field(description="raw 32-byte Ed25519 public key, base64")
    key_id: str
    status: Literal["current", "previous"]


class PublicKeyRead(BaseModel):
    public_key: str = Field(description="the current key: raw 32-byte Ed25519 public key, base64")
    key_id: str = Field(description="the current key's id")
    algorithm: Literal["Ed25519"] = "Ed25519"
    keys: list[PublicKeyEntry] = Field(description="every key bundles are signed with, current first")
