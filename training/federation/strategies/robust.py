"""Robust aggregation: coordinate-wise trimmed mean and median, Krum and Multi-Krum.

All four read the deltas in blocks of coordinates (``strategies.flat``: the round's coordinate order, one
``pread`` per delta and block): a block holds the same bytes whatever N is (``WORKING_BYTES``: fewer
coordinates for more deltas), or as many coordinates as ``memory_budget`` allows for N deltas once the result's
own memory (O(model)) is set aside where that is less (at most ``chunk_elements``), so the rule's memory is flat
in N and within the budget, never N whole deltas. Clipping (``clip_norm``) scales each delta's values by
``min(1, C / norm)``. Each coordinate's N values are laid side by side (a tiled transposition, a cache-sized
part of a block at a time) and sorted in place, numpy's vectorized sort being faster on rows this short than a
selection (which the median of an odd N above ``Median.SORT_UP_TO`` uses); a row of more values than
``coordinate_rows.SORTED_RUN`` is sorted as two halves, its middle values read across them. Krum's Gram matrix
is float32 matrix products of short blocks, added up in float64.

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
the working memory; Krum needs the Gram matrix anyway and mixes it without reading the deltas
again.

Krum's guarantee needs N >= 2f + 3. Rather than refuse small rounds, f (``byzantine``, default
floor((N - 3) / 2)) is clamped to max(0, floor((N - 3) / 2)), and the neighbour count N - f - 2 to at least 1:
with fewer than 5 deltas Krum tolerates no attacker and just picks the most central delta. Ties go to the
earlier input. Median is the statistical one: for an even N the mean of the two middle values.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import Strategy, check_inputs, check_spec
from .coordinate_rows import side_by_side, sorted_in_halves, transpose_into
from .flat import (
    FlatDelta,
    assemble_spans,
    block_columns,
    coordinate_spans,
    flat_clip_factors,
    flat_weighted_sum,
    open_flat,
    spec_spans,
)


def gather(deltas: list[FlatDelta], start: int, stop: int, factors: list[float], out: np.ndarray) -> np.ndarray:
    """Coordinates ``start:stop`` of every delta, clipped, into the rows of ``out``: float32 [N, stop - start]
    (one ``pread`` per delta when its tensors lie in the round's order). A key a delta lacks reads as zeros."""
    block = out[:, : stop - start]
    for index, delta in enumerate(deltas):
        delta.read(start, stop, block[index])
        if factors[index] != 1.0:
            block[index] *= np.float32(factors[index])
    return block


def distance_row(gram: torch.Tensor, squares: torch.Tensor, i: int, out: torch.Tensor) -> torch.Tensor:
    """Row i of the squared L2 distances, into ``out`` (float64 [N]): ``(a_i + a_j) - 2 g_ij`` clamped at 0,
    ``squares`` the Gram matrix's diagonal (2 g is exact in float64)."""
    return torch.add(squares, squares[i], out=out).sub_(gram[i], alpha=2).clamp_min_(0)


def squared_distances(gram: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """Pairwise squared L2 distances from a Gram matrix (float64, zero diagonal), a row at a time
    (``distance_row``). ``in_place``: written over ``gram`` (no second N x N matrix; the caller has no further
    use for the Gram matrix), the same values."""
    n = gram.shape[0]
    squares = gram.diagonal().clone()
    distances = gram if in_place else torch.empty_like(gram, dtype=torch.float64)
    row = torch.empty(n, dtype=torch.float64)
    for i in range(n):
        distances[i].copy_(distance_row(gram, squares, i, row))
    return distances.fill_diagonal_(0)


def byzantine_count(given: int | None, n: int, spare: int = 3) -> int:
    """f for N deltas: the given one (default the largest allowed), clamped to max(0, floor((N - spare) / 2)):
    Krum's N >= 2f + 3, or with ``spare`` 1 mixing's N > 2f (each delta's N - f nearest a majority)."""
    bound = max(0, (n - spare) // 2)
    return bound if given is None else min(given, bound)


def mixing_matrix(gram: torch.Tensor, f: int) -> torch.Tensor:
    """Nearest-neighbour mixing from the deltas' Gram matrix: row i holds 1 / (N - f) for the N - f deltas nearest
    delta i (itself first, then by squared distance, ties to the earlier input) and 0 elsewhere. float64 [N, N].
    Made a row at a time: the row's squared distances (``distance_row``), then their stable order; every
    distance and their whole order at once were three more N x N matrices beside the Gram matrix and this one."""
    n = gram.shape[0]
    keep = max(1, n - f)
    squares = gram.diagonal().clone()
    mixing = torch.zeros(n, n, dtype=torch.float64)
    ranked = torch.empty(n, dtype=torch.float64)
    for i in range(n):
        distance_row(gram, squares, i, ranked)
        ranked[i] = -1.0  # distances are >= 0: itself first
        mixing[i].index_fill_(0, torch.argsort(ranked, stable=True)[:keep], 1.0 / keep)
    return mixing


class RobustStrategy(Strategy):
    """The robust rules work span by span (``coordinate_spans`` of ``coordinate_shards``): a span's Gram
    matrix (added up across spans in span order) and, for the coordinate rules, a span's values. ``aggregate``
    runs the spans in order on one worker; the server's chord runs one span per task and combines them in
    the same order, so both give the same bytes."""

    shardable_by_coordinates = True
    # Bytes per delta and coordinate a block is sized at: the gathered float32 block takes 4 (its parts laid side
    # by side take one small buffer, ``side_by_side``), and blocks half the size the budget holds ran 1.4x to
    # 1.8x faster than blocks of all of it (median at 1,000 x 1M and 100 x 10M: the transposition's strided
    # reads span half as many pages), so a block is sized at 8, as when it was laid side by side whole; with
    # mixing, also the block's float64 copy, its product and that product in float32.
    BLOCK_BYTES = 8
    MIXING_BLOCK_BYTES = 24
    # A block's bytes at those rates whatever N is (within the budget): memory above start is then the same at
    # N = 100 and 1,000 (a block of a 1M adapter's span held 100 MiB at N = 100 and 247 at N = 1,000, where the
    # budget bound it). Blocks of 64 MiB gathered values ran as fast as blocks of 128 and 247 at 1,000 x 1M,
    # blocks of 16 and 32 MiB 10% to 25% slower (bench/README.md, "aggregation.py").
    WORKING_BYTES = 128 << 20

    def prepare(self, inputs, spec, params):
        params = self.check_params(params)
        shapes = check_spec(spec)
        inputs = check_inputs(inputs)
        order, deltas = open_flat(inputs, shapes)
        return params, order, inputs, deltas, flat_clip_factors(inputs, deltas, params["clip_norm"])

    def spans(self, inputs, *, spec, params) -> list[tuple[int, int]]:
        """The coordinate spans of this round (from the spec's size and ``coordinate_shards``)."""
        return spec_spans(spec, self.check_params(params)["coordinate_shards"])

    # Set aside from the budget before blocks are sized: per coordinate of the adapter, the result's float32
    # parts and their joined copy (``assemble``); and buffers and the allocator's slack.
    RESULT_BYTES = 8
    RESERVE_BYTES = 8 << 20

    def set_aside(self, n: int, total: int) -> int:
        """Bytes of the budget that are not the block's: the result, the reserve, the side-by-side buffer."""
        return self.RESULT_BYTES * total + self.RESERVE_BYTES + 4 * n * side_by_side(n)

    def columns(self, n: int, params: dict, bytes_per_value: int, total: int = 0) -> int:
        """Coordinates per block: ``WORKING_BYTES`` for N deltas, or less where the memory budget holds less once
        the result of an adapter of ``total`` coordinates and the buffers are set aside (``set_aside``); at most
        ``chunk_elements``."""
        budget = max(0, min(self.WORKING_BYTES, params["memory_budget"] - self.set_aside(n, total)))
        return max(1, min(params["chunk_elements"], block_columns(n, budget, bytes_per_value)))

    def blocks(self, deltas, factors, span: tuple[int, int], columns: int, out: np.ndarray | None = None):
        """``(start, stop, block)`` over the span's coordinates: block is float32 [N, stop - start], gathered
        into ``out`` (float32 [N, at least ``columns``]; made for the span if not given) block after block."""
        first, last = span
        if out is None:
            out = np.empty((len(deltas), max(1, min(columns, last - first))), dtype=np.float32)
        for start in range(first, last, columns):
            stop = min(last, start + columns)
            yield start, stop, gather(deltas, start, stop, factors, out)

    @staticmethod
    def gram_columns(n: int, params: dict) -> int:
        """Coordinates per Gram block: what ``GRAM_WORKING_BYTES`` (or the memory budget, if less) holds of N
        deltas' float32 values once the N x N matrices are set aside (``GRAM_SQUARE_BYTES`` per pair), between
        ``GRAM_MIN_COLUMNS`` and ``GRAM_COLUMNS``; at most ``chunk_elements``."""
        working = min(GRAM_WORKING_BYTES, params["memory_budget"]) - GRAM_SQUARE_BYTES * n * n
        columns = min(GRAM_COLUMNS, max(GRAM_MIN_COLUMNS, working // (4 * n)))
        return max(1, min(params["chunk_elements"], columns))

    @staticmethod
    def gram_buffers(n: int, columns: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """A Gram block's gathered values, its product and the float64 rows the product is added through
        (``GRAM_PANEL_ROWS``): made once and used for every span, where arrays made span by span left the
        process larger (RSS 89 against 74 MiB at N = 1,000 after four spans)."""
        panel = torch.empty(min(n, GRAM_PANEL_ROWS), n, dtype=torch.float64)
        return np.empty((n, columns), dtype=np.float32), torch.empty(n, n, dtype=torch.float32), panel

    def span_gram(self, deltas, factors, params, span, buffers=None, into=None) -> torch.Tensor:
        """The clipped deltas' Gram matrix over one span, of the deltas less their mean (what pairwise distances
        need, and all they are used for): float32 products of short blocks, added up in float64 (O(N^2)),
        from zero, in ``into`` (float64 N x N, zeroed first) if given, else in a new matrix."""
        n = len(deltas)
        columns = self.gram_columns(n, params)
        out, product, panel = buffers if buffers is not None else self.gram_buffers(n, columns)
        gram = torch.zeros(n, n, dtype=torch.float64) if into is None else into.zero_()
        for _, _, block in self.blocks(deltas, factors, span, columns, out):
            values = torch.from_numpy(block)
            # Centred on the block's mean, in place (the next block is gathered into the same array): distances
            # do not change, and float32 products of what is left lose far less to cancellation than products
            # of deltas that share a large common part.
            values.sub_(values.mean(dim=0, keepdim=True))
            torch.mm(values, values.T, out=product)
            for row in range(0, n, len(panel)):  # float32 into float64 through a small panel: the same sums,
                rows = min(len(panel), n - row)  # where adding the float32 product whole made an N x N
                wide = panel[:rows].copy_(product[row : row + rows])  # float64 copy at every block
                gram[row : row + rows].add_(wide)
        return gram

    def gram_partial(self, inputs, *, spec, params, span) -> torch.Tensor:
        """One span's Gram matrix (a chord task's part)."""
        params, _, inputs, deltas, factors = self.prepare(inputs, spec, params)
        return self.span_gram(deltas, factors, params, span)

    @staticmethod
    def combine_grams(parts) -> torch.Tensor:
        """The whole Gram matrix from the spans' parts, added in span order."""
        total = None
        for part in parts:
            total = part.to(torch.float64).clone() if total is None else total.add_(part.to(torch.float64))
        if total is None:
            raise ValueError("no Gram matrix to combine")
        return total

    def gram(self, deltas, factors, params, spans) -> torch.Tensor:
        """The Gram matrix over every span, one worker: ``combine_grams`` of the spans' parts, as a chord's tasks
        give them (the same bytes). Each part is made in one reused matrix: ``combine_grams`` copies the first
        and adds each next one before the next is made (a generator)."""
        n = len(deltas)
        buffers = self.gram_buffers(n, self.gram_columns(n, params))
        scratch = torch.empty(n, n, dtype=torch.float64)
        return self.combine_grams(
            self.span_gram(deltas, factors, params, span, buffers, into=scratch) for span in spans
        )

    def mixing(self, gram: torch.Tensor, params: dict) -> torch.Tensor:
        """The nearest-neighbour mixing matrix for ``mixing: "nnm"`` (f from ``byzantine``)."""
        return mixing_matrix(gram, byzantine_count(params["byzantine"], gram.shape[0], spare=1))

    def needs_gram(self, params) -> bool:
        return self.check_params(params)["mixing"] == "nnm"


# A Gram pass holds GRAM_WORKING_BYTES whatever N is: the N x N matrices (GRAM_SQUARE_BYTES per pair: the
# block's float32 product, the span's float64 sum and the total, the distances written over the total) and
# the gathered float32 block, centred in place, in what they leave, so memory stays flat in N up to N ~ 1,100
# (24 MiB of matrices alone; past that they grow as N^2, which the Gram matrix itself is). Its columns stay
# between GRAM_MIN_COLUMNS (for the matrix product to run at full speed) and GRAM_COLUMNS (for float32 dot
# products to stay accurate: they are added up in float64; centred values of 50 deltas sharing a common part,
# against float64, gave pairwise distances within 4.2e-7 relative at 2^15 columns and 6.9e-7 at 2^16). With
# 16 MiB blocks and the matrices on top, Krum held 26 MiB above start at 100 x 1M and 74 to 105 at 1,000 x 1M
# (bench/README.md, "aggregation.py").
GRAM_WORKING_BYTES = 24 << 20
# Rows of the float32 product widened to float64 and added at a time (``span_gram``): torch's float64 +=
# float32 of a whole N x N product allocated a float64 copy of it on every block, and the process grew by one
# such copy per block for the first few (RSS +56 MiB at N = 1,000 over a span's six blocks), four times slower
# than adding through this reused panel.
GRAM_PANEL_ROWS = 64
GRAM_SQUARE_BYTES = 4 + 8 + 8
GRAM_MIN_COLUMNS = 512
GRAM_COLUMNS = 1 << 16


class CoordinateStrategy(RobustStrategy):
    def reduce(self, rows: np.ndarray, params: dict) -> np.ndarray:
        """One value per row of ``rows`` (float32 [coordinates, N], contiguous, reordered in place)."""
        raise NotImplementedError

    def span_values(self, deltas, factors, params, span, mixing=None) -> torch.Tensor:
        """The rule's result over one span: float32 [span length]. Each block is laid side by side and reduced a
        few columns at a time (``side_by_side``), so each part is sorted while the CPU's cache still holds it."""
        n = len(deltas)
        total = deltas[0].order.total if deltas else 0
        columns = self.columns(n, params, self.MIXING_BLOCK_BYTES if mixing is not None else self.BLOCK_BYTES, total)
        result = torch.empty(span[1] - span[0], dtype=torch.float32)
        step = side_by_side(n)
        rows = torch.empty(max(1, min(step, columns, span[1] - span[0])), n, dtype=torch.float32)
        for start, stop, block in self.blocks(deltas, factors, span, columns):
            values = torch.from_numpy(block)
            if mixing is not None:
                values = (mixing @ values.to(torch.float64)).to(torch.float32)
            at = start - span[0]
            for first in range(0, stop - start, step):
                last = min(stop - start, first + step)
                transposed = rows[: last - first]
                transpose_into(transposed, values[:, first:last])  # each coordinate's N values side by side
                result[at + first : at + last] = torch.from_numpy(self.reduce(transposed.numpy(), params))
        return result

    def span_partial(self, inputs, *, spec, params, span, gram=None) -> torch.Tensor:
        """One span's values (a chord task's part); ``gram``: the whole Gram matrix, when mixing."""
        params, _, inputs, deltas, factors = self.prepare(inputs, spec, params)
        mixing = self.mixing(gram, params) if params["mixing"] == "nnm" else None
        return self.span_values(deltas, factors, params, span, mixing)

    def assemble(self, parts, *, spec, inputs) -> dict[str, torch.Tensor]:
        """The aggregated delta from the spans' values, in span order."""
        return assemble_spans(parts, spec=spec, inputs=inputs)

    def aggregate(self, inputs, *, spec, base, params) -> dict[str, torch.Tensor]:
        params, order, inputs, deltas, factors = self.prepare(inputs, spec, params)
        spans = coordinate_spans(order.total, params["coordinate_shards"])
        mixing = None
        if params["mixing"] == "nnm":
            mixing = self.mixing(self.gram(deltas, factors, params, spans), params)
        parts = [self.span_values(deltas, factors, params, span, mixing) for span in spans]
        return self.assemble(parts, spec=spec, inputs=inputs)


class TrimmedMean(CoordinateStrategy):
    """Per coordinate: drop the ``floor(trim_ratio * N)`` smallest and largest values, average the rest."""

    name = "trimmed_mean"

    def reduce(self, rows, params):
        n = rows.shape[1]
        cut = int(params["trim_ratio"] * n)
        if cut and (halves := sorted_in_halves(rows)) is not None:
            return (halves.middle_sum(cut) / (n - 2 * cut)).astype(np.float32)
        if cut:
            rows.sort(axis=1)
        return (rows[:, cut : n - cut].sum(axis=1, dtype=np.float64) / (n - 2 * cut)).astype(np.float32)


class Median(CoordinateStrategy):
    """Per coordinate median (the mean of the two middle values for an even N)."""

    name = "median"

    # Up to this many deltas a sort of each row (numpy's is vectorized) is faster than a selection
    # (``partition``), and for an even N it gives both middle values at once; measured on rows of 7 to 1,000
    # float32 values (bench/README.md, "aggregation.py"). Above it, an odd N selects its one middle value; above
    # coordinate_rows.SORTED_RUN, any N reads its middle values across the row's sorted halves.
    SORT_UP_TO = 256

    def reduce(self, rows, params):
        n = rows.shape[1]
        middle = n // 2
        if (halves := sorted_in_halves(rows)) is not None:
            lower, upper = halves.around(middle)
            return upper if n % 2 else ((lower.astype(np.float64) + upper) / 2).astype(np.float32)
        if n % 2 == 0 or n <= self.SORT_UP_TO:
            rows.sort(axis=1)
        else:
            rows.partition(middle, axis=1)  # row[middle] in place, smaller values before it
        upper = rows[:, middle]
        if n % 2:
            return upper.copy()
        lower = rows[:, middle - 1]
        return ((lower.astype(np.float64) + upper) / 2).astype(np.float32)


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
        prepared = self.prepare(inputs, spec, params)
        params, coordinates, _, deltas, factors = prepared
        spans = coordinate_spans(coordinates.total, params["coordinate_shards"])
        return self._chosen_mean(prepared, self.gram(deltas, factors, params, spans))  # no name holds the matrix

    def needs_gram(self, params) -> bool:
        return True

    def from_gram(self, inputs, *, spec, params, gram) -> dict[str, torch.Tensor]:
        """Krum's choice from the deltas' whole Gram matrix, and the chosen deltas' (weighted) mean: the
        combining step of a chord whose tasks computed the spans' Gram matrices."""
        return self._chosen_mean(self.prepare(inputs, spec, params), gram)

    def _chosen_mean(self, prepared, gram) -> dict[str, torch.Tensor]:
        params, coordinates, inputs, deltas, factors = prepared
        n = len(inputs)
        mixing = self.mixing(gram, params) if params["mixing"] == "nnm" else None
        if mixing is not None:  # M G M^T, the second product written over G: one N x N matrix between them
            gram = torch.mm(torch.mm(mixing, gram), mixing.T, out=gram)
        f = byzantine_count(params["byzantine"], n)
        scores = krum_scores(squared_distances(gram, in_place=True), f)
        del gram  # the distances, written over it: N x N float64 not held through the chosen deltas' mean
        order = sorted(range(n), key=lambda i: (scores[i], i))
        chosen = order[: self.select(params, n, f)]
        weights = [float(inputs[i].num_samples) if len(chosen) > 1 else 1.0 for i in chosen]
        total = math.fsum(weights)
        if mixing is not None:  # each chosen mixed delta is a mean of originals: their weights add up
            mixed = sum(w * mixing[i] for i, w in zip(chosen, weights, strict=True))
            chosen = [j for j in range(n) if float(mixed[j]) > 0]
            weights = [float(mixed[j]) for j in chosen]
            del mixing, mixed  # N x N float64 not held through the chosen deltas' mean
        picked = [deltas[i] for i in chosen]
        sums = torch.from_numpy(
            flat_weighted_sum(picked, [w * factors[i] for w, i in zip(weights, chosen, strict=True)])
        )
        return {key: (value / total).to(torch.float32) for key, value in coordinates.split(sums).items()}


class MultiKrum(Krum):
    """Multi-Krum: the m (``multi_k``, default N - f, at most N) best-scored deltas, sample-weighted mean."""

    name = "multi_krum"

    def select(self, params, n: int, f: int) -> int:
        m = params["multi_k"]
        return min(n, n - f if m is None else m)
