"""Deterministic delta files for ``bench/aggregation.py``: sizes, the tensor layout, and the on-disk cache.

A size ``NxP`` is N deltas of P float32 parameters; ``1M`` is 2**20 (1,048,576) parameters, ``10M`` is
10 * 2**20, ``256K`` is 2**18. The parameters are laid out as a LoRA adapter: ``P / (2 * h * r)`` modules,
each ``lora_A`` [r, h] plus ``lora_B`` [h, r] (h=1024, r=8 for the small models; h=4096, r=16 when that
still gives at least 32 modules, e.g. 10M: 80 modules of 131,072).

Delta ``i`` of a model of P parameters is the same bytes whatever N is (numpy's generator seeded with
``[P, i]``, encoded by ``edge_agent.delta.encode_delta``, signed by ``sign_delta`` with device ``i``'s
Ed25519 key, itself derived from ``i``), so the 100x1M set is the first 100 files of the 1000x1M set.
Files live in ``bench/results/aggregation-cache/p<P>-v1/``: ``delta-<i>.safetensors`` plus
``delta-<i>.json`` (envelope, signature, public key). Only missing files are made.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "aggregation-cache"
LAYOUT_VERSION = "v2"  # v2: device ids are UUIDs, as the protocol requires (docs/protocol/README.md)
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20}


@dataclass(frozen=True)
class Size:
    n: int
    params: int
    label: str

    @property
    def folder(self) -> Path:
        return CACHE / f"p{self.params}-{LAYOUT_VERSION}"

    def paths(self) -> list[Path]:
        return [self.folder / f"delta-{i:05d}.safetensors" for i in range(self.n)]

    def sidecars(self) -> list[Path]:
        return [self.folder / f"delta-{i:05d}.json" for i in range(self.n)]


def parse_size(text: str) -> Size:
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*([KM]?)\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"a size is NxP such as 100x1M, not {text!r}")
    n, count, unit = int(match[1]), int(match[2]), match[3].upper()
    params = count * UNITS[unit]
    if n < 1:
        raise ValueError(f"{text}: N must be >= 1")
    layout(params)  # refuses a P the layout cannot hold
    return Size(n, params, f"{n}x{count}{unit}")


def layout(params: int) -> dict[str, list[int]]:
    """``{name: shape}`` of a LoRA adapter of exactly ``params`` float32 parameters."""
    for hidden, rank in ((4096, 16), (1024, 8), (256, 4)):
        per_module = 2 * hidden * rank
        modules = params // per_module
        if params % per_module == 0 and (modules >= 32 or hidden == 256):
            break
    else:
        raise ValueError(f"{params} parameters is not a multiple of {2 * 256 * 4}")
    shapes = {}
    for module in range(modules):
        prefix = f"base_model.model.model.layers.{module // 2}.self_attn.{'qv'[module % 2]}_proj"
        shapes[f"{prefix}.lora_A.weight"] = [rank, hidden]
        shapes[f"{prefix}.lora_B.weight"] = [hidden, rank]
    return shapes


def num_samples(index: int) -> int:
    return 10 + (index * 37) % 91


def _values(params: int, index: int):
    import numpy as np

    rng = np.random.default_rng([params, index])
    scale = 0.01 * (1 + (index % 10) / 10)  # norms differ between devices (Krum has something to choose)
    return rng.standard_normal(params, dtype=np.float32) * np.float32(scale)


def device_key(index: int):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"bench-device-{index}".encode()).digest())


def ensure(size: Size, log=print) -> int:
    """Make the missing delta files of ``size``; returns how many were made."""
    import torch

    from edge_agent.delta import encode_delta, sign_delta
    from edge_agent.identity import public_key_b64

    size.folder.mkdir(parents=True, exist_ok=True)
    shapes = layout(size.params)
    made = 0
    for index, (path, sidecar) in enumerate(zip(size.paths(), size.sidecars(), strict=True)):
        if path.exists() and sidecar.exists():
            continue
        flat = torch.from_numpy(_values(size.params, index))
        tensors, offset = {}, 0
        for name, shape in shapes.items():
            count = shape[0] * shape[1]
            tensors[name] = flat[offset : offset + count].view(*shape)
            offset += count
        data = encode_delta(tensors, encoding="f32")
        key = device_key(index)
        signed = sign_delta(
            key,
            data,
            device_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"bench-device-{index}")),
            adapter="bench-adapter",
            base_version=1,
            num_samples=num_samples(index),
            counter=index,
            created_at=1_700_000_000.0 + index,
        )
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        sidecar.write_text(json.dumps({**signed, "public_key": public_key_b64(key)}))
        made += 1
        if made % 100 == 0:
            log(f"  made {made} delta files of {size.params} parameters", file=sys.stderr)
    return made


def total_bytes(size: Size) -> int:
    return sum(path.stat().st_size for path in size.paths())


def warm(size: Size) -> None:
    """Read every file once (into one reused buffer) so each method starts with them in the page cache."""
    buffer = bytearray(8 << 20)
    for path in size.paths():
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass
