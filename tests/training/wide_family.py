"""A test-only model family with one wide layer, so a round's aggregation takes long enough to be killed."""

import torch
from torch import nn


class WideNet(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        return self.proj(x)


class Wide:
    name = "wide"
    default_targets = ("proj",)
    default_modules_to_save = ()

    def build(self, config):
        torch.manual_seed(int(config.get("seed", 0)))
        return WideNet(int(config.get("width", 1024)))
