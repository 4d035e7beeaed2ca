"""Reading a safetensors header's JSON so that no key counts twice.

JSON does not say what an object that names a key twice means: Python's ``json`` keeps the last entry, and so
does the safetensors library for tensor names and metadata keys, but another reader may keep the first. A header
that names a tensor twice could then show the server one tensor and a device another, so both ends refuse it:
``duplicate_tensor`` when a tensor name repeats, ``malformed`` for any other repeated key. Two kinds of repeat
the safetensors library already refuses on its own ("duplicate field": ``__metadata__`` twice, or ``dtype``,
``shape`` or ``data_offsets`` twice in a tensor's entry) are left to it, so they are refused as before, with the
same words. The server reads delta and artifact headers with this (``training.registry.artifacts``), the agent
the files it downloads (``edge_agent.manifest.verify_file``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METADATA_KEY = "__metadata__"
ENTRY_FIELDS = ("dtype", "shape", "data_offsets")  # a tensor entry's fields: the library refuses one twice
# The safetensors library's own limit on a header; the agent reads no header it would refuse to load anyway.
LIBRARY_MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class Repeat:
    """A key an object of the JSON names more than once: ``depth`` 0 in the outermost object, 1 in the value of
    its key ``parent`` (a tensor's entry, or the metadata), 2 deeper (``parent`` None)."""

    key: str
    depth: int
    parent: str | None = None


def loads_noting_repeats(text: bytes | str) -> tuple[Any, list[Repeat]]:
    """``json.loads(text)`` (the same value, keeping the last entry of a repeated key, as ``json`` does) and
    every key an object repeats, in the order the parser met them. Raises what ``json.loads`` raises."""
    found: list[tuple[dict, str]] = []

    def build(pairs: list[tuple[str, Any]]) -> dict:
        obj: dict = {}
        for key, value in pairs:
            if key in obj:
                found.append((obj, key))
            obj[key] = value
        return obj

    value = json.loads(text, object_pairs_hook=build)
    if not found:
        return value, []
    parents = {id(v): k for k, v in value.items()} if isinstance(value, dict) else {}
    repeats = []
    for obj, key in found:
        if obj is value:
            repeats.append(Repeat(key, 0))
        elif id(obj) in parents and value[parents[id(obj)]] is obj:
            repeats.append(Repeat(key, 1, parents[id(obj)]))
        else:
            repeats.append(Repeat(key, 2))
    return value, repeats


def repeat_refusal(repeats: list[Repeat]) -> tuple[str, str] | None:
    """``(code, message)`` refusing a header whose JSON repeats a key (None when none repeats, or only as the
    safetensors library refuses on its own): a tensor named twice first, as ``duplicate_tensor``; any other
    repeated key as ``malformed``."""
    for repeat in repeats:
        if repeat.depth == 0 and repeat.key != METADATA_KEY:
            return (
                "duplicate_tensor",
                f"the header names tensor {repeat.key!r} more than once (readers differ on which entry counts)",
            )
    for repeat in repeats:
        if repeat.depth == 0 or (repeat.depth == 1 and repeat.parent != METADATA_KEY and repeat.key in ENTRY_FIELDS):
            continue  # the library's "duplicate field"
        if repeat.depth == 1:
            where = "in the metadata" if repeat.parent == METADATA_KEY else f"in the entry of tensor {repeat.parent!r}"
        else:
            where = "in an object nested in the header"
        return "malformed", f"the header repeats the key {repeat.key!r} {where} (readers differ on which one counts)"
    return None


def file_repeat_refusal(path: Path) -> tuple[str, str] | None:
    """``repeat_refusal`` for the safetensors file at ``path``; None as well when its header cannot be read as
    a JSON object at all (the safetensors loader refuses that file on its own)."""
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return None
        (size,) = struct.unpack("<Q", prefix)
        if size > LIBRARY_MAX_HEADER_BYTES:
            return None
        raw = handle.read(size)
    if len(raw) < size:
        return None
    try:
        value, repeats = loads_noting_repeats(raw)
    except (ValueError, RecursionError):
        return None
    return repeat_refusal(repeats) if isinstance(value, dict) else None
