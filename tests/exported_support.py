"""A team's own model for the tests of issue 51: a small 1-D CNN on a wearable's sensor windows (3 channels, 32
steps, 4 activities), built and trained here, saved with ``torch.export.save`` with its card. Nothing downloaded."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import torch
from torch import nn

CHANNELS, STEPS, ACTIVITIES = 3, 32, 4
CARD = {
    "inputs": [{"name": "window", "dtype": "float32", "shape": ["batch", CHANNELS, STEPS]}],
    "task": "classification",
    "classes": ACTIVITIES,
}


class SensorCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(CHANNELS, 8, 5, padding=2)
        self.conv2 = nn.Conv1d(8, 8, 5, padding=2)
        self.fc = nn.Linear(8 * (STEPS // 4), 16)
        self.head = nn.Linear(16, ACTIVITIES)

    def forward(self, window):
        h = torch.max_pool1d(torch.relu(self.conv1(window)), 2)
        h = torch.max_pool1d(torch.relu(self.conv2(h)), 2)
        return self.head(torch.relu(self.fc(h.flatten(1))))


def windows(n: int, *, seed: int, offset: float = 0.0, gain: float = 1.0, noise: float = 0.3) -> dict:
    """``n`` windows of the 4 activities (a sine of its own frequency per activity, phase at random), as one
    wearer's sensor sees them: its own ``offset``, ``gain`` and ``noise``."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, ACTIVITIES, n)
    t = np.arange(STEPS) / STEPS
    phase = rng.uniform(0, 2 * np.pi, (n, CHANNELS, 1))
    frequency = (1 + 2 * labels)[:, None, None] * np.array([1.0, 1.5, 0.5])[None, :, None]
    x = np.sin(2 * np.pi * frequency * t[None, None, :] + phase)
    x = gain * x + offset + noise * rng.standard_normal(x.shape)
    return {"window": x.astype(np.float32), "y": labels.astype(np.int64)}


def trained_model(seed: int = 0, epochs: int = 30) -> SensorCNN:
    torch.manual_seed(seed)
    model = SensorCNN()
    data = windows(400, seed=seed)
    x, y = torch.as_tensor(data["window"]), torch.as_tensor(data["y"])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        for start in range(0, len(y), 32):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[start : start + 32]), y[start : start + 32]).backward()
            optimizer.step()
    return model.eval()


def export_bytes(model: nn.Module) -> bytes:
    batch = torch.export.Dim("batch")
    program = torch.export.export(model, (torch.zeros(2, CHANNELS, STEPS),), dynamic_shapes=({0: batch},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def rewritten(archive: bytes, replace: dict[str, bytes] | None = None, add: dict[str, bytes] | None = None) -> bytes:
    """The archive with members replaced (by their name's end) or added: hostile variants of a good one."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            for end, value in (replace or {}).items():
                if info.filename.endswith(end):
                    data = value
            target.writestr(info, data)
        for name, value in (add or {}).items():
            target.writestr(name, value)
    return out.getvalue()
