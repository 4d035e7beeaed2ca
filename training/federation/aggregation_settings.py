"""An adapter's aggregation and DP settings with their defaults, read in one place.

``Adapter.aggregation`` and ``Adapter.dp`` hold only what an operator changed; everything reads them
through ``aggregation_settings`` / ``dp_settings`` so the defaults live here and nowhere else.
"""

from __future__ import annotations

from typing import Any

AGGREGATION_DEFAULTS: dict[str, Any] = {
    "strategy": "fedavg",
    "buffer_size": 8,  # K: a round closes when this many accepted deltas are in
    "min_deltas": 2,  # at the deadline, a round closes only with at least this many
    "round_timeout_seconds": 600,
    "max_staleness": 4,  # versions a delta's base may lag the adapter's newest
    "max_norm": 1000.0,  # verification rejects an update whose L2 norm is above this
    "clip_norm": None,  # norm clipping before any strategy
    "trim_ratio": 0.1,
    "byzantine": None,
    "multi_k": None,
    "mixing": None,  # null: the strategy's own (MIXING_DEFAULTS); "nnm": nearest-neighbour mixing first; "none": off
    "shard_size": 64,  # rounds of more deltas are split across the aggregation workers (shardable strategies)
    "coordinate_shards": 4,  # robust rules over more than shard_size deltas: coordinate spans, one Celery task each
    "auto_rounds": True,  # open a round when a delta is accepted and none is collecting
    "ffa": False,  # FFA-LoRA: deltas carry only lora_B (and saved modules)
    "auto_release": False,  # release each round's version and roll it out to the adapter's cohorts at once
}

DP_DEFAULTS: dict[str, Any] = {
    "enabled": False,
    "clip": 1.0,
    "noise_multiplier": 1.0,
    "delta": 1e-5,
    "epsilon_budget": 10.0,
    "sample_rate": None,  # None: buffer size / devices in the adapter's cohorts
}

ROBUST = ("trimmed_mean", "median", "krum", "multi_krum")  # the strategies mixing applies to
STRATEGY_PARAMS = ("clip_norm", "trim_ratio", "byzantine", "multi_k", "mixing", "shard_size", "coordinate_shards")
# Nearest-neighbour mixing unless an operator says "none": Krum keeps one delta per round, and bare, on devices
# whose data differ, it learns far less than the mean; mixed, it keeps up (bench/README.md, "poisoning.py").
# The others are better bare, or only as good, so theirs is off.
MIXING_DEFAULTS = {"krum": "nnm"}
MIXING_VALUES = (None, "nnm", "none")


AGGREGATION_HELP = (
    'Only the settings that differ from the defaults (README, "Deltas, verification and rounds"): '
    + ", ".join(AGGREGATION_DEFAULTS)
    + '. mixing is null (the strategy\'s default: "nnm" for krum, off for the rest), "none" (off) or "nnm" '
    + f"(nearest-neighbour mixing, for {', '.join(ROBUST)} only)."
)


def effective_mixing(values: dict[str, Any]) -> str | None:
    """The mixing a round of these settings runs with: "nnm", or None for none."""
    mixing = values["mixing"] if values["mixing"] is not None else MIXING_DEFAULTS.get(values["strategy"])
    return None if mixing == "none" else mixing


def aggregation_settings(adapter) -> dict[str, Any]:
    """Every setting, with the defaults for those not set; ``mixing`` as rounds run it (``effective_mixing``)."""
    merged = {**AGGREGATION_DEFAULTS, **(adapter.aggregation or {})}
    return {**merged, "mixing": effective_mixing(merged)}


def dp_settings(adapter) -> dict[str, Any]:
    return {**DP_DEFAULTS, **(adapter.dp or {})}


def validate_aggregation(values: dict[str, Any]) -> dict[str, Any]:
    """Check an operator's aggregation settings; ValueError naming the first bad one."""
    from training.federation.strategies import STRATEGIES, get_strategy

    unknown = set(values) - set(AGGREGATION_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown aggregation settings: {sorted(unknown)}")
    merged = {**AGGREGATION_DEFAULTS, **values}
    if merged["strategy"] not in STRATEGIES:
        raise ValueError(f"unknown strategy {merged['strategy']!r}: use one of {sorted(STRATEGIES)}")
    for name in ("buffer_size", "min_deltas", "round_timeout_seconds", "shard_size", "coordinate_shards"):
        if not isinstance(merged[name], int) or isinstance(merged[name], bool) or merged[name] < 1:
            raise ValueError(f"{name} must be a positive whole number")
    if (
        not isinstance(merged["max_staleness"], int)
        or isinstance(merged["max_staleness"], bool)
        or (merged["max_staleness"] < 0)
    ):
        raise ValueError("max_staleness must be a whole number >= 0")
    if merged["min_deltas"] > merged["buffer_size"]:
        raise ValueError("min_deltas cannot be above buffer_size")
    for name in ("max_norm", "clip_norm"):
        value = merged[name]
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{name} must be a positive number or null")
    for name in ("auto_rounds", "ffa", "auto_release"):
        if not isinstance(merged[name], bool):
            raise ValueError(f"{name} must be true or false")
    if merged["mixing"] not in MIXING_VALUES:
        raise ValueError('mixing must be null (the strategy\'s default), "none" or "nnm"')
    if merged["mixing"] == "nnm" and merged["strategy"] not in ROBUST:
        raise ValueError(f"mixing applies to the robust strategies ({', '.join(ROBUST)}), not {merged['strategy']}")
    # the strategy's own check of its params (trim_ratio, byzantine, multi_k, ...), as a round would run it
    running = {**merged, "mixing": effective_mixing(merged)}
    get_strategy(merged["strategy"]).check_params({name: running[name] for name in STRATEGY_PARAMS})
    return values


def validate_dp(values: dict[str, Any]) -> dict[str, Any]:
    unknown = set(values) - set(DP_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown DP settings: {sorted(unknown)}")
    merged = {**DP_DEFAULTS, **values}
    for name in ("clip", "noise_multiplier", "delta", "epsilon_budget"):
        value = merged[name]
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"DP {name} must be a positive number")
    rate = merged["sample_rate"]
    if rate is not None and not (isinstance(rate, int | float) and 0 < rate <= 1):
        raise ValueError("DP sample_rate must be in (0, 1] or null")
    return values
