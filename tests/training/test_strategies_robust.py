"""Robust strategies (median, trimmed mean, Krum, Multi-Krum) and norm clipping against plain references, in
many chunks as on the server."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import training.federation.strategies.coordinate_rows as coordinate_rows
import training.federation.strategies.robust as strategies_robust
from tests.training.strategy_support import (
    SPEC,
    assert_same,
    decoded,
    make_inputs,
    norm_of,
    rand_tensors,
    run,
    weighted_reference,
    write,
)
from training.federation.strategies import DeltaInput, get_strategy
from training.federation.strategies.flat import CoordinateOrder, FlatDelta, open_flat


def stacked_reference(inputs, factors=None):
    deltas = [decoded(inp.path) for inp in inputs]
    factors = factors or [1.0] * len(inputs)
    return {k: torch.stack([d[k] * f for d, f in zip(deltas, factors, strict=True)]) for k in SPEC}


def test_the_coordinate_order_follows_the_first_file_and_covers_every_coordinate_once(tmp_path):
    """Every coordinate of the spec has one place (in the order of the first delta's bytes, then the keys it
    lacks); reading a delta flat gives each tensor back where the order says, whatever its own file's order."""
    shapes = {k: tuple(v["shape"]) for k, v in SPEC.items()} | {"scalar": (), "empty": (0, 3)}
    tensors = rand_tensors(torch.Generator().manual_seed(5)) | {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    first = write(tmp_path, "first", tensors)
    order = CoordinateOrder.of(shapes, first)
    assert order.total == sum(math.prod(shape) for shape in shapes.values())
    assert sorted(order.keys) == sorted(k for k, shape in shapes.items() if math.prod(shape))
    covered = torch.zeros(order.total, dtype=torch.int64)
    for key in order.keys:
        covered[order.starts[key] : order.starts[key] + math.prod(shapes[key])] += 1
    assert bool((covered == 1).all())
    # a delta whose file lacks a key (as an FFA delta lacks lora_A) reads it as zeros, the rest in place
    lacking = next(k for k in SPEC if ".lora_A." in k)
    other = write(tmp_path, "other", {k: v for k, v in tensors.items() if k != lacking})
    flat = np.empty(order.total, dtype=np.float32)
    FlatDelta(DeltaInput(other, 1), 0, order).read(0, order.total, flat)
    for key, value in order.split(flat).items():
        want = torch.zeros(shapes[key]) if key == lacking else tensors[key].float()
        assert torch.equal(torch.from_numpy(np.array(value)), want), key


def test_deltas_with_one_header_share_their_pieces_and_one_with_another_reads_its_own(tmp_path):
    """A round checks and cuts a header once: deltas that share it share their keys and pieces; a delta with
    another header (here lacking a tensor, as an FFA delta lacks lora_A) gets its own, and each reads its values."""
    shapes = {k: tuple(v["shape"]) for k, v in SPEC.items()}
    gen = torch.Generator().manual_seed(9)
    same = [rand_tensors(gen) for _ in range(3)]
    paths = [write(tmp_path, f"same{i}", tensors) for i, tensors in enumerate(same)]
    lacking = next(k for k in SPEC if ".lora_A." in k)
    other = {k: v for k, v in rand_tensors(gen).items() if k != lacking}
    paths.append(write(tmp_path, "other", other))
    order, deltas = open_flat([DeltaInput(path, 1) for path in paths], shapes)
    assert deltas[1].pieces is deltas[0].pieces and deltas[2].pieces is deltas[0].pieces
    assert deltas[3].pieces is not deltas[0].pieces and lacking not in deltas[3].keys
    flat = np.empty(order.total, dtype=np.float32)
    for delta, tensors in zip(deltas, [*same, other], strict=True):
        delta.read(0, order.total, flat)
        for key, value in order.split(flat).items():
            want = tensors[key].float() if key in tensors else torch.zeros(shapes[key])
            assert torch.equal(torch.from_numpy(np.array(value)), want), key


@pytest.mark.parametrize(("n", "c"), [(1, 5), (7, 4097), (205, 9000), (100, 8192)])
def test_the_tiled_transposition_is_the_transpose(n, c):
    values = torch.randn(n, c, generator=torch.Generator().manual_seed(n))
    out = torch.full((c, n), float("nan"))
    coordinate_rows.transpose_into(out, values)
    assert torch.equal(out, values.T)


@pytest.mark.parametrize("n", [7, 8])
@pytest.mark.parametrize("sort_up_to", [256, 0])  # rows sorted, or (an odd N above it) the middle selected
def test_median_in_many_chunks_equals_the_reference(tmp_path, monkeypatch, n, sort_up_to):
    monkeypatch.setattr(strategies_robust.Median, "SORT_UP_TO", sort_up_to)
    inputs = make_inputs(tmp_path, n, encoding="f16")
    got = run("median", inputs, {"chunk_elements": 7})
    for key, stacked in stacked_reference(inputs).items():
        if n % 2:
            want = torch.median(stacked, dim=0).values
        else:  # the statistical median: mean of the two middle values
            ordered = stacked.sort(dim=0).values
            want = ((ordered[n // 2 - 1].double() + ordered[n // 2].double()) / 2).float()
        assert torch.equal(got[key], want), key


@pytest.mark.parametrize("name", ["median", "trimmed_mean"])
def test_blocks_laid_side_by_side_in_small_parts_give_the_same_bytes(tmp_path, monkeypatch, name):
    # Parts of 64 coordinates (the least), several to a block of 150 and one short part at each block's end;
    # tiles of 3 deltas by 16 coordinates, several to a part: the same values as whole blocks laid out at once.
    inputs = make_inputs(tmp_path, 9)
    whole = run(name, inputs, {"chunk_elements": 1 << 20})
    monkeypatch.setattr(coordinate_rows, "SIDE_BY_SIDE_BYTES", 1)
    monkeypatch.setattr(coordinate_rows, "TILE_ROWS", 3)
    monkeypatch.setattr(coordinate_rows, "TILE_COLUMNS", 16)
    assert coordinate_rows.side_by_side(9) == 64
    parts = run(name, inputs, {"chunk_elements": 150})
    assert whole.keys() == parts.keys()
    for key in whole:
        assert torch.equal(whole[key], parts[key]), key


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.2, 0.45])
def test_trimmed_mean_in_many_chunks_equals_sorted_trimming(tmp_path, monkeypatch, ratio):
    inputs = make_inputs(tmp_path, 10, encoding="int8")
    got = run("trimmed_mean", inputs, {"chunk_elements": 5, "trim_ratio": ratio})
    cut = int(ratio * 10)
    for key, stacked in stacked_reference(inputs).items():
        kept = stacked.sort(dim=0).values[cut : 10 - cut]
        torch.testing.assert_close(got[key], kept.double().mean(0).float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n", [2, 3, 8, 11])
def test_order_statistics_read_across_sorted_halves_are_a_whole_sort_s(n):
    # Values from a few integers: many ties, within a half and across the two.
    rng = np.random.default_rng(n)
    rows = rng.integers(-3, 4, size=(500, n)).astype(np.float32)
    rows[::7] = rng.standard_normal((len(rows[::7]), n)).astype(np.float32)
    ordered = np.sort(rows, axis=1)
    for k in range(1, n):
        lower, upper = coordinate_rows.SortedHalves(rows.copy()).around(k)
        assert np.array_equal(lower, ordered[:, k - 1]) and np.array_equal(upper, ordered[:, k]), k
    for cut in range((n + 1) // 2):
        got = coordinate_rows.SortedHalves(rows.copy()).middle_sum(cut)
        np.testing.assert_allclose(got, ordered[:, cut : n - cut].sum(axis=1, dtype=np.float64), rtol=1e-12, atol=1e-6)


@pytest.mark.parametrize("n", [7, 8])
def test_a_median_of_rows_sorted_in_halves_equals_the_reference(tmp_path, monkeypatch, n):
    # Rows longer than SORTED_RUN (made 3 here, 513 deltas and up in a round) are sorted as two halves: the same bytes.
    monkeypatch.setattr(coordinate_rows, "SORTED_RUN", 3)
    inputs = make_inputs(tmp_path, n, encoding="f16")
    got = run("median", inputs, {"chunk_elements": 7})
    for key, stacked in stacked_reference(inputs).items():
        ordered = stacked.sort(dim=0).values
        middle = ordered[n // 2]  # for an even N, the mean of the two middle values
        want = middle if n % 2 else ((ordered[n // 2 - 1].double() + middle.double()) / 2).float()
        assert torch.equal(got[key], want), key


@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.45])
def test_a_trimmed_mean_of_rows_sorted_in_halves_equals_sorted_trimming_and_cuts_huge_values(
    tmp_path, monkeypatch, ratio
):
    monkeypatch.setattr(coordinate_rows, "SORTED_RUN", 3)
    inputs = make_inputs(tmp_path, 10, encoding="int8")
    # One delta far above every other at every coordinate, one far below: the least cut (one a side) drops both.
    huge = rand_tensors(torch.Generator().manual_seed(1))
    inputs[2] = DeltaInput(write(tmp_path, "above", {k: v.abs() * 1e30 + 1e30 for k, v in huge.items()}), 1)
    inputs[7] = DeltaInput(write(tmp_path, "below", {k: -v.abs() * 1e30 - 1e30 for k, v in huge.items()}), 1)
    got = run("trimmed_mean", inputs, {"chunk_elements": 5, "trim_ratio": ratio})
    cut = int(ratio * 10)
    for key, stacked in stacked_reference(inputs).items():
        kept = stacked.sort(dim=0).values[cut : 10 - cut]
        torch.testing.assert_close(got[key], kept.double().mean(0).float(), rtol=1e-6, atol=1e-7)
        assert float(got[key].abs().max()) < 10, key


def test_trimmed_mean_defaults_to_ten_percent_and_resists_an_outlier(tmp_path):
    inputs = make_inputs(tmp_path, 10)
    inputs[3] = DeltaInput(write(tmp_path, "huge", rand_tensors(torch.Generator(), scale=1e6)), 1)
    got = run("trimmed_mean", inputs, {"chunk_elements": 64})
    for key, stacked in stacked_reference(inputs).items():
        torch.testing.assert_close(got[key], stacked.sort(0).values[1:9].double().mean(0).float())
        assert float(got[key].abs().max()) < 10


def test_robust_strategies_clip_the_slices(tmp_path):
    inputs = make_inputs(tmp_path, 5, scale=3.0)
    norms = [norm_of(inp.path) for inp in inputs]
    factors = [min(1.0, 20.0 / n) for n in norms]
    assert min(factors) < 1
    got = run("median", inputs, {"clip_norm": 20.0, "chunk_elements": 16})
    for key, stacked in stacked_reference(inputs, factors).items():
        torch.testing.assert_close(got[key], torch.median(stacked, dim=0).values)


# -- krum ------------------------------------------------------------------------------------------------


def krum_inputs(tmp_path, honest=7, outliers=2):
    gen = torch.Generator().manual_seed(9)
    center = rand_tensors(gen)
    inputs = []
    for i in range(honest):
        noise = rand_tensors(gen, scale=0.05 * (1 + i % 3))
        inputs.append(DeltaInput(write(tmp_path, f"h{i}", {k: center[k] + noise[k] for k in SPEC}), 10 + i))
    for i in range(outliers):
        inputs.insert(2 * i, DeltaInput(write(tmp_path, f"o{i}", rand_tensors(gen, scale=50.0)), 1000))
    return inputs


def brute_force_scores(inputs, f):
    flat = [torch.cat([t.double().reshape(-1) for t in decoded(inp.path).values()]) for inp in inputs]
    n = len(flat)
    scores = []
    for i in range(n):
        dists = sorted(float(((flat[i] - flat[j]) ** 2).sum()) for j in range(n) if j != i)
        scores.append(sum(dists[: n - f - 2]))
    return scores


def test_krum_picks_the_most_central_honest_delta(tmp_path, monkeypatch):
    inputs = krum_inputs(tmp_path)
    scores = brute_force_scores(inputs, f=3)  # default f = floor((9 - 3) / 2)
    best = min(range(len(inputs)), key=lambda i: scores[i])
    assert best not in (0, 2)  # not an outlier
    got = run("krum", inputs, {"chunk_elements": 9})
    assert_same(got, decoded(inputs[best].path), rtol=0, atol=0)


def test_multi_krum_averages_the_m_best(tmp_path):
    inputs = krum_inputs(tmp_path)
    scores = brute_force_scores(inputs, f=2)
    chosen = sorted(range(len(inputs)), key=lambda i: (scores[i], i))[:5]
    assert not {0, 2} & set(chosen)
    got = run("multi_krum", inputs, {"byzantine": 2, "multi_k": 5, "chunk_elements": 13})
    picked = [inputs[i] for i in chosen]
    assert_same(got, weighted_reference(picked, [inp.num_samples for inp in picked]))
    # default m = N - f, f clamped: 3 deltas allow f = 0, so multi_krum averages all of them
    few = krum_inputs(tmp_path, honest=3, outliers=0)
    assert_same(run("multi_krum", few, {"byzantine": 5}), weighted_reference(few, [10, 11, 12]))
    assert_same(run("krum", few[:1]), decoded(few[0].path), rtol=0, atol=0)
    with pytest.raises(ValueError, match="multi_k must be a whole number >= 1"):
        run("multi_krum", few, {"multi_k": 0})


# -- nearest-neighbour mixing ------------------------------------------------------------------------


def flat_of(inputs, factors=None):
    factors = factors or [1.0] * len(inputs)
    rows = []
    for inp, factor in zip(inputs, factors, strict=True):
        tensors = decoded(inp.path)
        rows.append(torch.cat([tensors[key].double().reshape(-1) for key in SPEC]) * factor)
    return torch.stack(rows)


def mixed_reference(flat, f):
    """Each row replaced by the mean of the N - f rows nearest to it, itself included (brute force)."""
    n = flat.shape[0]
    rows = []
    for i in range(n):
        dists = [(0 if j == i else 1, float(((flat[i] - flat[j]) ** 2).sum()), j) for j in range(n)]
        nearest = [j for _, _, j in sorted(dists)[: n - f]]
        rows.append(flat[nearest].mean(0))
    return torch.stack(rows)


def unflat(vector):
    out, position = {}, 0
    for key, entry in SPEC.items():
        size = math.prod(entry["shape"])
        out[key] = vector[position : position + size].reshape(entry["shape"]).float()
        position += size
    return out


@pytest.mark.parametrize(("name", "reduce"), [("median", "median"), ("trimmed_mean", "trimmed")])
def test_mixing_runs_the_coordinate_rule_on_each_delta_s_nearest_mean(tmp_path, monkeypatch, name, reduce):
    inputs = make_inputs(tmp_path, 9, scale=2.0)
    factors = [min(1.0, 15.0 / norm_of(inp.path)) for inp in inputs]
    assert min(factors) < 1  # clipping comes before mixing
    mixed = mixed_reference(flat_of(inputs, factors), f=2).float()
    params = {"mixing": "nnm", "byzantine": 2, "clip_norm": 15.0, "chunk_elements": 7, "trim_ratio": 0.2}
    got = run(name, inputs, params)
    want = mixed.median(dim=0).values if reduce == "median" else mixed.sort(dim=0).values[1:8].double().mean(0)
    assert_same(got, unflat(want.double()), rtol=1e-5, atol=1e-6)
    key = next(iter(SPEC))
    assert not torch.equal(got[key], run(name, inputs, {**params, "mixing": None})[key])


def test_with_mixing_a_median_of_honest_deltas_and_two_outliers_is_the_honest_mean(tmp_path):
    inputs = krum_inputs(tmp_path)  # 7 honest around one point, 2 far outliers
    honest = [inp for index, inp in enumerate(inputs) if index not in (0, 2)]
    got = run("median", inputs, {"mixing": "nnm", "byzantine": 2, "chunk_elements": 11})
    # each honest delta's 7 nearest are the 7 honest ones: 7 of the 9 mixed deltas are their mean
    assert_same(got, weighted_reference(honest, [1] * 7), rtol=1e-5, atol=1e-6)


def krum_order(rows, f):
    """Rows ranked by Krum's score (brute force over the given vectors)."""
    n = len(rows)
    scores = []
    for i in range(n):
        dists = sorted(float(((rows[i] - rows[j]) ** 2).sum()) for j in range(n) if j != i)
        scores.append(sum(dists[: n - f - 2]))
    return sorted(range(n), key=lambda i: (scores[i], i))


def test_krum_with_mixing_picks_among_the_mixed_deltas_without_reading_them_again(tmp_path, monkeypatch):
    inputs = make_inputs(tmp_path, 9, seed=1)  # a case where the mixed deltas' ranking is not the originals'
    reads = []
    real_gather = strategies_robust.gather
    monkeypatch.setattr(
        strategies_robust,
        "gather",
        lambda deltas, start, stop, *a: reads.append(stop - start) or real_gather(deltas, start, stop, *a),
    )
    mixed = mixed_reference(flat_of(inputs), f=2)
    order = krum_order(mixed, f=2)
    assert order[0] != krum_order(flat_of(inputs), f=2)[0]
    got = run("krum", inputs, {"mixing": "nnm", "byzantine": 2, "chunk_elements": 10**6})
    # one pass for the Gram matrix (every coordinate once, span by span); the result is a weighted sum of the
    # originals
    assert sum(reads) == sum(math.prod(v["shape"]) for v in SPEC.values())
    assert_same(got, unflat(mixed[order[0]]), rtol=1e-5, atol=1e-6)
    # Multi-Krum on clipped deltas: clipped, then mixed, then the best 4 mixed ones weighted by their samples
    factors = [min(1.0, 12.0 / norm_of(inp.path)) for inp in inputs]
    assert min(factors) < 1
    mixed = mixed_reference(flat_of(inputs, factors), f=2)
    best = krum_order(mixed, f=2)[:4]
    weights = torch.tensor([float(inputs[i].num_samples) for i in best], dtype=torch.float64)
    want = (mixed[best] * weights[:, None]).sum(0) / weights.sum()
    got = run("multi_krum", inputs, {"mixing": "nnm", "byzantine": 2, "multi_k": 4, "clip_norm": 12.0})
    assert_same(got, unflat(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("n", "attackers"), [(3, 1), (4, 1), (6, 2)])
@pytest.mark.parametrize("name", ["median", "trimmed_mean", "krum", "multi_krum"])
def test_mixing_keeps_a_small_round_s_attackers_out_while_honest_devices_are_a_majority(tmp_path, n, attackers, name):
    """Mixing's f is capped by N > 2f, not by Krum's N >= 2f + 3: with 1 attacker of 3 or 4 and 2 of 6 the
    honest neighbourhoods hold no attacker, and every rule returns the honest deltas' mean."""
    gen = torch.Generator().manual_seed(4)
    center = rand_tensors(gen)
    honest = [
        DeltaInput(write(tmp_path, f"h{i}", {k: center[k] + rand_tensors(gen, scale=0.01)[k] for k in SPEC}), 5)
        for i in range(n - attackers)
    ]
    bad = [DeltaInput(write(tmp_path, f"a{i}", {k: -1000 * center[k] for k in SPEC}), 5) for i in range(attackers)]
    # trimmed mean trims one per side per attacker; Multi-Krum keeps the N - attackers best (its own f is
    # clamped by N >= 2f + 3, and would keep them all)
    params = {"mixing": "nnm", "byzantine": attackers, "trim_ratio": 0.34, "multi_k": n - attackers}
    got = run(name, bad + honest, params)
    assert_same(got, weighted_reference(honest, [1] * len(honest)), rtol=1e-4, atol=1e-5)
    assert float(run(name, bad + honest, {**params, "byzantine": None})[next(iter(SPEC))].abs().max()) < 10


def test_mixing_takes_only_nnm(tmp_path):
    inputs = make_inputs(tmp_path, 3)
    for bad in ("NNM", "bucketing", 1, True):
        with pytest.raises(ValueError, match='mixing must be null or "nnm"'):
            run("median", inputs, {"mixing": bad})


# -- clipping and DP -------------------------------------------------------------------------------------


def test_clipping_scales_each_delta_before_averaging(tmp_path):
    inputs = make_inputs(tmp_path, 4, scale=2.0)
    norms = [norm_of(inp.path) for inp in inputs]
    clip = sorted(norms)[1]
    factors = [min(1.0, clip / n) for n in norms]
    want = weighted_reference(inputs, [inp.num_samples for inp in inputs], factors=factors)
    assert_same(run("fedavg", inputs, {"clip_norm": clip}), want)  # norms computed lazily
    given = [DeltaInput(inp.path, inp.num_samples, norm=n) for inp, n in zip(inputs, norms, strict=True)]
    assert_same(run("fedavg", given, {"clip_norm": clip, "shard_size": 1}), want)


@pytest.mark.parametrize("name", ["median", "trimmed_mean"])
@pytest.mark.parametrize(("n", "total"), [(100, 1 << 20), (1000, 1 << 20), (100, 10 << 20)])
def test_blocks_leave_room_in_the_memory_budget_for_the_result(name, n, total):
    strategy = get_strategy(name)
    params = strategy.check_params({"chunk_elements": 1 << 30})
    budget = params["memory_budget"]
    for per_value in (strategy.BLOCK_BYTES, strategy.MIXING_BLOCK_BYTES):
        columns = strategy.columns(n, params, per_value, total)
        used = columns * n * per_value + strategy.RESULT_BYTES * total + strategy.RESERVE_BYTES
        used += 4 * n * coordinate_rows.side_by_side(n)  # the part of a block laid side by side
        assert used <= budget
        # WORKING_BYTES whatever N is (memory flat in N), or as large as the budget holds where that is less
        room = min(strategy.WORKING_BYTES, budget - (used - columns * n * per_value))
        assert room - n * per_value < columns * n * per_value <= room


@pytest.mark.parametrize("name", ["median", "trimmed_mean"])
def test_blocks_hold_the_same_bytes_whatever_n_is_and_a_small_budget_binds(name):
    strategy = get_strategy(name)
    params = strategy.check_params({"chunk_elements": 1 << 30})
    held = [strategy.columns(n, params, strategy.BLOCK_BYTES, 1 << 20) * n * strategy.BLOCK_BYTES for n in (100, 1000)]
    assert held[0] == pytest.approx(held[1], rel=1e-3)
    assert held[0] == pytest.approx(strategy.WORKING_BYTES, rel=1e-3)
    small = strategy.check_params({"chunk_elements": 1 << 30, "memory_budget": 64 << 20})
    columns = strategy.columns(1000, small, strategy.BLOCK_BYTES, 1 << 20)
    assert columns * 1000 * strategy.BLOCK_BYTES < (64 << 20) - strategy.set_aside(1000, 1 << 20) + 1
    assert columns * 1000 * strategy.BLOCK_BYTES < strategy.WORKING_BYTES // 2


def test_a_gram_pass_holds_the_same_bytes_whatever_n_is_and_a_small_budget_binds():
    """Krum's working memory: the gathered block plus the N x N matrices (GRAM_SQUARE_BYTES per pair) is
    GRAM_WORKING_BYTES at N = 100 and N = 1,000 (fewer columns for more deltas), within the column bounds, and
    less where a small memory budget holds less."""
    krum = get_strategy("krum")
    params = krum.check_params({"chunk_elements": 1 << 30})

    def held(n, given):
        return krum.gram_columns(n, given) * n * 4 + strategies_robust.GRAM_SQUARE_BYTES * n * n

    working = strategies_robust.GRAM_WORKING_BYTES
    for n in (100, 1000):
        columns = krum.gram_columns(n, params)
        assert strategies_robust.GRAM_MIN_COLUMNS <= columns <= strategies_robust.GRAM_COLUMNS
        assert working - 4 * n < held(n, params) <= working
    small = krum.check_params({"chunk_elements": 1 << 30, "memory_budget": 8 << 20})
    assert held(100, small) <= 8 << 20
    # past the N whose matrices alone fill the working bytes, the columns stop at the floor (the N x N grows)
    assert krum.gram_columns(2000, params) == strategies_robust.GRAM_MIN_COLUMNS
    assert krum.gram_columns(100, krum.check_params({"chunk_elements": 700})) == 700


def test_one_worker_s_gram_matrix_is_the_spans_parts_combined_bit_for_bit(tmp_path):
    """``gram`` (one worker, the spans' sums made in one reused matrix, products added through a float64 panel)
    gives the bytes the chord gives: each span's ``span_gram`` on its own, ``combine_grams`` in span order; and
    the panel's sums are the float32 products added whole in float64."""
    inputs = make_inputs(tmp_path, 70, seed=9)  # 70 rows: a whole panel of 64 and a part
    krum = get_strategy("krum")
    params, order, _, deltas, factors = krum.prepare(inputs, SPEC, {"chunk_elements": 7})
    spans = strategies_robust.coordinate_spans(order.total, 3)
    combined = krum.combine_grams(krum.span_gram(deltas, factors, params, span) for span in spans)
    assert torch.equal(krum.gram(deltas, factors, params, spans), combined)
    plain = torch.zeros(70, 70, dtype=torch.float64)
    for _, _, block in krum.blocks(deltas, factors, spans[0], 7):
        values = torch.from_numpy(block.copy())
        values.sub_(values.mean(dim=0, keepdim=True))
        plain += (values @ values.T).to(torch.float64)
    assert torch.equal(krum.span_gram(deltas, factors, params, spans[0]), plain)


def test_distances_written_over_the_gram_matrix_are_the_same_values():
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(40, 300, generator=gen, dtype=torch.float64)
    gram = rows @ rows.T
    fresh = strategies_robust.squared_distances(gram)
    kept = gram.clone()
    over = strategies_robust.squared_distances(gram, in_place=True)
    assert over.data_ptr() == gram.data_ptr() and torch.equal(over, fresh)
    assert torch.equal(strategies_robust.squared_distances(kept), fresh)  # not in place: the matrix is kept
    assert torch.allclose(fresh, torch.cdist(rows, rows) ** 2, rtol=1e-9, atol=1e-9)


def test_the_mixing_matrix_made_row_by_row_from_the_gram_matrix_is_the_whole_ranking_s():
    """Each row's N - f nearest (itself first, ties to the earlier input), its squared distances made from the
    Gram matrix as it is ranked, is what a stable sort of every distance at once gives, ties included; and Krum
    with mixing writes M G M^T over the Gram matrix with the same values."""
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(30, 40, generator=gen, dtype=torch.float64)
    rows[7] = rows[3]  # a tie: two deltas at the same distance from every other
    gram = rows @ rows.T
    for f in (0, 5, 14):
        keep = 30 - f
        ranked = strategies_robust.squared_distances(gram).fill_diagonal_(-1.0)
        nearest = torch.argsort(ranked, dim=1, stable=True)[:, :keep]
        want = torch.zeros(30, 30, dtype=torch.float64).scatter_(1, nearest, 1.0 / keep)
        assert torch.equal(strategies_robust.mixing_matrix(gram, f), want)
    mixing = strategies_robust.mixing_matrix(gram, 5)
    want = mixing @ gram @ mixing.T
    assert torch.equal(torch.mm(torch.mm(mixing, gram), mixing.T, out=gram), want)
