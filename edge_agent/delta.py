"""The delta file and its signed envelope: what a device uploads after training, defined once here.

A delta is a safetensors file with the adapter's PEFT key names holding, per tensor, ``new - old`` relative
to the shared version the device started from (in FFA-LoRA mode only the ``lora_B`` tensors and the modules
to save). The header's ``__metadata__`` says how values are encoded:

- ``f32``: as is;
- ``f16``: half precision (half the bytes);
- ``int8``: symmetric per-tensor quantisation, ``value = q * scale`` with the scales in ``metadata["scales"]``
  (a JSON object name -> float).

The envelope is what the device signs with its Ed25519 key: the canonical JSON of
``{purpose, device_id, adapter, base_version, sha256, size, num_samples, counter, created_at}``. The counter
is monotonic per device; the server refuses one it has seen.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import save as save_safetensors

from edge_agent.protocol import sign
from edge_agent.safetensors_header import loads_noting_repeats
from edge_agent.wire import DeltaEnvelope, validated

FORMAT = "fleet-delta"
ENCODINGS = {"f32": "F32", "f16": "F16", "int8": "I8"}
ENVELOPE_PURPOSE = "delta-upload"
ENVELOPE_FIELDS = ("device_id", "adapter", "base_version", "sha256", "size", "num_samples", "counter", "created_at")


def compute_delta(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor], *, only_b: bool = False):
    """``new - old`` for every tensor of the adapter (only ``lora_B`` and saved modules when ``only_b``)."""
    keys = [k for k in old if not (only_b and ".lora_A." in k)]
    missing = [k for k in keys if k not in new]
    if missing:
        raise KeyError(f"the new adapter lacks {missing[:3]}")
    return {k: (new[k].detach().float() - old[k].detach().float()).contiguous() for k in keys}


# An update is clipped to this share of the adapter's bound: the server sums squares its own way (within 1e-4 of
# the exact norm) and the file's encoding rounds the values (docs/protocol/README.md, "The delta file").
CLIP_SHARE = 0.99


def clip_to_bound(
    new: dict[str, torch.Tensor], old: dict[str, torch.Tensor], bound: float | None, *, only_b: bool = False
) -> tuple[dict[str, torch.Tensor], float]:
    """``new`` with its change from ``old`` scaled down so that the delta's L2 norm (over what ``compute_delta``
    uploads) is at most ``CLIP_SHARE`` of ``bound``, the adapter's bound that the manifest's training setting
    carries (``max_norm``), and the delta's norm before clipping. Unchanged when within it or with no bound: a
    delta above it would be refused ``norm_too_large`` and the device's samples spent for nothing."""
    delta = compute_delta(new, old, only_b=only_b)
    norm = math.sqrt(sum(float(t.double().square().sum()) for t in delta.values()))
    if not bound or norm <= CLIP_SHARE * bound:
        return new, norm
    factor = CLIP_SHARE * bound / norm
    clipped = dict(new)
    for key, change in delta.items():
        clipped[key] = (old[key].detach().float() + change * factor).to(new[key].dtype)
    return clipped, norm


def encode_delta(tensors: dict[str, torch.Tensor], *, encoding: str = "f32") -> bytes:
    """The delta file's bytes in the chosen encoding."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown delta encoding {encoding!r}: use one of {sorted(ENCODINGS)}")
    metadata = {"format": FORMAT, "encoding": encoding}
    out: dict[str, torch.Tensor] = {}
    scales: dict[str, float] = {}
    for name, tensor in tensors.items():
        value = tensor.detach().float().contiguous()
        if encoding == "f16":
            out[name] = value.half().contiguous()
        elif encoding == "int8":
            peak = float(value.abs().max()) if value.numel() else 0.0
            scale = peak / 127.0 if peak > 0 else 1.0
            scales[name] = scale
            out[name] = torch.clamp(torch.round(value / scale), -127, 127).to(torch.int8).contiguous()
        else:
            out[name] = value
    if encoding == "int8":
        metadata["scales"] = json.dumps(scales, sort_keys=True)
    return canonical_safetensors(save_safetensors(out, metadata=metadata))


def canonical_safetensors(data: bytes) -> bytes:
    """The same safetensors file with its JSON header in a canonical form (sorted keys, no spaces, padded to 8
    bytes): the library writes the metadata map in no fixed order, so equal tensors could give different
    bytes, and a delta's identity is the sha256 of its bytes."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + length :]


def read_encoding(metadata: dict[str, str] | None) -> tuple[str, dict[str, float]]:
    """The encoding and int8 scales a delta header declares; ValueError when they are unusable."""
    metadata = metadata or {}
    encoding = metadata.get("encoding", "f32")
    if not isinstance(encoding, str) or encoding not in ENCODINGS:
        raise ValueError(f"unknown delta encoding {encoding!r}")
    scales: dict[str, float] = {}
    if encoding == "int8":
        try:
            scales, repeats = loads_noting_repeats(metadata.get("scales", ""))
        except (TypeError, ValueError, RecursionError):
            raise ValueError("an int8 delta needs a JSON 'scales' object in its metadata") from None
        if not isinstance(scales, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            for v in scales.values()
        ):
            raise ValueError("int8 scales must be positive finite numbers")
        if repeats:  # which of two scales would count is the reader's guess
            raise ValueError(f"the int8 scales name {repeats[0].key!r} more than once")
    return encoding, {k: float(v) for k, v in scales.items()}


def decode_tensor(raw: torch.Tensor, *, encoding: str, scale: float | None = None) -> torch.Tensor:
    """A stored tensor (or a slice of one) back to float32."""
    if encoding == "int8":
        if scale is None:
            raise ValueError("an int8 tensor needs its scale")
        return raw.to(torch.float32) * scale
    return raw.to(torch.float32)


def envelope_payload(
    *,
    device_id: str,
    adapter: str,
    base_version: int,
    sha256: str,
    size: int,
    num_samples: int,
    counter: int,
    created_at: float,
) -> dict[str, Any]:
    return {
        "purpose": ENVELOPE_PURPOSE,
        "device_id": str(device_id),
        "adapter": adapter,
        "base_version": int(base_version),
        "sha256": sha256,
        "size": int(size),
        "num_samples": int(num_samples),
        "counter": int(counter),
        "created_at": float(created_at),
    }


def sign_delta(
    key: Ed25519PrivateKey,
    data: bytes,
    *,
    device_id: str,
    adapter: str,
    base_version: int,
    num_samples: int,
    counter: int,
    created_at: float | None = None,
) -> dict[str, Any]:
    """``{"envelope": {...}, "signature": "..."}`` for the delta bytes ``data``."""
    envelope = envelope_payload(
        device_id=device_id,
        adapter=adapter,
        base_version=base_version,
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        num_samples=num_samples,
        counter=counter,
        created_at=time.time() if created_at is None else created_at,
    )
    return {"envelope": envelope, "signature": sign(key, envelope)}


def parse_envelope(candidate: Any) -> dict[str, Any]:
    """The envelope's fields, checked against ``edge_agent.wire.DeltaEnvelope``; ValueError naming the first bad
    field. The envelope is returned as sent (the signature is over those values)."""
    if not isinstance(candidate, dict):
        raise ValueError("the envelope must be a JSON object")
    validated(DeltaEnvelope, candidate, what="envelope")
    return dict(candidate)
