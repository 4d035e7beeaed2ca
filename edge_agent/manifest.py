"""Adapter manifests: what the server signs for each assignment, and how the agent checks it.

The server signs, with its Ed25519 key, the canonical JSON of
``{purpose, device_id, adapter, version, sha256, size, base_model_sha256, assignment_seq, issued_at,
expires_at}`` and, optionally, ``training``: how to build and train the adapter (model family and its
config, LoRA rank, alpha, dropout, targets, modules to save, FFA mode). It is signed with the rest, so a
device never builds a model family or trains a configuration the server did not sign. The agent pinned
the server's public key at enrollment and refuses, each with its own code: an unsigned or wrongly
signed manifest, an expired one, one for another device or base model, one whose ``assignment_seq``
is not newer than the last it accepted (an operator's rollback is a new assignment pointing at an old
version, so it still carries a newer sequence), and a downloaded file whose size or sha256 differs from the manifest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from edge_agent.protocol import public_key_from_b64, verify

PURPOSE = "adapter-manifest"
FIELDS = {
    "purpose": str,
    "device_id": str,
    "adapter": str,
    "version": int,
    "sha256": str,
    "size": int,
    "base_model_sha256": str,
    "assignment_seq": int,
    "issued_at": (int, float),
    "expires_at": (int, float),
}


class ManifestRefused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def verify_manifest(
    envelope: Any,
    *,
    server_public_key: str,
    device_id: str,
    base_model_sha256: str,
    last_accepted_seq: int,
    now: float,
) -> dict:
    """Return the manifest if every check passes; raise ManifestRefused with the first failure."""
    if not isinstance(envelope, dict) or not isinstance(envelope.get("manifest"), dict):
        raise ManifestRefused("malformed", "expected {manifest, signature}")
    manifest, signature = envelope["manifest"], envelope.get("signature")
    if not signature:
        raise ManifestRefused("unsigned", "the manifest carries no signature")
    for field, kind in FIELDS.items():
        if not isinstance(manifest.get(field), kind) or isinstance(manifest.get(field), bool):
            raise ManifestRefused("malformed", f"manifest field {field!r} is missing or of the wrong type")
    if set(manifest) - {"training"} != set(FIELDS):
        raise ManifestRefused("malformed", f"unexpected manifest fields: {sorted(set(manifest) - set(FIELDS))}")
    if "training" in manifest and not isinstance(manifest["training"], dict):
        raise ManifestRefused("malformed", "manifest field 'training' must be an object")
    try:
        ok = verify(public_key_from_b64(server_public_key), manifest, signature)
    except ValueError:
        ok = False
    if not ok or manifest["purpose"] != PURPOSE:
        raise ManifestRefused("bad_signature", "the manifest is not signed by the pinned server key")
    if manifest["expires_at"] <= now:
        raise ManifestRefused("expired", "the manifest has expired")
    if manifest["device_id"] != device_id:
        raise ManifestRefused("wrong_device", "the manifest was issued to another device")
    if manifest["base_model_sha256"] != base_model_sha256:
        raise ManifestRefused("wrong_base_model", "the manifest is for another base model than this device carries")
    if manifest["assignment_seq"] <= last_accepted_seq:
        raise ManifestRefused(
            "stale_sequence",
            f"assignment_seq {manifest['assignment_seq']} is not newer than {last_accepted_seq}, the last accepted",
        )
    return manifest


def verify_file(path: Path, *, sha256: str, size: int) -> None:
    actual_size = path.stat().st_size
    if actual_size != size:
        raise ManifestRefused("size_mismatch", f"downloaded {actual_size} bytes, the manifest says {size}")
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1024 * 1024):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        raise ManifestRefused("hash_mismatch", "the downloaded file's sha256 differs from the manifest")
