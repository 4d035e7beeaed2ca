"""The device side the suite needs, as an interface (``Client``), and ``ReferenceClient``: an implementation
written only from docs/protocol (no product code), which reproduces docs/protocol/vectors.

A client implementation in another language plugs in by implementing ``Client`` (in Python, or as a thin
adapter around a subprocess: see conformance/README.md).
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from abc import ABC, abstractmethod
from typing import Any

import rfc8785
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

PROTOCOL = 2
CHUNK_FRAME_MAGIC = b"FPD1"

# name -> (shape, values in row-major order)
Tensors = dict[str, tuple[list[int], list[float]]]


class ManifestRejected(Exception):
    """A manifest envelope that does not verify against the pinned key (or the key its rotation chain reaches)."""


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def canonical(payload: Any) -> bytes:
    """Protocol 2's canonical form: RFC 8785 (JCS), UTF-8."""
    return rfc8785.dumps(payload)


class Client(ABC):
    """What a device implementation must do for the suite. One instance is one device (one key)."""

    @abstractmethod
    def public_key(self) -> str:
        """The device's Ed25519 public key: 32 bytes, base64url without padding."""

    @abstractmethod
    def sign(self, payload: dict[str, Any]) -> str:
        """An Ed25519 signature over ``payload``'s protocol 2 canonical form, base64url without padding."""

    @abstractmethod
    def hello(self, *, nonce: str, device_id: str) -> dict[str, Any]:
        """The socket's hello message (with ``"type": "hello"`` and ``"protocol": 2``) answering ``nonce``."""

    @abstractmethod
    def token_request(self, *, nonce: str, device_id: str) -> dict[str, Any]:
        """``POST /api/v1/device-auth/token/``'s body (protocol 2) for a REST challenge's ``nonce``."""

    @abstractmethod
    def build_delta(self, tensors: Tensors) -> bytes:
        """A delta file: safetensors, encoding f32, ``__metadata__`` ``{"format": "fleet-delta", ...}``."""

    @abstractmethod
    def delta_upload(
        self,
        data: bytes,
        *,
        device_id: str,
        adapter: str,
        base_version: int,
        num_samples: int,
        counter: int,
        created_at: float,
    ) -> dict[str, Any]:
        """``{"envelope": {...purpose "delta-upload"...}, "signature": "..."}`` for the delta file ``data``."""

    @abstractmethod
    def chunk_frame(self, *, sha256: str, offset: int, data: bytes) -> bytes:
        """A binary chunk frame: ``FPD1``, 2-byte big-endian header length, compact sorted JSON header, bytes."""

    @abstractmethod
    def verify_manifest(self, envelope: dict[str, Any], *, pinned_key: str) -> dict[str, Any]:
        """The manifest if ``envelope``'s signature verifies with ``pinned_key`` (or the key its ``key_rotations``
        lead to from it); raise ``ManifestRejected`` (or any exception) otherwise."""


def _public_key_b64(key: Ed25519PrivateKey) -> str:
    return b64url(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))


def _verifies(public_key: str, payload: dict[str, Any], signature: str) -> bool:
    try:
        raw_key, raw_signature = b64url_decode(public_key), b64url_decode(signature)
        Ed25519PublicKey.from_public_bytes(raw_key).verify(raw_signature, canonical(payload))
    except (ValueError, TypeError, InvalidSignature, rfc8785.CanonicalizationError):
        return False
    return True


class ReferenceClient(Client):
    """The protocol as docs/protocol describes it, in the standard library plus cryptography and rfc8785."""

    agent_version = "conformance-ref"

    def __init__(self, key: Ed25519PrivateKey | None = None):
        self.key = key or Ed25519PrivateKey.generate()

    @classmethod
    def from_seed(cls, seed: bytes) -> ReferenceClient:
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def public_key(self) -> str:
        return _public_key_b64(self.key)

    def sign(self, payload: dict[str, Any]) -> str:
        return b64url(self.key.sign(canonical(payload)))

    def hello(self, *, nonce: str, device_id: str) -> dict[str, Any]:
        payload = {"purpose": "agent-hello", "nonce": nonce, "device_id": device_id, "protocol": PROTOCOL}
        return {
            "type": "hello",
            "device_id": device_id,
            "signature": self.sign(payload),
            "protocol": PROTOCOL,
            "agent_version": self.agent_version,
            "hardware": {},
        }

    def token_request(self, *, nonce: str, device_id: str) -> dict[str, Any]:
        payload = {"purpose": "device-token", "nonce": nonce, "device_id": device_id, "protocol": PROTOCOL}
        return {"device_id": device_id, "nonce": nonce, "signature": self.sign(payload), "protocol": PROTOCOL}

    def build_delta(self, tensors: Tensors) -> bytes:
        header: dict[str, Any] = {"__metadata__": {"format": "fleet-delta", "encoding": "f32"}}
        body = bytearray()
        for name in sorted(tensors):
            shape, values = tensors[name]
            count = 1
            for dim in shape:
                count *= dim
            if len(values) != count:
                raise ValueError(f"{name}: {len(values)} values for shape {shape}")
            start = len(body)
            body += struct.pack(f"<{count}f", *values)
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [start, len(body)]}
        text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text + bytes(body)

    def delta_upload(
        self,
        data: bytes,
        *,
        device_id: str,
        adapter: str,
        base_version: int,
        num_samples: int,
        counter: int,
        created_at: float,
    ) -> dict[str, Any]:
        envelope = {
            "purpose": "delta-upload",
            "device_id": device_id,
            "adapter": adapter,
            "base_version": base_version,
            "sha256": hashlib.sha256(data).hexdigest(),
            "size": len(data),
            "num_samples": num_samples,
            "counter": counter,
            "created_at": created_at,
        }
        return {"envelope": envelope, "signature": self.sign(envelope)}

    def chunk_frame(self, *, sha256: str, offset: int, data: bytes) -> bytes:
        header = json.dumps({"offset": offset, "sha256": sha256}, sort_keys=True, separators=(",", ":")).encode()
        return CHUNK_FRAME_MAGIC + struct.pack(">H", len(header)) + header + data

    def verify_manifest(self, envelope: dict[str, Any], *, pinned_key: str) -> dict[str, Any]:
        key = follow_key_rotations(envelope.get("key_rotations") or [], pinned_key)
        manifest, signature = envelope.get("manifest"), envelope.get("signature")
        if not isinstance(manifest, dict) or not isinstance(signature, str):
            raise ManifestRejected("malformed: expected {manifest, signature}")
        if manifest.get("purpose") != "adapter-manifest":
            raise ManifestRejected("not an adapter manifest")
        if not _verifies(key, manifest, signature):
            raise ManifestRejected("bad_signature: not signed by the trusted server key")
        return manifest


def follow_key_rotations(rotations: list[dict[str, Any]], pinned: str) -> str:
    """The key reached from ``pinned`` (docs: skip links before the one that starts at the pinned key, then an
    unbroken chain, increasing seq, never back to a retired key, both signatures valid)."""
    current, seen, last_seq = pinned, {pinned}, None
    for index, link in enumerate(rotations):
        statement = link.get("statement") if isinstance(link, dict) else None
        if not isinstance(statement, dict) or statement.get("purpose") != "server-key-rotation":
            raise ManifestRejected(f"bad_key_rotation: link {index} is not a rotation statement")
        seq = statement.get("seq")
        if not isinstance(seq, int) or (last_seq is not None and seq <= last_seq):
            raise ManifestRejected(f"bad_key_rotation: link {index} is out of order")
        last_seq = seq
        if statement.get("old_public_key") != current:
            if current == pinned:
                continue
            raise ManifestRejected(f"bad_key_rotation: link {index} breaks the chain")
        new = statement.get("new_public_key")
        if not isinstance(new, str) or new in seen:
            raise ManifestRejected(f"bad_key_rotation: link {index} rotates back to a retired key")
        if not _verifies(current, statement, link.get("signature", "")) or not _verifies(
            new, statement, link.get("new_signature", "")
        ):
            raise ManifestRejected(f"bad_key_rotation: link {index} is not signed by both keys")
        current = new
        seen.add(new)
    return current
