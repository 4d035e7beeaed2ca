"""Checking safetensors files before anything trusts them: header within limits, exact tensor spec,
finite values. Used for imported adapter versions, uploaded base weights and device deltas (whose header
``training.federation.verification`` reads from a stream: ``header_length``, ``parse_header``, ``data_layout``).

The header is parsed by hand first, so a hostile file (a header bomb, overlapping or out-of-range
offsets, unknown dtypes) is refused before any library allocates tensors for it.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, Generic, TypeVar

import torch
from safetensors.torch import load as load_safetensors

from edge_agent.safetensors_header import loads_noting_repeats, repeat_refusal

MAX_HEADER_BYTES = 1024 * 1024
MAX_TENSORS = 10_000
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


Facts = TypeVar("Facts")


class PassedHeaders(Generic[Facts]):
    """What a reader learned from headers that passed its checks, kept by the header's bytes (with their 8-byte
    framing) and the file's size: the deltas of one adapter in one float encoding share theirs byte for byte, so
    the JSON parse and the checks that depend on the header alone run once per process, not once per delta.
    Bounded: headers of at most ``max_bytes`` and ``max_entries`` of them, the oldest dropped first. A header
    that carries a delta's own values (int8 scales) is the caller's not to keep."""

    def __init__(self, max_entries: int = 32, max_bytes: int = 64 << 10):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._kept: dict[tuple[bytes, int], Facts] = {}

    def get(self, key: tuple[bytes, int]) -> Facts | None:
        return self._kept.get(key)

    def keep(self, key: tuple[bytes, int], facts: Facts) -> None:
        if len(key[0]) > self.max_bytes:
            return
        if key not in self._kept and len(self._kept) >= self.max_entries:
            self._kept.pop(next(iter(self._kept)), None)  # the oldest
        self._kept[key] = facts


class ArtifactRejected(ValueError):
    """The file is not acceptable; ``code`` is stable, the message says exactly what is wrong."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def header_length(prefix: bytes, size: int) -> int:
    """The header's length, from a file's first 8 bytes (``prefix``) and its ``size`` in bytes, once the framing
    holds: 8 bytes of length, a header within the file and within ``MAX_HEADER_BYTES``."""
    if size < 8:
        raise ArtifactRejected("malformed", "the file is shorter than a safetensors header")
    (header_size,) = struct.unpack("<Q", prefix[:8])
    if 8 + header_size > size:
        raise ArtifactRejected("malformed", "the header runs past the end of the file")
    if header_size > MAX_HEADER_BYTES:
        raise ArtifactRejected("header_too_large", f"the header is {header_size} bytes (limit {MAX_HEADER_BYTES})")
    return header_size


def parse_header(raw: bytes, body: int) -> tuple[dict[str, dict], Any]:
    """The header's JSON (``raw``, within limits: ``header_length``) of a file whose data section is ``body``
    bytes: ``({name: {dtype, shape, data_offsets}}, the "__metadata__" value or None)``. A key named twice is
    refused (``edge_agent.safetensors_header``): a tensor as ``duplicate_tensor``, any other as ``malformed``."""
    try:
        header, repeats = loads_noting_repeats(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ArtifactRejected("malformed", "the header is not valid JSON") from None
    except RecursionError:  # deeply nested arrays or objects exhaust the parser before they are found invalid
        raise ArtifactRejected("malformed", "the header nests too deeply to be a safetensors header") from None
    if not isinstance(header, dict):
        raise ArtifactRejected("malformed", "the header is not a JSON object")
    if refusal := repeat_refusal(repeats):
        raise ArtifactRejected(*refusal)
    metadata = header.pop("__metadata__", None)
    if len(header) > MAX_TENSORS:
        raise ArtifactRejected("malformed", f"{len(header)} tensors (limit {MAX_TENSORS})")
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise ArtifactRejected("malformed", f"tensor {name!r}: entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise ArtifactRejected("malformed", f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ArtifactRejected("malformed", f"tensor {name!r}: shape must be a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ArtifactRejected("malformed", f"tensor {name!r}: data_offsets must be two integers")
        start, end = offsets
        if not 0 <= start <= end <= body or end - start != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise ArtifactRejected("malformed", f"tensor {name!r}: data_offsets do not match its shape and the file")
        spans.append((start, end))
    spans.sort()
    for (_, previous_end), (start, _) in zip(spans, spans[1:], strict=False):
        if start < previous_end:
            raise ArtifactRejected("malformed", "tensor data regions overlap")
    return header, metadata


def read_header(data: bytes) -> dict[str, dict]:
    """Validate the safetensors framing and return ``{name: {dtype, shape, data_offsets}}``."""
    header_size = header_length(data[:8], len(data))
    return parse_header(data[8 : 8 + header_size], len(data) - 8 - header_size)[0]


def data_layout(header: dict[str, dict], body: int) -> list[tuple[str, int, int]]:
    """``(name, start, end)`` of each tensor in the order its bytes lie in the data section, once they cover
    the section's ``body`` bytes exactly: the first at 0, each where the one before ended, the last at the end
    (``parse_header`` checked each in bounds and none overlapping; safetensors also wants no gap)."""
    spans = sorted((entry["data_offsets"][0], entry["data_offsets"][1], name) for name, entry in header.items())
    at = 0
    for start, end, name in spans:
        if start != at:
            raise ArtifactRejected("malformed", f"tensor {name!r}: its data does not start where the one before ends")
        at = end
    if at != body:
        raise ArtifactRejected("malformed", f"the tensors cover {at} of the data section's {body} bytes")
    return [(name, start, end) for start, end, name in spans]


def check_spec(header: dict[str, dict], spec: dict[str, dict]) -> None:
    """Names, shapes and dtypes exactly as the adapter says: nothing missing, nothing extra."""
    missing = sorted(set(spec) - set(header))
    extra = sorted(set(header) - set(spec))
    if missing or extra:
        parts = []
        # Names quoted with repr: a hostile file's names may hold NUL or lone surrogates, which a stored detail
        # cannot (PostgreSQL text, UTF-8).
        if missing:
            parts.append(f"missing {', '.join(map(repr, missing[:5]))}{' …' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"unexpected {', '.join(map(repr, extra[:5]))}{' …' if len(extra) > 5 else ''}")
        raise ArtifactRejected("spec_mismatch", "tensor names do not match the adapter: " + "; ".join(parts))
    for name, expected in spec.items():
        actual = header[name]
        if list(actual["shape"]) != list(expected["shape"]):
            raise ArtifactRejected(
                "spec_mismatch", f"tensor {name!r} has shape {actual['shape']}, the adapter needs {expected['shape']}"
            )
        if actual["dtype"] != expected["dtype"]:
            raise ArtifactRejected(
                "spec_mismatch", f"tensor {name!r} is {actual['dtype']}, the adapter needs {expected['dtype']}"
            )


def load_checked(data: bytes, spec: dict[str, dict] | None = None) -> dict[str, torch.Tensor]:
    """Framing, then the spec (when given), then finite values; returns the tensors."""
    header = read_header(data)
    if spec is not None:
        check_spec(header, spec)
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # the library's own parse errors, after our framing checks passed
        raise ArtifactRejected("malformed", f"safetensors could not read the file: {exc}") from None
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ArtifactRejected("not_finite", f"tensor {name!r} holds NaN or infinite values")
    return tensors
