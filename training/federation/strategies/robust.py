"""Robust aggregation: coordinate-wise trimmed mean and median, Krum and Multi-Krum.

All four read the deltas in coordinate chunks: a chunk is a run of row ranges (along each tensor's first
dimension, read lazily with ``safe_open(...).get_slice(key)[a:b]``) holding at most ``chunk_elements``
coordinates (one row may exceed it when a single row is larger). For each chunk every delta is opened in
turn, its rows read and the file closed again, so working memory is O(N x chunk) plus O(model) for the
result, never N whole deltas. Clipping (``clip_norm``) scales each delta's rows by ``min(1, C / norm)``.

They are unweighted on purpose: ``num_samples`` is reported by the device itself, so weighting by it would
let one attacker claiming a huge sample count outweigh everyone and void the breakdown point these rules
exist for (a trimmed mean or median tolerates a fraction of bad *deltas*, not of claimed samples). Only
Multi-Krum weights, after selection, the deltas it has already judged honest.

Nearest-neighbour mixing (``mixing: "nnm"``, Allouah et al., "Fixing by Mixing", AISTATS 2023) is a pre-step
for any of the four: each delta is replaced by the mean of the N - f deltas nearest to it (itself included),
and the rule runs on those means. Honest devices with different data (non-IID shards) then look alike to the
rule, so median and Krum stop paying for their disagreement; an attacker's delta is mixed with honest ones
and honest means keep at most f attackers' share each. Mixing needs an honest majority, N > 2f: its f is
``byzantine`` clamped to floor((N - 1) / 2) (default that bound), not Krum's tighter bound, so a small round
with one attacker is still mixed. Past f attackers it shields nothing and can do worse than the bare rule
(bench/README.md). An adapter's ``krum`` mixes unless told not to
(``MIXING_DEFAULTS`` in ``training/federation/aggregation_settings.py``); here, as for the others, it is off unless
``params`` say ``"nnm"``. It costs a second pass over the deltas for their Gram matrix and O(N^2) float64 beside
the O(N x chunk) working memory; Krum needs the Gram matrix anyway and mixes it without reading the deltas
again.

Krum's guarantee needs N >= 2f + 3. Rather than refuse small rounds, f (``byzantine``, default
floor((N - 3) / 2)) is clamped to max(0, floor((N - 3) / 2)), and the neighbour count N - f - 2 to at least 1:
with fewer than 5 deltas Krum tolerates no attacker and just picks the most central delta. Ties go to the
earlier input. Median is the statistical one: for an even N the mean of the two middle values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import Strategy, check_headers, check_inputs, check_spec, clip_factors, open_delta, weighted_sum


@dataclass(frozen=True)
class Segment:
    key: str
    start: int  # first row (a 0-d tensor is one row)
    stop: int
    offset: int  # position of row ``start`` in the flattened tensor
    size: int  # coordinates


def chunk_plan(shapes: dict[str, tuple[int, ...]], chunk_elements: int) -> list[list[Segment]]:
    """The model's coordinates cut into chunks of at most ``chunk_elements`` (whole rows, small tensors
    packed together), in spec order."""
    chunks: list[list[Segment]] = []
    current: list[Segment] = []
    filled = 0
    for key, shape in shapes.items():
        numel = math.prod(shape)
        if numel == 0:
            continue
        rows = shape[0] if shape else 1
        row = numel // rows
        start = 0
        while start < rows:
            take = min(rows - start, (chunk_elements - filled) // row)
            if take == 0 and current:
                chunks.append(current)
                current, filled = [], 0
                continue
            take = max(take, 1)
            current.append(Segment(key, start, start + take, start * row, take * row))
            filled += take * row
            start += take
            if filled >= chunk_elements:
                chunks.append(current)
                current, filled = [], 0
    if current:
        chunks.append(current)
    return chunks


def gather(inputs, segments: list[Segment], factors: list[float]) -> torch.Tensor:
    """The chunk's coordinates of every delta, clipped: float32 [N, chunk size]. A key a delta lacks (an
    FFA-layout lora_A) reads as zeros."""
    size = sum(segment.size for segment in segments)
    out = torch.empty(len(inputs), size, dtype=torch.float32)
    for index, inp in enumerate(inputs):
        with open_delta(inp, index) as reader:
            present = set(reader.names())
            position = 0
            for segment in segments:
                target = out[index, position : position + segment.size]
                if segment.key in present:
                    target.copy_(reader.read_rows(segment.key, segment.start, segment.stop))
                else:
                    target.zero_()
                position += segment.size
        if factors[index] != 1.0:
            out[index].mul_(factors[index])
    return out


# Sorting and the float64 Gram product make temporaries several times the chunk's size (sort returns int64
# indices too), so they run over blocks of this many columns of the [N, chunk] matrix at a time.
BLOCK = 1 << 16


def blocks(stacked: torch.Tensor):
    for start in range(0, stacked.shape[1], BLOCK):
        yield stacked[:, start : start + BLOCK]


def scatter(result: dict[str, torch.Tensor], segments: list[Segment], values: torch.Tensor) -> None:
    position = 0
    for segment in segments:
        flat = result[segment.key].view(-1)
        flat[segment.offset : segment.offset + segment.size] = values[position : position + segment.size]
        position += segment.size


def squared_distances(gram: torch.Tensor) -> torch.Tensor:
    """Pairwise squared L2 distances from a Gram matrix (float64, zero diagonal)."""
    squares = gram.diagonal().clone()
    distances = (squares[:, None] + squares[None, :] - 2 * gram).clamp_min_(0)
    return distances.fill_diagonal_(0)


def byzantine_count(given: int | None, n: int, spare: int = 3) -> int:
    """f for N deltas: the given one (default the largest allowed), clamped to max(0, floor((N - spare) / 2)):
    Krum's N >= 2f + 3, or with ``spare`` 1 mixing's N > 2f (each delta's N - f nearest a majority)."""
    bound = max(0, (n - spare) // 2)
    return bound if given is None else min(given, bound)


def mixing_matrix(distances: torch.Tensor, f: int) -> torch.Tensor:
    """Nearest-neighbour mixing: row i holds 1 / (N - f) for the N - f deltas nearest delta i (itself first,
    then by distance, ties to the earlier input) and 0 elsewhere. float64 [N, N]."""
    n = distances.shape[0]
    keep = max(1, n - f)
    ranked = distances.to(torch.float64).clone().fill_diagonal_(-1.0)  # distances are >= 0: itself first
    nearest = torch.argsort(ranked, dim=1, stable=True)[:, :keep]
    return torch.zeros(n, n, dtype=torch.float64).scatter_(1, nearest, 1.0 / keep)


class RobustStrategy(Strategy):
    def prepare(self, inputs, spec, params):
        params = self.check_params(params)
        shapes = check_spec(spec)
        inputs = check_inputs(inputs)
        check_headers(inputs, shapes)
        return params, shapes, inputs, clip_factors(inputs, params["clip_norm"])

    def chunks(self, inputs, shapes, factors, chunk_elements):
        for segments in chunk_plan(shapes, chunk_elements):
            yield segments, gather(inputs, segments, factors)

    def gram(self, inputs, shapes, factors, chunk_elements) -> torch.Tensor:
        """The clipped deltas' Gram matrix, accumulated over coordinate chunks in float64 (O(N^2) memory)."""
        n = len(inputs)
        gram = torch.zeros(n, n, dtype=torch.float64)
        for _, stacked in self.chunks(inputs, shapes, factors, chunk_elements):
            for block in blocks(stacked):
                block = block.to(torch.float64)
                gram.addmm_(block, block.T)
        return gram

    def mixing(self, gram: torch.Tensor, params: dict) -> torch.Tensor:
        """The nearest-neighbour mixing matrix for ``mixing: "nnm"`` (f from ``byzantine``)."""
        return mixing_matrix(squared_distances(gram), byzantine_count(params["byzantine"], gram.shape[0], spare=1))


class CoordinateStrategy(RobustStrategy):
    def reduce(self, stacked: torch.Tensor, params: dict) -> torch.Tensor:
        raise NotImplementedError

    def aggregate(self, inputs, *, spec, base, params) -> dict[str, torch.Tensor]:
        params, shapes, inputs, factors = self.prepare(inputs, spec, params)
        mixing = None
        if params["mixing"] == "nnm":
            mixing = self.mixing(self.gram(inputs, shapes, factors, params["chunk_elements"]), params)
        result = {key: torch.zeros(shape, dtype=torch.float32) for key, shape in shapes.items()}
        for segments, stacked in self.chunks(inputs, shapes, factors, params["chunk_elements"]):
            reduced = []
            for block in blocks(stacked):
                if mixing is not None:  # block by block, so the float64 product stays a block's size
                    block = (mixing @ block.to(torch.float64)).to(torch.float32)
                reduced.append(self.reduce(block, params))
            scatter(result, segments, torch.cat(reduced))
        return result


class TrimmedMean(CoordinateStrategy):
    """Per coordinate: drop the ``floor(trim_ratio * N)`` smallest and largest values, average the rest."""

    name = "trimmed_mean"

    def reduce(self, stacked, params):
        n = stacked.shape[0]
        cut = int(params["trim_ratio"] * n)
        kept = stacked.sort(dim=0).values[cut : n - cut] if cut else stacked
        return kept.to(torch.float64).mean(dim=0).to(torch.float32)


class Median(CoordinateStrategy):
    """Per coordinate median (the mean of the two middle values for an even N)."""

    name = "median"

    def reduce(self, stacked, params):
        n = stacked.shape[0]
        if n % 2:
            return stacked.median(dim=0).values
        ordered = stacked.sort(dim=0).values
        return ((ordered[n // 2 - 1].double() + ordered[n // 2].double()) / 2).to(torch.float32)


def krum_scores(distances: torch.Tensor, f: int) -> list[float]:
    """Per delta, the sum of its squared distances to its N - f - 2 nearest others (at least 1)."""
    n = distances.shape[0]
    neighbours = min(n - 1, max(1, n - f - 2))
    scores = []
    for i in range(n):
        others = torch.cat([distances[i, :i], distances[i, i + 1 :]])
        scores.append(float(others.sort().values[:neighbours].sum()) if neighbours > 0 else 0.0)
    return scores


class Krum(RobustStrategy):
    """Krum: the delta with the smallest sum of squared distances to its N - f - 2 nearest neighbours.
    Distances come from a Gram matrix accumulated over coordinate chunks in float64 (O(N^2) memory). With
    mixing, the mixed deltas' Gram matrix is M G M^T, and the chosen mixed delta is read back as its weighted
    sum of the originals."""

    name = "krum"

    def select(self, params, n: int, f: int) -> int:
        return 1

    def aggregate(self, inputs, *, spec, base, params) -> dict[str, torch.Tensor]:
        params, shapes, inputs, factors = self.prepare(inputs, spec, params)
        n = len(inputs)
        gram = self.gram(inputs, shapes, factors, params["chunk_elements"])
        mixing = self.mixing(gram, params) if params["mixing"] == "nnm" else None
        if mixing is not None:
            gram = mixing @ gram @ mixing.T
        f = byzantine_count(params["byzantine"], n)
        scores = krum_scores(squared_distances(gram), f)
        order = sorted(range(n), key=lambda i: (scores[i], i))
        chosen = order[: self.select(params, n, f)]
        weights = [float(inputs[i].num_samples) if len(chosen) > 1 else 1.0 for i in chosen]
        total = math.fsum(weights)
        if mixing is not None:  # each chosen mixed delta is a mean of originals: their weights add up
            mixed = sum(w * mixing[i] for i, w in zip(chosen, weights, strict=True))
            chosen = [j for j in range(n) if float(mixed[j]) > 0]
            weights = [float(mixed[j]) for j in chosen]
        picked = [inputs[i] for i in chosen]
        sums = weighted_sum(picked, [w * factors[i] for w, i in zip(weights, chosen, strict=True)], shapes, shapes)
        return {key: (sums[key] / total).to(torch.float32) for key in shapes}


class MultiKrum(Krum):
    """Multi-Krum: the m (``multi_k``, default N - f, at most N) best-scored deltas, sample-weighted mean."""

    name = "multi_krum"

    def select(self, params, n: int, f: int) -> int:
        m = params["multi_k"]
        return min(n, n - f if m is None else m)
