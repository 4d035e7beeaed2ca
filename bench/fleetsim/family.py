"""A model family for load tests, plugged in by import path (``bench.fleetsim.family:BenchLinear``): one
square ``Linear`` layer named ``proj``, sized so an adapter of a given rank makes deltas of a given size.

A LoRA adapter on ``proj`` (``features`` x ``features``) holds ``lora_A`` [r, features] and ``lora_B``
[features, r]: ``2 * r * features`` float32 values, so a delta of ``kb`` KiB at rank 32 needs
``features = 4 * kb`` (300 KiB: 1,200 features, 307,200 bytes of tensors plus a ~200-byte header).

It has no dataset, so the server stores no evaluation metrics for its versions (``training.registry.evaluation``);
the server imports it from the checkout it runs in (``bench`` is a namespace package under the project root).
"""

from __future__ import annotations

from typing import Any

RANK = 32
TARGETS = ("proj",)


def features_for(delta_kb: float, rank: int = RANK) -> int:
    """The layer width that gives float32 deltas of about ``delta_kb`` KiB at ``rank``."""
    return max(8, round(delta_kb * 1024 / (4 * 2 * rank)))


class BenchLinear:
    name = "bench-linear"
    default_targets = TARGETS
    default_modules_to_save: tuple[str, ...] = ()

    def build(self, config: dict[str, Any]):
        import torch
        from torch import nn

        torch.manual_seed(int(config.get("seed", 0)))
        features = int(config.get("features", 1200))
        model = nn.Module()
        model.proj = nn.Linear(features, features, bias=False)
        return model
