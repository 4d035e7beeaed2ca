"""A team's own model, as a team would bring it: a small 1-D CNN on a wearable's sensor windows (3 channels, 32
steps, 4 activities), trained here on synthetic windows, saved with ``torch.export.save`` beside its card, and
sample files for devices whose sensors differ. What the README's "Your own model" walks through, the tests of
issue 51 and ``bench/own_model.py`` use. Nothing is downloaded.

    python -m demo.sensor_model OUT_DIR        # OUT_DIR/sensor.pt2, sensor.json, device-<n>.npz, test-<n>.npz
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

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


# Each device's wearer and sensor: its own offset, gain and noise on the same activities.
SENSORS = [(0.0, 1.0, 0.3), (0.8, 1.7, 0.3), (-0.6, 0.6, 0.4), (0.3, 2.2, 0.5), (-1.0, 1.3, 0.3), (1.2, 0.8, 0.6)]


def write(out: Path, *, devices: int = 3, samples: int = 120, seed: int = 0) -> list[Path]:
    """The model, its card and each device's sample files (``device-<n>.npz`` to add, ``test-<n>.npz`` to
    measure on) under ``out``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "sensor.pt2", out / "sensor.json"]
    written[0].write_bytes(export_bytes(trained_model(seed)))
    written[1].write_text(json.dumps(CARD, indent=2) + "\n")
    for n in range(devices):
        offset, gain, noise = SENSORS[n % len(SENSORS)]
        for kind, count, shift in (("device", samples, 0), ("test", 100, 5000)):
            path = out / f"{kind}-{n}.npz"
            data = windows(count, seed=seed * 100 + n + 1 + shift, offset=offset, gain=gain, noise=noise)
            with path.open("wb") as handle:
                np.savez(handle, **data)
            written.append(path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write(args.out, devices=args.devices, seed=args.seed):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
