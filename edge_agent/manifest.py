"""Adapter manifests: what the server signs for each assignment, and how the agent checks it.

The server signs, with its Ed25519 key, the canonical JSON of
``{purpose, device_id, adapter, version, sha256, size, base_model_sha256, assignment_seq, issued_at,
expires_at}`` and, optionally, ``training``: how to build and train the adapter (model family and its
config, LoRA rank, alpha, dropout, targets, modules to save, FFA mode). It is signed with the rest, so a
device never builds a model family or trains a configuration the server did not sign. The agent pinned
the server's public key at enrollment and refuses, each with its own code: an unsigned or wrongly
signed manifest, an expired one, one for another device or base model, one whose ``assignment_seq``
is not newer than the last it accepted (an operator's rollback is a new assignment pointing at an old
version, so it still carries a newer sequence), a downloaded file whose size or sha256 differs from the manifest,
and one whose safetensors header names a tensor (or any key) twice.

Server key rotation: the envelope may carry ``key_rotations``, the chain of statements that leads from an
older server key to the one that signed the manifest. Each statement ``{purpose: "server-key-rotation", seq,
old_public_key, new_public_key, issued_at}`` is signed by the old key (``signature``) and by the new key
(``new_signature``, so no one rotates to a key they do not hold). The agent follows the chain from the key
it pinned, link by link, and checks the manifest against the newest key it reaches: a device accepts a new
server key only through a statement signed by the key it already trusts, and once the chain has moved past
a key, a manifest signed by that retired key is refused. ``follow_key_rotations`` returns that newest key;
the caller pins it once the manifest has passed every check.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from edge_agent.protocol import public_key_from_b64, verify
from edge_agent.safetensors_header import file_repeat_refusal
from edge_agent.wire import Manifest, validated

PURPOSE = "adapter-manifest"
ROTATION_PURPOSE = "server-key-rotation"
ROTATION_FIELDS = {"purpose": str, "seq": int, "old_public_key": str, "new_public_key": str, "issued_at": (int, float)}
MAX_KEY_ROTATIONS = 64
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


def _refuse_rotation(index: int, message: str):
    raise ManifestRefused("bad_key_rotation", f"key rotation #{index}: {message}")


def follow_key_rotations(rotations: Any, pinned: str) -> str:
    """The newest server key reachable from ``pinned`` through ``rotations`` (``pinned`` when none leads on).

    Statements before the one that starts at the pinned key are skipped (a device enrolled after them pinned
    a later key); from there on the chain must be unbroken, each link signed by its old and its new key.
    Raises ManifestRefused("bad_key_rotation") for a malformed chain or a link that does not verify."""
    if rotations is None:
        return pinned
    if not isinstance(rotations, list) or len(rotations) > MAX_KEY_ROTATIONS:
        raise ManifestRefused("bad_key_rotation", f"key_rotations must be a list of at most {MAX_KEY_ROTATIONS}")
    current, seen, last_seq = pinned, {pinned}, None
    for index, entry in enumerate(rotations):
        if not isinstance(entry, dict) or not isinstance(entry.get("statement"), dict):
            _refuse_rotation(index, "expected {statement, signature, new_signature}")
        statement = entry["statement"]
        for field, kind in ROTATION_FIELDS.items():
            if not isinstance(statement.get(field), kind) or isinstance(statement.get(field), bool):
                _refuse_rotation(index, f"field {field!r} is missing or of the wrong type")
        if set(statement) != set(ROTATION_FIELDS) or statement["purpose"] != ROTATION_PURPOSE:
            _refuse_rotation(index, "not a server key rotation statement")
        if last_seq is not None and statement["seq"] <= last_seq:
            _refuse_rotation(index, "rotations are not in increasing order")
        last_seq = statement["seq"]
        if statement["old_public_key"] != current:
            if current == pinned:
                continue  # a rotation from before the key this device pinned
            _refuse_rotation(index, "the chain is broken: it does not start at the key reached so far")
        new = statement["new_public_key"]
        if new in seen:
            _refuse_rotation(index, "rotates back to a key already retired")
        try:
            old_key, new_key = public_key_from_b64(current), public_key_from_b64(new)
        except ValueError:
            _refuse_rotation(index, "a public key is not a valid Ed25519 key")
        if not verify(old_key, statement, entry.get("signature") or ""):
            _refuse_rotation(index, "not signed by the key it retires")
        if not verify(new_key, statement, entry.get("new_signature") or ""):
            _refuse_rotation(index, "not signed by the key it introduces")
        current = new
        seen.add(new)
    return current


def trusted_server_key(envelope: Any, pinned: str) -> str:
    """The key to check ``envelope``'s manifest against: ``pinned``, moved on by the envelope's key rotations."""
    rotations = envelope.get("key_rotations") if isinstance(envelope, dict) else None
    return follow_key_rotations(rotations, pinned)


def verify_manifest(
    envelope: Any,
    *,
    server_public_key: str,
    device_id: str,
    base_model_sha256: str,
    last_accepted_seq: int,
    now: float,
) -> dict:
    """Return the manifest if every check passes; raise ManifestRefused with the first failure.

    ``server_public_key`` is the key the manifest must be signed by: ``trusted_server_key(envelope, pinned)``."""
    if not isinstance(envelope, dict) or not isinstance(envelope.get("manifest"), dict):
        raise ManifestRefused("malformed", "expected {manifest, signature}")
    manifest, signature = envelope["manifest"], envelope.get("signature")
    if not signature:
        raise ManifestRefused("unsigned", "the manifest carries no signature")
    if set(envelope) - {"manifest", "signature", "key_rotations"}:
        raise ManifestRefused("malformed", f"unexpected envelope fields: {sorted(set(envelope))}")
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
        raise ManifestRefused("bad_signature", "the manifest is not signed by the server key this device trusts")
    try:  # every field as the contract defines it (edge_agent.wire.Manifest), the training setting included
        validated(Manifest, manifest, what="manifest")
    except ValueError as exc:
        raise ManifestRefused("malformed", str(exc)) from None
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
    if refusal := file_repeat_refusal(path):  # a tensor named twice: the server may have read the other entry
        raise ManifestRefused(*refusal)
