"""Server optimizers on the aggregated update (Reddi et al. 2021, "Adaptive Federated Optimization"; FedAvgM, Hsu
et al. 2019): pure torch, no Django.

A round's strategy (any mean or robust rule) gives the aggregated update ``delta``, the pseudo-gradient: the change
the devices' training made to the base. Without an optimizer the server adds ``server_lr * delta`` to the base. With
one, it keeps moments per adapter tensor across rounds and adds ``server_step``'s update instead:

- ``fedavgm``: ``m = momentum * m + delta``; the update is ``lr * m``;
- ``fedadagrad``: ``m = momentum * m + (1 - momentum) * delta``, ``v = v + delta²``; the update is
  ``lr * m / (√v + tau)``;
- ``fedadam``: ``m`` as fedadagrad's, ``v = beta2 * v + (1 - beta2) * delta²``; the same update;
- ``fedyogi``: ``m`` as fedadagrad's, ``v = v - (1 - beta2) * delta² * sign(v - delta²)``; the same update.

The moments start at ``m = 0`` and ``v = tau²`` (the paper's ``v_{-1} >= tau²``), in float64, and are kept per
adapter across rounds and versions: stored with the version each round makes (``training.federation.aggregation``),
the next round continues those of the adapter's newest such version, whether the release gate released it or held
it back. A round builds on the newest released version either way (``rounds.round_base``): while the gate holds
candidates back, their rounds' updates, all from the same base, gather in the moments, as FedBuff's buffer gathers
deltas, until one passes.
"""

from __future__ import annotations

import torch

OPTIMIZERS = ("fedavgm", "fedadagrad", "fedadam", "fedyogi")
MOMENTUM_DEFAULT = 0.9
ADAPTIVE = ("fedadagrad", "fedadam", "fedyogi")
# Each optimizer's server learning rate where the adapter sets none: FedAvgM's is 1 - momentum, so that rounds whose
# updates agree step by their update, as plain averaging does (at 1.0 its momentum, gathering the updates of the
# rounds the release gate held back, grew tenfold and the candidates fell to chance on the digits fleet:
# bench/README.md, "server_optimizers.py"); the adaptive ones step each coordinate by about lr (Reddi et al.'s grids
# center on 10^-2 to 10^-1 with tau 10^-3).
LR_DEFAULTS = {"fedavgm": 1 - MOMENTUM_DEFAULT, "fedadagrad": 0.1, "fedadam": 0.01, "fedyogi": 0.01}
MOMENTUM, BETA2, TAU = MOMENTUM_DEFAULT, 0.99, 1e-3


def server_step(
    delta: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor] | None,
    *,
    optimizer: str,
    lr: float,
    momentum: float = MOMENTUM,
    beta2: float = BETA2,
    tau: float = TAU,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(update, state)``: the float32 update to add to the base for the aggregated ``delta``, and the moments
    after it (``m/<name>``, and for the adaptive ones ``v/<name>``; float64) to pass to the next round's step.
    ``state`` is the moments after the round the base version came from (None or empty: none yet); a tensor
    whose shape changed starts afresh."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown server optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    state = state or {}
    update, after = {}, {}
    for name in sorted(delta):
        d = delta[name].double()
        m = state.get(f"m/{name}")
        m = m.double() if m is not None and m.shape == d.shape else torch.zeros_like(d)
        if optimizer == "fedavgm":
            m = momentum * m + d
            update[name], after[f"m/{name}"] = (lr * m).float(), m
            continue
        v = state.get(f"v/{name}")
        v = v.double() if v is not None and v.shape == d.shape else torch.full_like(d, tau * tau)
        m = momentum * m + (1 - momentum) * d
        square = d * d
        if optimizer == "fedadagrad":
            v = v + square
        elif optimizer == "fedadam":
            v = beta2 * v + (1 - beta2) * square
        else:  # fedyogi
            v = v - (1 - beta2) * square * torch.sign(v - square)
        update[name] = (lr * m / (v.sqrt() + tau)).float()
        after[f"m/{name}"], after[f"v/{name}"] = m, v
    return update, after
