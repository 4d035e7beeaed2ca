"""Server-side differential privacy: clipping, the noise, where it is refused, and the accountant against
Opacus's own and against two accountants that share no code with it (the exact epsilon of the Gaussian
mechanism without sampling, and Opacus's numerical PRV accountant with sampling)."""

from __future__ import annotations

import math

import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant

from tests.training.strategy_support import (
    A_KEYS,
    P,
    assert_same,
    make_inputs,
    norm_of,
    run,
    weighted_reference,
    write,
)
from training.federation.strategies import DeltaInput
from training.federation.strategies.dp import dp_epsilon, epsilon_if_round_runs


def test_dp_clips_unweighted_and_recomputes_norms(tmp_path):
    inputs = make_inputs(tmp_path, 5, scale=2.0, samples=[1, 1000, 3, 4, 5])
    lying = [DeltaInput(inp.path, inp.num_samples, norm=1e-3) for inp in inputs]
    factors = [min(1.0, 5.0 / norm_of(inp.path)) for inp in inputs]
    want = weighted_reference(inputs, [1.0] * 5, factors=factors)
    dp = {"clip": 5.0, "noise_multiplier": 0.0, "seed": 1}
    assert_same(run("fedavg", lying, {"dp": dp}), want)
    ffa = make_inputs(tmp_path, 3, skip=A_KEYS, seed=7)
    assert_same(run("ffa_lora", ffa, {"dp": dp | {"clip": 1e9}}), weighted_reference(ffa, [1.0] * 3))
    noisy = run("ffa_lora", ffa, {"dp": dp | {"noise_multiplier": 1.0}})
    assert all(torch.count_nonzero(noisy[k]) == 0 for k in A_KEYS)  # no noise on the frozen A
    assert all(torch.count_nonzero(run("fedavg", ffa, {"dp": dp | {"noise_multiplier": 1.0}})[k]) == 0 for k in A_KEYS)


def test_dp_noise_has_std_z_c_over_n_and_is_deterministic(tmp_path):
    spec = {f"{P}big.lora_B.weight": {"shape": [200, 200], "dtype": "F32"}}
    zero = write(tmp_path, "zero", {k: torch.zeros(v["shape"]) for k, v in spec.items()})
    inputs = [DeltaInput(zero, 10 * (i + 1)) for i in range(4)]
    dp = {"clip": 2.0, "noise_multiplier": 1.5, "seed": 1234}
    first = run("fedavg", inputs, {"dp": dp}, spec=spec)
    values = next(iter(first.values())).double()
    assert abs(float(values.std()) - 1.5 * 2.0 / 4) < 0.02 * 0.75
    assert abs(float(values.mean())) < 0.01
    again = run("fedavg", inputs, {"dp": dp, "shard_size": 1}, spec=spec)
    assert all(torch.equal(first[k], again[k]) for k in spec)
    other = run("fedavg", inputs, {"dp": dp | {"seed": 1235}}, spec=spec)
    assert not torch.equal(next(iter(other.values())), next(iter(first.values())))
    unseeded = [run("fedbuff", inputs, {"dp": dp | {"seed": None}}, spec=spec) for _ in range(2)]
    assert not torch.equal(*(next(iter(r.values())) for r in unseeded))


def test_dp_is_refused_where_it_is_not_supported(tmp_path):
    inputs = make_inputs(tmp_path, 3)
    for name in ("lora_product", "trimmed_mean", "median", "krum", "multi_krum"):
        with pytest.raises(ValueError, match="does not support server-side DP"):
            run(name, inputs, {"dp": {"clip": 1.0, "noise_multiplier": 1.0}})
    with pytest.raises(ValueError, match="dp.clip must be a positive"):
        run("fedavg", inputs, {"dp": {"clip": 0, "noise_multiplier": 1.0}})
    with pytest.raises(ValueError, match="unknown dp fields"):
        run("fedavg", inputs, {"dp": {"clip": 1.0, "noise_multiplier": 1.0, "epsilon": 3}})


# -- encodings -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("z, q, steps", [(1.0, 0.01, 100), (1.5, 0.1, 10), (0.8, 1.0, 3), (4.0, 0.5, 1000)])
def test_dp_epsilon_matches_opacus(z, q, steps):
    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=z, sample_rate=q)
    assert dp_epsilon([(z, q, steps)], 1e-5) == pytest.approx(accountant.get_epsilon(delta=1e-5), rel=1e-12)
    assert epsilon_if_round_runs([(z, q, steps - 1)], z, q, 1e-5) == pytest.approx(
        accountant.get_epsilon(delta=1e-5), rel=1e-12
    )


def test_dp_epsilon_is_monotonic_and_composes_mixed_histories():
    values = [dp_epsilon([(1.1, 0.05, steps)], 1e-5) for steps in (1, 2, 5, 10, 50, 200)]
    assert values == sorted(values) and len(set(values)) == len(values)
    assert dp_epsilon([], 1e-5) == 0.0
    accountant = RDPAccountant()
    history = [(1.0, 0.1, 3), (2.0, 0.05, 4), [1.0, 0.1, 2]]
    for z, q, steps in history:
        for _ in range(steps):
            accountant.step(noise_multiplier=z, sample_rate=q)
    assert dp_epsilon(history, 1e-6) == pytest.approx(accountant.get_epsilon(delta=1e-6), rel=1e-12)
    assert epsilon_if_round_runs(history, 2.0, 0.05, 1e-6) > dp_epsilon(history, 1e-6)
    with pytest.raises(ValueError, match="sample_rate must be in"):
        dp_epsilon([(1.0, 1.5, 1)], 1e-5)
    with pytest.raises(ValueError, match="delta must be in"):
        dp_epsilon([(1.0, 0.5, 1)], 0)


def _exact_gaussian_epsilon(noise_multiplier: float, steps: int, delta: float) -> float:
    """The exact epsilon of ``steps`` releases of the Gaussian mechanism (sensitivity 1, no sampling): they
    compose to one with mu = sqrt(steps) / z, whose privacy profile is delta(eps) = Phi(-eps/mu + mu/2) -
    e^eps Phi(-eps/mu - mu/2) (Balle and Wang 2018; Dong, Roth and Su 2019). Solved for eps by bisection."""

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2))

    mu = math.sqrt(steps) / noise_multiplier
    low, high = 0.0, 500.0
    for _ in range(200):
        middle = (low + high) / 2
        if phi(-middle / mu + mu / 2) - math.exp(middle) * phi(-middle / mu - mu / 2) > delta:
            low = middle
        else:
            high = middle
    return high


@pytest.mark.parametrize("z, steps", [(0.8, 1), (1.0, 10), (1.5, 3), (2.0, 100), (4.0, 1000), (10.0, 5)])
@pytest.mark.parametrize("delta", [1e-5, 1e-6])
def test_dp_epsilon_bounds_the_exact_epsilon_of_the_gaussian_mechanism_closely(z, steps, delta):
    """Without sampling the true epsilon is known in closed form: the RDP accountant's is an upper bound on it
    (never promising more privacy than the mechanism gives) and, here, within 10% of it."""
    exact = _exact_gaussian_epsilon(z, steps, delta)
    spent = dp_epsilon([(z, 1.0, steps)], delta)
    assert exact <= spent <= 1.10 * exact, (exact, spent)


@pytest.mark.parametrize("z, q, steps", [(1.0, 0.01, 100), (1.5, 0.1, 10), (1.1, 0.05, 50), (4.0, 0.5, 200)])
def test_dp_epsilon_with_sampling_is_no_less_than_the_numerical_prv_accountant(z, q, steps):
    """With sampling there is no closed form; the PRV accountant computes the privacy loss distribution
    numerically (Gopi, Lee and Wutschitz 2021), an estimate within its error bound of the truth. The RDP
    figure the product persists is above it (conservative) and within a factor of two."""
    accountant = PRVAccountant()
    accountant.history = [(z, q, steps)]
    estimate = accountant.get_epsilon(delta=1e-5)
    spent = dp_epsilon([(z, q, steps)], 1e-5)
    assert estimate <= spent <= 2 * estimate, (estimate, spent)
