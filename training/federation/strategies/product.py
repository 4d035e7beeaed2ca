"""FlexLoRA (``lora_product``): average the products B_k A_k per LoRA layer, then truncated SVD back to rank r.

Devices may train at a rank r_k <= r: their delta's A is [r_k, ...] and B is [out, r_k, 1...]. Per layer,
device k's factors are A_k = A_base[:r_k] + c_k dA_k and B_k = B_base[:, :r_k] + c_k dB_k (c_k the
clipping factor; an absent dA is zero), conv kernels flattened (A [r, in, kh, kw] -> [r, in*kh*kw],
B [out, r, 1, 1] -> [out, r]). The sample-weighted mean P of the products is factored by SVD:
B_new = U_r sqrt(S_r), A_new = sqrt(S_r) Vh_r, so B_new A_new is the best rank-r approximation of P (exact
when P has rank <= r). Components past P's numerical rank get a zero B column and keep A_base's row (as
PEFT initialises LoRA), instead of a zero row: with both zero a rank direction could never learn again.
The result is ``new - base``; saved modules (non-LoRA keys) are fedavg'd. Not shardable: the SVD needs the
whole mean product, which is held per layer in float64 (memory O(largest layer's full weight)).
"""

from __future__ import annotations

import math

import torch

from .base import (
    LORA_A_MARKERS,
    LORA_B_MARKERS,
    Strategy,
    check_headers,
    check_inputs,
    check_spec,
    clip_factors,
    is_lora_a,
    is_lora_b,
    open_delta,
    weighted_sum,
)


def partner(a_key: str) -> str:
    for a_marker, b_marker in zip(LORA_A_MARKERS, LORA_B_MARKERS, strict=True):
        if a_marker in a_key:
            return a_key.replace(a_marker, b_marker, 1)
    raise ValueError(f"{a_key!r} is not a lora_A key")


def lora_pairs(shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, str]]:
    """(A key, B key) per LoRA layer of the spec; ValueError for an unpaired key or non-LoRA shapes."""
    pairs = [(key, partner(key)) for key in shapes if is_lora_a(key)]
    paired = {b for _, b in pairs}
    lonely = [b for b in paired if b not in shapes] + [k for k in shapes if is_lora_b(k) and k not in paired]
    if lonely:
        raise ValueError(f"the spec has LoRA keys without their partner: {lonely[:3]}")
    for a_key, b_key in pairs:
        a, b = shapes[a_key], shapes[b_key]
        if len(a) < 2 or len(b) < 2 or a[0] < 1 or a[0] != b[1] or any(d != 1 for d in b[2:]):
            raise ValueError(f"{a_key} {list(a)} and {b_key} {list(b)} are not LoRA factors A [r, ..], B [out, r, 1..]")
    return pairs


def rank_ok(key: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """A device's lower-rank factor: A [r_k, ...] or B [out, r_k, ...] with 1 <= r_k <= r."""
    if len(shape) != len(expected) or len(shape) < 2:
        return False
    if is_lora_a(key):
        return 1 <= shape[0] <= expected[0] and shape[1:] == expected[1:]
    if is_lora_b(key):
        return shape[0] == expected[0] and 1 <= shape[1] <= expected[1] and shape[2:] == expected[2:]
    return False


def _check_base(base, shapes, pairs) -> None:
    if not isinstance(base, dict):
        raise ValueError("lora_product needs the round's base tensors")
    for key in (key for pair in pairs for key in pair):
        value = base.get(key)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shapes[key]:
            raise ValueError(f"the base lacks {key!r} of shape {list(shapes[key])}")
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"the base's {key!r} holds NaN or infinite values")


class LoraProduct(Strategy):
    name = "lora_product"

    def aggregate(self, inputs, *, spec, base, params) -> dict[str, torch.Tensor]:
        params = self.check_params(params)
        shapes = check_spec(spec)
        inputs = check_inputs(inputs)
        pairs = lora_pairs(shapes)
        _check_base(base, shapes, pairs)
        found = check_headers(inputs, shapes, shape_ok=rank_ok)
        ranks = []
        for index, present in enumerate(found):
            ranks.append({})
            for a_key, b_key in pairs:
                rank = present[b_key][1]
                if a_key in present and present[a_key][0] != rank:
                    raise ValueError(
                        f"delta #{index} ({inputs[index].path}): {a_key!r} has rank {present[a_key][0]} "
                        f"but {b_key!r} has rank {rank}"
                    )
                ranks[index][a_key] = rank
        factors = clip_factors(inputs, params["clip_norm"])
        weights = [float(inp.num_samples) for inp in inputs]
        total = math.fsum(weights)
        lora_keys = {key for pair in pairs for key in pair}
        saved = [key for key in shapes if key not in lora_keys]
        sums = weighted_sum(inputs, [w * c for w, c in zip(weights, factors, strict=True)], shapes, saved)
        out = {key: (sums[key] / total).to(torch.float32) for key in saved}
        for a_key, b_key in pairs:
            out.update(self._layer(inputs, a_key, b_key, shapes, base, ranks, factors, weights, total))
        return {key: out[key] for key in shapes}

    def _layer(self, inputs, a_key, b_key, shapes, base, ranks, factors, weights, total):
        r, out_dim = shapes[a_key][0], shapes[b_key][0]
        a_base = base[a_key].to(torch.float64).reshape(r, -1)
        b_base = base[b_key].to(torch.float64).reshape(out_dim, r)
        product = torch.zeros(out_dim, a_base.shape[1], dtype=torch.float64)
        for index, inp in enumerate(inputs):
            rank = ranks[index][a_key]
            with open_delta(inp, index) as reader:
                d_b = reader.read(b_key).to(torch.float64).reshape(out_dim, rank)
                d_a = reader.read(a_key).to(torch.float64).reshape(rank, -1) if a_key in reader.names() else 0.0
            a_k = a_base[:rank] + factors[index] * d_a
            b_k = b_base[:, :rank] + factors[index] * d_b
            product.addmm_(b_k, a_k, alpha=weights[index])
        product /= total
        if not bool(torch.isfinite(product).all()):
            raise ValueError(f"the mean product for {a_key!r} overflowed")
        u, s, vh = torch.linalg.svd(product, full_matrices=False)
        tol = float(s.max()) * max(product.shape) * torch.finfo(torch.float64).eps if s.numel() else 0.0
        live = min(r, int((s > tol).sum()))
        root = s[:live].sqrt()
        b_new = torch.zeros(out_dim, r, dtype=torch.float64)
        b_new[:, :live] = u[:, :live] * root
        a_new = a_base.clone()
        a_new[:live] = root[:, None] * vh[:live]
        return {
            a_key: (a_new - a_base).to(torch.float32).reshape(shapes[a_key]),
            b_key: (b_new - b_base).to(torch.float32).reshape(shapes[b_key]),
        }
