"""``digits-cnn``: a small CNN for scikit-learn's bundled 8x8 digits (fast enough for demos and tests)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class DigitsNet(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(width, width * 2, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(width * 2 * 2 * 2, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)  # 8x8 -> 4x4
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)  # 4x4 -> 2x2
        return self.head(torch.relu(self.fc1(x.flatten(1))))


class DigitsCNN:
    name = "digits-cnn"
    default_targets = ("conv2", "fc1")
    default_modules_to_save = ("head",)

    def build(self, config: dict[str, Any]) -> nn.Module:
        torch.manual_seed(int(config.get("seed", 0)))
        return DigitsNet(width=int(config.get("width", 16)))
