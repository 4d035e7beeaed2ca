"""The compiled loops (training/federation/strategies/sum_kernel.c) against numpy: the weighted sum the same bytes
compiled or not, whatever the blocks; the sum of squares exact; every argument they cannot read refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import training.federation.strategies.flat as strategies_flat
from tests.training.strategy_support import SPEC, P, assert_same, decoded, make_inputs, run, weighted_reference, write
from training.federation.strategies import DeltaInput
from training.federation.strategies.kernels import sum_kernel


def test_the_weighted_sum_is_the_same_bytes_compiled_or_not_whatever_the_blocks_and_a_bad_value_is_named(
    tmp_path, monkeypatch
):
    # The compiled loop (sum_kernel.c; the install builds it: four deltas a pass) and numpy's multiply then add
    # (one at a time), in blocks of 64 coordinates and in the default blocks: each element rounded the same way,
    # so the same bytes.
    assert sum_kernel is not None, "training/federation/strategies/sum_kernel.c was not built (make install)"
    inputs = make_inputs(tmp_path, 5, samples=[3, 1, 4, 1, 5])
    compiled = run("fedavg", inputs)
    monkeypatch.setattr(strategies_flat, "SUM_COLUMNS", 64)
    small = run("fedavg", inputs)
    monkeypatch.setattr(strategies_flat, "sum_kernel", None)
    numpy_small = run("fedavg", inputs)
    monkeypatch.undo()
    monkeypatch.setattr(strategies_flat, "sum_kernel", None)
    numpy_whole = run("fedavg", inputs)
    for other in (small, numpy_small, numpy_whole):
        assert all(torch.equal(compiled[k], other[k]) for k in SPEC)
    assert_same(compiled, weighted_reference(inputs, [3, 1, 4, 1, 5]))
    # Values are checked on each block's sums; a NaN in a later block of a later delta is still named.
    monkeypatch.undo()
    monkeypatch.setattr(strategies_flat, "SUM_COLUMNS", 64)
    tensors = decoded(inputs[3].path)
    tensors[f"{P}head.weight"][4, 9] = float("nan")  # the last coordinate: the last block
    bad = DeltaInput(write(tmp_path, "late-nan", tensors), 1)
    for kernel in (sum_kernel, None):
        monkeypatch.setattr(strategies_flat, "sum_kernel", kernel)
        with pytest.raises(ValueError, match=rf"delta #3 .*'{P}head.weight' holds NaN or infinite values"):
            run("fedavg", [*inputs[:3], bad, inputs[4]])


def test_the_compiled_loops_compute_as_numpy_and_refuse_what_they_cannot_read():
    rng = np.random.default_rng(5)
    for count in (0, 1, 7, 8, 9, 1000, 4099):  # the vector loop's tail included
        for deltas in (1, 2, 3, 4):  # one pass over the sums adds as each delta in turn
            sums = rng.standard_normal(count)
            values = [(rng.standard_normal(count) * 1e3).astype(np.float32) for _ in range(deltas)]
            weights = [float(rng.random()) / 7 for _ in range(deltas)]
            compiled, one_by_one, numpy_ = sums.copy(), sums.copy(), sums.copy()
            sum_kernel.add_weighted(compiled, values, weights)
            for value, weight in zip(values, weights, strict=True):
                sum_kernel.add_weighted(one_by_one, [value], [weight])
            strategies_flat.add_weighted_numpy(numpy_, values, weights, np.empty(count))
            assert np.array_equal(compiled, numpy_) and np.array_equal(one_by_one, numpy_)
        exact = math.fsum(float(v) * float(v) for v in values[0])  # each square exact in float64
        assert sum_kernel.squares(values[0]) == pytest.approx(exact, rel=1e-13, abs=0)
    values = np.ones(16, dtype=np.float32)
    values[11] = np.nan
    assert math.isnan(sum_kernel.squares(values))
    values[11] = 3e38  # its square is past float32's range, not float64's
    assert sum_kernel.squares(values) == pytest.approx(15 + 9e76)
    read_only = np.zeros(4)
    read_only.flags.writeable = False
    f32 = np.zeros(4, np.float32)
    for args, message in [
        ((np.zeros(4, np.float32), [f32], [1.0]), "sums must be contiguous aligned float64"),
        ((np.zeros(4), [np.zeros(4)], [1.0]), "values must be contiguous aligned float32"),
        ((np.zeros(4), [f32, np.zeros(5, np.float32)], [1.0, 1.0]), "as many items"),
        ((np.zeros(8)[::2], [f32], [1.0]), "not C-contiguous"),
        ((read_only, [f32], [1.0]), "read-only"),
        ((np.zeros(4), [np.frombuffer(bytes(20), np.float32, 4, 1)], [1.0]), "aligned"),
        ((np.zeros(4), [], []), "1 to 4 arrays"),
        ((np.zeros(4), [f32] * 5, [1.0] * 5), "1 to 4 arrays"),
        ((np.zeros(4), [f32, f32], [1.0]), "as many"),
    ]:
        with pytest.raises(ValueError, match=message):
            sum_kernel.add_weighted(*args)
    for args in [(np.zeros(4), [f32], ["1"]), (np.zeros(4), [f32], 1.0), (np.zeros(4), [1.0], [1.0])]:
        with pytest.raises(TypeError):
            sum_kernel.add_weighted(*args)
    with pytest.raises(ValueError, match="float32"):
        sum_kernel.squares(np.zeros(4))
