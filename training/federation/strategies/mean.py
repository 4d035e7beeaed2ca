"""Weighted means: fedavg, fedbuff and ffa_lora. Streaming, and split across workers two ways.

Without DP, a round is split by coordinates: ``span_partial(span)`` is that span of
``sum_i w_i * c_i * delta_i / sum_i w_i`` (w_i the strategy's weight, c_i the clipping factor), the sums in
float64 over every delta in order, then the span's float32 values; ``assemble`` joins the spans in order.
Each coordinate is the same arithmetic whichever span holds it, so ``aggregate`` (one span of everything) and
a chord of spans on several workers give the same bytes, and a worker's part is 4 bytes per coordinate of its
span, where a shard's float64 sums of every coordinate were 8 per coordinate of the adapter, to store, read and
add (bench/README.md, "aggregation.py").

With DP, the noise is drawn once for the whole sum, so a round is split by deltas: ``partial(shard)`` is
``(sum_i w_i * c_i * delta_i, sum_i w_i)`` in float64, reading one delta at a time into one running sum per
tensor: memory O(model) whatever N is. ``combine`` adds the partials in the order given, adds the DP noise
(once) and divides; ``aggregate`` is exactly ``combine([partial(shard) for shard in shards(inputs, shard_size,
workers)])``, so a chord running the same shards gives the same bytes as one worker.

A key no delta carries (lora_A of FFA-layout deltas) is left out of the sums: it stays zero and gets no DP
noise.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import (
    Strategy,
    check_headers,
    check_inputs,
    check_spec,
    is_lora_a,
    shards,
)
from .dp import add_gaussian_noise, parse_dp
from .flat import (
    CoordinateOrder,
    KeyWriter,
    assemble_spans,
    flat_clip_factors,
    flat_weighted_sum,
    open_flat,
    spec_spans,
)


def _all_finite(value: torch.Tensor) -> bool:
    """Whether every value is finite: its sum is finite only if they are (a NaN or an infinity makes it NaN or
    infinite), a pass over the values where ``isfinite`` writes a mask and reads it again (a tenth of the time);
    a sum that overflowed with finite values is told apart by the mask."""
    return math.isfinite(float(value.sum())) or bool(torch.isfinite(value).all())


class MeanStrategy(Strategy):
    shardable = True  # with DP: shards of deltas (``partial``, ``combine``)
    shardable_by_coordinates = True  # without DP: coordinate spans (``span_partial``, ``assemble``)
    supports_dp = True

    def by_coordinates(self, params) -> bool:
        return parse_dp(self.check_params(params).get("dp")) is None

    def weight(self, inp) -> float:
        """The input's weight without DP."""
        return float(inp.num_samples)

    def dp_weight(self, inp) -> float:
        """The input's weight under DP: at most 1, so one delta moves the sum by at most the clip."""
        return 1.0

    def summed_keys(self, shapes: dict) -> list[str]:
        return list(shapes)

    def check_extra(self, reader) -> None:
        pass

    def check_extra_all(self, inputs, shapes) -> None:
        """More checks a strategy makes on every delta (``check_extra`` on each, one file open at a time)."""

    def _weighted(self, inputs, spec, params):
        """What a weighted sum of ``inputs`` needs: ``(order, deltas, keys, weights, scaled)``: the coordinate
        order, every delta checked and cut (``open_flat``), the summed keys some delta carries, each input's
        weight, and that weight times its clipping factor."""
        params = self.check_params(params)
        shapes = check_spec(spec)
        inputs = check_inputs(inputs)
        dp = parse_dp(params.get("dp"))
        order, deltas = open_flat(inputs, shapes)
        self.check_extra_all(inputs, shapes)
        keys = [key for key in self.summed_keys(shapes) if any(key in delta.keys for delta in deltas)]
        clip = params["clip_norm"]
        if dp is not None:
            clip = dp.clip if clip is None else min(clip, dp.clip)
        factors = flat_clip_factors(inputs, deltas, clip, recompute=dp is not None)
        weights = [self.dp_weight(inp) if dp is not None else self.weight(inp) for inp in inputs]
        return order, deltas, keys, weights, [w * c for w, c in zip(weights, factors, strict=True)]

    def spans(self, inputs, *, spec, params) -> list[tuple[int, int]]:
        """A round's coordinate spans: one per aggregation worker (``workers``), each as much work as another."""
        return spec_spans(spec, self.check_params(params)["workers"])

    def span_partial(self, inputs, *, spec, params, span, gram=None) -> torch.Tensor:
        """The mean's values over coordinates ``span`` (float32; a chord task's part): the span's weighted sums
        of every input in order, in float64, divided by the total weight; zero where no delta carries the key or
        the strategy does not average it. Rounds with DP are split by deltas (``partial``), not here."""
        parts: list[np.ndarray] = []  # made once the span is checked: one array of the span's length

        def write(at: int, block: np.ndarray) -> None:
            if not parts:
                parts.append(np.empty(span[1] - span[0], dtype=np.float32))
            parts[0][at - span[0] : at - span[0] + len(block)] = block

        self._mean_blocks(inputs, spec, params, span, write)
        return torch.from_numpy(parts[0]) if parts else torch.empty(0, dtype=torch.float32)

    def _mean_blocks(self, inputs, spec, params, span, write) -> None:
        """``span_partial``'s values a block at a time, ``write(first coordinate, float64 values)`` (rounded to
        float32 by the writer, as torch's ``to`` rounds): each block's float64 sums, zeroed where the key is not
        averaged, divided by the total weight. The same arithmetic per coordinate whatever the span and the
        block, so a chord's spans and one worker's whole give the same bytes."""
        if not self.by_coordinates(params):
            raise ValueError(f"{self.name} with server-side DP is split by shards of deltas, not by coordinates")
        order, deltas, keys, weights, scaled = self._weighted(inputs, spec, params)
        first, last = span
        if not 0 <= first <= last <= order.total:
            raise ValueError(f"span {list(span)} is not within the adapter's {order.total} coordinates")
        averaged = set(keys)
        zeroed = [  # nothing to average: zero, as a key left out of the sums is
            (order.starts[key], order.starts[key] + math.prod(order.shapes[key]))
            for key in order.keys
            if key not in averaged
        ]
        total = math.fsum(weights)

        def finish(at: int, block: np.ndarray) -> None:
            for start, stop in zeroed:
                low, high = max(at, start), min(at + len(block), stop)
                if low < high:
                    block[low - at : high - at] = 0.0
            np.divide(block, total, out=block)
            write(at, block)

        flat_weighted_sum(deltas, scaled, (first, last), finish=finish)

    def assemble(self, parts, *, spec, inputs) -> dict[str, torch.Tensor]:
        """The mean from its spans' values, in span order."""
        return assemble_spans(parts, spec=spec, inputs=inputs)

    def partial(self, inputs, *, spec, base, params) -> tuple[dict[str, torch.Tensor], float]:
        """``(weighted sum in float64 per summed key, total weight)`` of one shard."""
        order, deltas, keys, weights, scaled = self._weighted(inputs, spec, params)
        flat = torch.from_numpy(flat_weighted_sum(deltas, scaled))
        return order.split(flat, keys), math.fsum(weights)

    def combine(self, partials, *, spec, base, params) -> dict[str, torch.Tensor]:
        """The aggregated delta from shard partials (a list, or any iterable), added in the order given."""
        return self._combine(partials, spec=spec, params=params, finite_checked=False)

    def _combine(self, partials, *, spec, params, finite_checked: bool) -> dict[str, torch.Tensor]:
        """``combine``; ``finite_checked``: the partials are this process's own ``partial``s, whose sums were
        checked finite as they were made (partials from elsewhere, a chord's blobs, are checked here)."""
        params = self.check_params(params)
        shapes = check_spec(spec)
        dp = parse_dp(params.get("dp"))
        summable = set(self.summed_keys(shapes))
        required = [key for key in summable if not is_lora_a(key)]
        if isinstance(partials, dict | str | bytes | torch.Tensor):
            raise ValueError("combine needs a sequence of (sums, weight) partials")
        total: dict[str, torch.Tensor] = {}
        weight, count = 0.0, 0
        for index, item in enumerate(partials):
            count += 1
            if not isinstance(item, list | tuple) or len(item) != 2 or not isinstance(item[0], dict):
                raise ValueError(f"partial #{index} must be (sums, weight)")
            sums, part_weight = item
            strange = sorted(set(sums) - summable)
            lacking = [key for key in required if key not in sums]
            if strange or lacking:
                raise ValueError(f"partial #{index}: unexpected keys {strange[:3]}, missing keys {lacking[:3]}")
            if isinstance(part_weight, bool) or not isinstance(part_weight, int | float):
                raise ValueError(f"partial #{index}'s weight must be a number")
            if not math.isfinite(part_weight) or part_weight <= 0:
                raise ValueError(f"partial #{index}'s weight must be finite and > 0, not {part_weight!r}")
            for key, value in sums.items():
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != shapes[key]:
                    raise ValueError(f"partial #{index}: {key!r} is not a tensor of shape {list(shapes[key])}")
                if not finite_checked and not _all_finite(value):
                    raise ValueError(f"partial #{index}: {key!r} holds NaN or infinite values")
                if key not in total:  # 0.0 + the first partial, as a zeroed total plus it was: the same bytes
                    total[key] = value.to(torch.float64) + 0.0  # (-0.0 too), one pass where zeroing took two
                else:
                    total[key].add_(value.to(torch.float64))
            weight += float(part_weight)
        if not count:
            raise ValueError("combine needs at least one partial sum")
        if dp is not None:
            add_gaussian_noise(total, list(total), dp)  # the released keys: those some delta carries
        out = {}
        for key, shape in shapes.items():
            out[key] = total[key].div_(weight).to(torch.float32) if key in total else torch.zeros(shape)
        return out

    def aggregate(self, inputs, *, spec, base, params) -> dict[str, torch.Tensor]:
        checked = self.check_params(params)
        if self.by_coordinates(checked):  # one span of every coordinate: each the arithmetic of a chord's span
            (everything,) = spec_spans(spec, 1)
            writer = KeyWriter(CoordinateOrder.of(check_spec(spec), check_inputs(inputs)[0].path))
            self._mean_blocks(inputs, spec, params, everything, writer.write)  # straight into each key's tensor
            return writer.out
        # A generator: combine folds each shard's partial into its total before the next is computed, so
        # memory stays O(model) however many shards there are; the arithmetic is the chord's, in order.
        parts = (
            self.partial(shard, spec=spec, base=base, params=params)
            for shard in shards(check_inputs(inputs), checked["shard_size"], checked["workers"])
        )
        return self._combine(parts, spec=spec, params=params, finite_checked=True)


class FedAvg(MeanStrategy):
    """Sample-weighted mean of the deltas."""

    name = "fedavg"


class FedBuff(MeanStrategy):
    """FedAvg over a buffer of asynchronous deltas, each discounted by ``1 / sqrt(1 + staleness)``."""

    name = "fedbuff"

    def weight(self, inp) -> float:
        return inp.num_samples / math.sqrt(1 + inp.staleness)

    def dp_weight(self, inp) -> float:  # the staleness discount alone: <= 1, so the sensitivity stays C
        return 1.0 / math.sqrt(1 + inp.staleness)


class FfaLora(MeanStrategy):
    """FFA-LoRA: A is frozen and shared, so only B (and the saved modules) are averaged, and the mean of the
    B deltas is exactly the update a centralised run would make to B. A keys of the result are zero; a
    delta that changes A is refused."""

    name = "ffa_lora"

    def summed_keys(self, shapes: dict) -> list[str]:
        return [key for key in shapes if not is_lora_a(key)]

    def check_extra_all(self, inputs, shapes) -> None:
        check_headers(inputs, shapes, extra=self.check_extra)

    def check_extra(self, reader) -> None:
        for key in reader.names():
            if is_lora_a(key) and bool(torch.count_nonzero(reader.read(key))):
                raise ValueError(f"{reader.label} changes the frozen {key!r}: ffa_lora deltas must leave lora_A as is")
