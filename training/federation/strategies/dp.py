"""Server-side differential privacy: the Gaussian mechanism on a sum of clipped deltas, and its accountant.

Mechanism (``params["dp"] = {"clip": C, "noise_multiplier": z, "seed": s}``, used by fedavg, fedbuff and
ffa_lora): every delta is clipped to L2 norm C (its norm recomputed from the file, never taken on trust),
the clipped deltas are summed with weight at most 1 each (sample counts are self-reported and unbounded, so
they cannot weigh in), Gaussian noise N(0, (z*C)^2) is added once to every released coordinate of the sum,
and the sum is divided by the number of deltas (fedbuff: by the sum of its staleness discounts, each <= 1).
Adding or removing one device's delta moves the sum by at most C, so the release is the sampled Gaussian
mechanism with noise multiplier z, whose privacy loss ``dp_epsilon`` accounts with Opacus's RDP accountant.

``seed`` makes the noise reproducible for tests. In production leave it out (a fresh seed is drawn from
``secrets``): anyone who knows the seed can regenerate the noise and subtract it.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DPConfig:
    clip: float
    noise_multiplier: float
    seed: int | None = None

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise added to each coordinate of the sum."""
        return self.noise_multiplier * self.clip


def _real(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def parse_dp(value) -> DPConfig | None:
    """``params["dp"]`` checked; None when DP is off. ValueError names the bad field."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("dp must be an object {clip, noise_multiplier, seed}")
    unknown = sorted(set(value) - {"clip", "noise_multiplier", "seed"})
    if unknown:
        raise ValueError(f"unknown dp fields {unknown}: use clip, noise_multiplier, seed")
    clip, multiplier, seed = value.get("clip"), value.get("noise_multiplier"), value.get("seed")
    if not _real(clip) or clip <= 0:
        raise ValueError(f"dp.clip must be a positive finite number, not {clip!r}")
    if not _real(multiplier) or multiplier < 0:
        raise ValueError(f"dp.noise_multiplier must be a finite number >= 0, not {multiplier!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64):
        raise ValueError(f"dp.seed must be a whole number in [0, 2**64) or null, not {seed!r}")
    return DPConfig(clip=float(clip), noise_multiplier=float(multiplier), seed=seed)


def add_gaussian_noise(sums: dict[str, torch.Tensor], keys: Iterable[str], config: DPConfig) -> None:
    """Add N(0, noise_std^2) to every coordinate of ``sums[key]`` (float64, in place), keys in sorted order
    from one generator, so a seed gives the same noise wherever this runs."""
    seed = config.seed if config.seed is not None else secrets.randbits(63)
    generator = torch.Generator().manual_seed(seed)
    std = config.noise_std
    for key in sorted(keys):
        noise = torch.randn(sums[key].shape, generator=generator, dtype=torch.float64)
        sums[key].add_(noise, alpha=std)


def _check_history(history) -> list[tuple[float, float, int]]:
    steps_out = []
    if not isinstance(history, list | tuple):
        raise ValueError("the DP history must be a list of (noise_multiplier, sample_rate, steps)")
    for index, entry in enumerate(history):
        if not isinstance(entry, Sequence) or isinstance(entry, str) or len(entry) != 3:
            raise ValueError(f"DP history entry #{index} must be (noise_multiplier, sample_rate, steps)")
        multiplier, rate, steps = entry
        if not _real(multiplier) or multiplier <= 0:
            raise ValueError(f"DP history entry #{index}: noise_multiplier must be > 0, not {multiplier!r}")
        if not _real(rate) or not 0 < rate <= 1:
            raise ValueError(f"DP history entry #{index}: sample_rate must be in (0, 1], not {rate!r}")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"DP history entry #{index}: steps must be a whole number >= 0, not {steps!r}")
        if steps:
            steps_out.append((float(multiplier), float(rate), steps))
    return steps_out


def dp_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """Epsilon spent at ``delta`` by the rounds in ``history`` (entries ``(noise_multiplier, sample_rate,
    steps)``, as Opacus's ``RDPAccountant.history`` holds them); 0.0 for an empty history."""
    from opacus.accountants import RDPAccountant

    if not _real(delta) or not 0 < delta < 1:
        raise ValueError(f"DP delta must be in (0, 1), not {delta!r}")
    steps = _check_history(history)
    if not steps:
        return 0.0
    accountant = RDPAccountant()
    accountant.history = steps
    return float(accountant.get_epsilon(delta=delta))


def epsilon_if_round_runs(
    history: list[tuple[float, float, int]], noise_multiplier: float, sample_rate: float, delta: float
) -> float:
    """Epsilon after one more round (one step) with this noise multiplier and sample rate."""
    return dp_epsilon([*_check_history(history), (noise_multiplier, sample_rate, 1)], delta)
