"""Helpers for the training tests (fixtures live in conftest.py)."""

from __future__ import annotations

import numpy as np
import torch

from edge_agent.families.common import take
from edge_agent.lora_layers import apply_adapter
from edge_agent.samples import local_split


def device_split(train: dict, indices, *, val_fraction: float = 0.3) -> tuple[dict, dict]:
    """A device's samples (``indices`` of the global train set) as local train / validation tensors."""
    shard = {key: value.numpy() for key, value in take(train, torch.as_tensor(np.asarray(indices))).items()}
    local_train, local_val = local_split(shard, val_fraction=val_fraction)
    as_tensors = lambda part: {key: torch.as_tensor(value) for key, value in part.items()}  # noqa: E731
    return as_tensors(local_train), as_tensors(local_val)


def adapted(base, family, *, rank: int = 4, seed: int = 0, tensors=None):
    """A copy of ``base`` carrying an adapter on the family's default targets: ``tensors``, or a fresh one."""
    return apply_adapter(
        base,
        tensors,
        rank=rank,
        alpha=2 * rank,
        target_modules=list(family.default_targets),
        modules_to_save=list(family.default_modules_to_save),
        seed=seed,
        copy=True,
    )
