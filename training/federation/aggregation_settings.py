"""An adapter's aggregation and DP settings with their defaults, read in one place.

``Adapter.aggregation`` and ``Adapter.dp`` hold only what an operator changed; everything reads them
through ``aggregation_settings`` / ``dp_settings`` so the defaults live here and nowhere else.
"""

from __future__ import annotations

from typing import Any

from training.federation.strategies.server_optimizers import BETA2, LR_DEFAULTS, MOMENTUM, OPTIMIZERS, TAU

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
    # The share of the aggregated update applied to the base (the server learning rate); null: the strategy's own
    # (SERVER_LR_DEFAULTS).
    "server_lr": None,
    # A server optimizer on each round's update (training.federation.strategies.server_optimizers): null (the update
    # times server_lr), "fedavgm", "fedadagrad", "fedadam" or "fedyogi", with their momentum (beta1), beta2 and tau.
    "server_optimizer": None,
    "server_momentum": MOMENTUM,
    "server_beta2": BETA2,
    "server_tau": TAU,
    # FedProx (Li et al. 2020): the devices' shared pass adds proximal_mu/2 ||w - w_installed||^2 to its loss,
    # signed into the manifest's training setting; 0: plain local training.
    "proximal_mu": 0.0,
    "shard_size": 64,  # rounds of more deltas are split across the aggregation workers (shardable strategies)
    "coordinate_shards": 4,  # robust rules over more than shard_size deltas: coordinate spans, one Celery task each
    "auto_rounds": True,  # open a round when a delta is accepted and none is collecting
    "ffa": False,  # FFA-LoRA: deltas carry only lora_B (and saved modules)
    "auto_release": False,  # release each round's version and roll it out to the adapter's cohorts at once
    # The release gate (training.federation.release_gate): a version whose evaluation is worse than the best
    # released version's by more than this (0.01: one point of accuracy) stays a candidate.
    "release_margin": 0.01,
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
STRATEGY_PARAMS = (
    "clip_norm",
    "trim_ratio",
    "byzantine",
    "multi_k",
    "mixing",
    "shard_size",
    "coordinate_shards",
    "server_lr",
    "server_optimizer",
    "server_momentum",
    "server_beta2",
    "server_tau",
)
OPTIMIZER_PARAMS = ("server_momentum", "server_beta2", "server_tau")  # a round carries them only with an optimizer
# Nearest-neighbour mixing unless an operator says "none": Krum keeps one delta per round, and bare, on devices
# whose data differ, it learns far less than the mean; mixed, it keeps up (bench/README.md, "poisoning.py").
# The others are better bare, or only as good, so theirs is off.
MIXING_DEFAULTS = {"krum": "nnm"}
MIXING_VALUES = (None, "nnm", "none")
# FedBuff's rounds are a few deltas each, often from devices whose users differ: applied whole, three updates from
# devices that hold two or three classes each moved the shared version far from what the rest of the fleet needs,
# and it got worse round after round. Half of each buffer's update, as FedBuff (Nguyen et al. 2022) applies its
# buffer with a server learning rate, keeps what they agree on (bench/README.md, "fleet_learning.py").
SERVER_LR_DEFAULTS = {"fedbuff": 0.5}


AGGREGATION_HELP = (
    'Only the settings that differ from the defaults (README, "Deltas, verification and rounds"): '
    + ", ".join(AGGREGATION_DEFAULTS)
    + '. mixing is null (the strategy\'s default: "nnm" for krum, off for the rest), "none" (off) or "nnm" '
    + f"(nearest-neighbour mixing, for {', '.join(ROBUST)} only). server_lr is null (the strategy's default: "
    + "0.5 for fedbuff, 1 for the rest; with a server optimizer, its own: 0.1 for fedavgm and fedadagrad, 0.01 "
    + "for fedadam and fedyogi) or the share of each round's update applied. server_optimizer is null or one of "
    + f"{', '.join(OPTIMIZERS)} (server_momentum, server_beta2 and server_tau its settings). proximal_mu: FedProx's "
    + "weight on the devices' shared pass (0: off). release_margin: how much "
    + "worse (0.01: one point of accuracy) than the best released version a round's version may evaluate and "
    + "still be released."
)


def effective_mixing(values: dict[str, Any]) -> str | None:
    """The mixing a round of these settings runs with: "nnm", or None for none."""
    mixing = values["mixing"] if values["mixing"] is not None else MIXING_DEFAULTS.get(values["strategy"])
    return None if mixing == "none" else mixing


def effective_server_lr(values: dict[str, Any]) -> float:
    """The server learning rate a round of these settings applies its update with."""
    lr = values["server_lr"]
    if lr is not None:
        return float(lr)
    if values.get("server_optimizer"):
        return LR_DEFAULTS[values["server_optimizer"]]
    return SERVER_LR_DEFAULTS.get(values["strategy"], 1.0)


def aggregation_settings(adapter) -> dict[str, Any]:
    """Every setting, with the defaults for those not set; ``mixing`` and ``server_lr`` as rounds run them
    (``effective_mixing``, ``effective_server_lr``)."""
    merged = {**AGGREGATION_DEFAULTS, **(adapter.aggregation or {})}
    return {**merged, "mixing": effective_mixing(merged), "server_lr": effective_server_lr(merged)}


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
    lr = merged["server_lr"]
    if lr is not None and (not isinstance(lr, int | float) or isinstance(lr, bool) or not 0 < lr <= 10):
        raise ValueError("server_lr must be a number above 0 and at most 10, or null (the strategy's default)")
    optimizer = merged["server_optimizer"]
    if optimizer is not None and optimizer not in OPTIMIZERS:
        raise ValueError(f"server_optimizer must be null or one of {', '.join(OPTIMIZERS)}, not {optimizer!r}")
    for name in ("server_momentum", "server_beta2"):
        value = merged[name]
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < 1:
            raise ValueError(f"{name} must be a number from 0 to below 1")
    mu = merged["proximal_mu"]
    if not isinstance(mu, int | float) or isinstance(mu, bool) or not 0 <= mu <= 100:
        raise ValueError("proximal_mu must be a number from 0 to 100 (0: plain local training)")
    tau = merged["server_tau"]
    if not isinstance(tau, int | float) or isinstance(tau, bool) or not 0 < tau <= 1:
        raise ValueError("server_tau must be a number above 0 and at most 1")
    margin = merged["release_margin"]
    if not isinstance(margin, int | float) or isinstance(margin, bool) or not 0 <= margin <= 1:
        raise ValueError("release_margin must be a number from 0 to 1 (0.01 is one point of accuracy)")
    if merged["mixing"] not in MIXING_VALUES:
        raise ValueError('mixing must be null (the strategy\'s default), "none" or "nnm"')
    if merged["mixing"] == "nnm" and merged["strategy"] not in ROBUST:
        raise ValueError(f"mixing applies to the robust strategies ({', '.join(ROBUST)}), not {merged['strategy']}")
    # the strategy's own check of its params (trim_ratio, byzantine, multi_k, ...), as a round would run it
    running = {**merged, "mixing": effective_mixing(merged), "server_lr": effective_server_lr(merged)}
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
