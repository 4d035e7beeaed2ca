"""What the strategy tests share: a small LoRA tensor spec, delta files made from it, and the reference computations
the strategies are held to (pure torch; no database)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open

from edge_agent.delta import decode_tensor, encode_delta, read_encoding
from training.federation.strategies import DeltaInput, get_strategy

ROOT = Path(__file__).resolve().parents[2]
P = "base_model.model."
SPEC = {
    f"{P}fc1.lora_A.weight": {"shape": [4, 12], "dtype": "F32"},
    f"{P}fc1.lora_B.weight": {"shape": [10, 4], "dtype": "F32"},
    f"{P}conv.lora_A.weight": {"shape": [4, 3, 3, 3], "dtype": "F32"},
    f"{P}conv.lora_B.weight": {"shape": [6, 4, 1, 1], "dtype": "F32"},
    f"{P}head.weight": {"shape": [5, 10], "dtype": "F32"},
    f"{P}head.bias": {"shape": [5], "dtype": "F32"},
}
A_KEYS = [k for k in SPEC if ".lora_A." in k]
ALL = ("fedavg", "fedbuff", "ffa_lora", "lora_product", "trimmed_mean", "median", "krum", "multi_krum")


def rand_tensors(gen, spec=SPEC, scale=1.0, skip=()):
    return {k: torch.randn(v["shape"], generator=gen) * scale for k, v in spec.items() if k not in skip}


def base_tensors(seed=0, spec=SPEC):
    return rand_tensors(torch.Generator().manual_seed(seed), spec)


def write(tmp_path: Path, name: str, tensors: dict, encoding: str = "f32") -> str:
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(encode_delta(tensors, encoding=encoding))
    return str(path)


def decoded(path: str) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        encoding, scales = read_encoding(f.metadata())
        return {k: decode_tensor(f.get_tensor(k), encoding=encoding, scale=scales.get(k)) for k in f.keys()}  # noqa: SIM118


def make_inputs(tmp_path, n, *, seed=1, samples=None, staleness=None, encoding="f32", scale=1.0, skip=()):
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for i in range(n):
        path = write(tmp_path, f"d{seed}-{i}", rand_tensors(gen, scale=scale, skip=skip), encoding)
        inputs.append(DeltaInput(path, samples[i] if samples else 1 + i * 3, staleness[i] if staleness else 0))
    return inputs


def weighted_reference(inputs, weights, spec=SPEC, factors=None):
    deltas = [decoded(inp.path) for inp in inputs]
    factors = factors or [1.0] * len(inputs)
    w = torch.tensor([a * b for a, b in zip(weights, factors, strict=True)], dtype=torch.float64)
    out = {}
    for key, entry in spec.items():
        stacked = torch.stack([d.get(key, torch.zeros(entry["shape"])).double() for d in deltas])
        out[key] = ((stacked * w.view(-1, *[1] * (stacked.dim() - 1))).sum(0) / sum(weights)).float()
    return out


def assert_same(got, want, **tol):
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == torch.float32
        torch.testing.assert_close(got[key], want[key], **({"rtol": 1e-6, "atol": 1e-7} | tol), msg=key)


def run(name, inputs, params=None, spec=SPEC, base=None):
    base = base_tensors() if base is None else base
    return get_strategy(name).aggregate(inputs, spec=spec, base=base, params=params or {})


def norm_of(path):
    return math.sqrt(sum(float(t.double().square().sum()) for t in decoded(path).values()))


# -- registry --------------------------------------------------------------------------------------------
