"""The personal pass alone, offline, on ``fleet_learning.py``'s split: a quick loop for tuning it (no server).

    /work/main/.venv/bin/python bench/fleet_learning_offline.py --seeds 1,2,3
    /work/main/.venv/bin/python bench/fleet_learning_offline.py --seeds 1 --set '{"lambda": 1.0}' --devices 1,7

Per device of the harsh split (``bench/fleetlearn/split.py``): the store its agent would hold (the application's
wrapped feed, ``FleetDevice.stream``, 32 at a time, to 480 samples), and ``--passes`` runs of the agent's own
``personalize`` on it as ``DeviceRuntime.personal_pass`` calls it (the newest 240 samples, ``device_split``, the
demo's training settings, a replay buffer), the personal adapter carried from pass to pass, on the store as it
grows. The shared version stays version 1 (the factory base's seeded adapter, as the demo makes it): what the
fleet learns meanwhile is left out, which matters little to devices whose sensor or names differ. A device under
32 samples runs one pass on all of them (``DeviceRuntime._personal_on_few_samples``). Then on its TEST set: version
1, the personal model, what ``choose`` serves, and ``fleet_learning.py``'s plain fine-tune (``Models.finetune``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

from bench.fleetlearn.fleet import FleetDevice  # noqa: E402
from bench.fleetlearn.measure import FINETUNE, as_tensors  # noqa: E402
from bench.fleetlearn.split import FACTORY_FRACTION, make_split  # noqa: E402
from edge_agent import personal  # noqa: E402
from edge_agent.families import get_family  # noqa: E402
from edge_agent.families.common import pretrain  # noqa: E402
from edge_agent.lora import initial_tensors  # noqa: E402
from edge_agent.lora_layers import adapter_parameters, apply_adapter  # noqa: E402
from edge_agent.protocol import PERSONALIZATION_DEFAULTS  # noqa: E402
from edge_agent.runtime import JUDGE_MIN_SAMPLES  # noqa: E402
from edge_agent.samples import SPLIT_EVERY, ReplayBuffer, device_split  # noqa: E402
from edge_agent.training import TrainConfig, train_adapter  # noqa: E402

FAMILY = get_family("digits-cnn")
RANK, ALPHA, WINDOW, STORE = 16, 32.0, 240, 480  # the family's default shape; fleet.py's train_window


class Fleet:
    """The demo's base (``demo.fleet_demo.factory_base``, without Django) and version 1 on it."""

    def __init__(self):
        base = FAMILY.build({"seed": 1})
        factory, _ = FAMILY.dataset({"factory_fraction": FACTORY_FRACTION, "part": "factory"})
        self.base = pretrain(base, factory, seed=1).state_dict()
        shapes = {k: tuple(v.shape) for k, v in adapter_parameters(self.build(None)).items()}
        self.v1 = initial_tensors(self.fresh(), shapes, seed=1, target_modules=list(FAMILY.default_targets),
                                  modules_to_save=list(FAMILY.default_modules_to_save))  # fmt: skip

    def fresh(self):
        model = FAMILY.build({"seed": 1})
        model.load_state_dict(self.base)
        return model

    def build(self, tensors):
        tensors = {k: v.clone() for k, v in tensors.items()} if tensors is not None else None
        return apply_adapter(self.fresh(), tensors, rank=RANK, alpha=ALPHA, target_modules=FAMILY.default_targets,
                             modules_to_save=FAMILY.default_modules_to_save).eval()  # fmt: skip

    def accuracy(self, tensors, data) -> float:
        with torch.no_grad():
            return float(FAMILY.evaluate(self.build(tensors), as_tensors(data))["accuracy"])

    def finetune(self, held: dict, seed: int) -> dict:
        """``bench/fleetlearn/measure.py``'s ``Models.finetune`` from version 1, its tensors."""
        model, data = self.build(self.v1), as_tensors(held)
        val_mask = (np.arange(len(data["y"])) % 5) == 4
        train, val = ({k: v[mask] for k, v in data.items()} for mask in (~val_mask, val_mask))
        config = TrainConfig(**FINETUNE, seed=seed, judge_min_samples=0, progress_bar=False)
        result = train_adapter(model, train, val, config=config, family=FAMILY)
        return (
            dict(self.v1) if result.discarded else {k: p.detach().clone() for k, p in adapter_parameters(model).items()}
        )


def store(device: FleetDevice) -> dict:
    stream, parts, n = device.stream(), [], 0
    while n < STORE and (batch := stream.poll()) is not None:
        parts.append({"x": batch["x"].clip(0.0, 1.0), "y": batch["y"]})
        n += len(batch["y"])
    return {k: np.concatenate([p[k] for p in parts]) for k in ("x", "y")}


def window(data: dict, count: int) -> dict:
    start = max(0, count - WINDOW)
    start += -start % SPLIT_EVERY
    return {k: torch.as_tensor(v[start:count]) for k, v in data.items()}


def run_device(fleet: Fleet, data, settings, passes: int, seed: int) -> dict:
    device = FleetDevice(data=data, home=Path("."), cohort="", wrap=True, per_batch=32, feed_seconds=8.0)
    held_samples = device.held_samples()
    finetune = fleet.accuracy(fleet.finetune(held_samples, seed * 1000 + data.index), data.test)
    samples = store(device)
    n = len(samples["y"])
    counts = sorted({int(c) for c in np.linspace(max(32, n // passes), n, passes).clip(max=n)}) if n >= 32 else [n]
    mine, outcome, began = None, None, time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        replay = ReplayBuffer(Path(tmp) / "replay.npz", seed=data.index)
        for count in counts:
            train, val, held = device_split(window(samples, count))
            config = TrainConfig(epochs=3, lr=0.01, replay_ratio=0.25, refit=True, restrict_classes=True,
                                 judge_min_samples=JUDGE_MIN_SAMPLES, seed=count)  # fmt: skip
            replay.add(train)  # the shared pass before it adds its samples
            outcome = personal.personalize(build=fleet.build, shared=fleet.v1, personal=mine, train=train,
                                           val=val, held=held, settings=settings, family=FAMILY, config=config,
                                           replay=replay)  # fmt: skip
            mine = outcome.tensors
    v1, own = fleet.accuracy(fleet.v1, data.test), fleet.accuracy(mine, data.test)
    return {"device": f"{data.index:02d}{data.group[0].upper()}{'s' if data.small else ''}",
            "samples": len(held_samples["y"]), "v1": v1, "personal": own, "serving": outcome.serving,
            "served": own if outcome.serving == "personal" else v1, "finetune": finetune,
            "seconds": round(time.monotonic() - began, 1)}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1")
    p.add_argument("--devices", default="", help="comma-separated device indices (all by default)")
    p.add_argument("--passes", type=int, default=6)
    p.add_argument("--set", default="{}", help="JSON over PERSONALIZATION_DEFAULTS, e.g. '{\"lambda\": 1.0}'")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    settings = personal.PersonalSettings.from_training({"personalization": {**PERSONALIZATION_DEFAULTS,
                                                                              **json.loads(args.set)}})  # fmt: skip
    wanted = {int(d) for d in args.devices.split(",") if d.strip()}
    fleet = Fleet()
    for seed in (int(s) for s in args.seeds.split(",") if s.strip()):
        rows = [run_device(fleet, d, settings, args.passes, seed) for d in make_split(seed, 12, 0.2)
                if not wanted or d.index in wanted]  # fmt: skip
        print(f"\n### seed {seed} ({settings.as_dict()})\n")
        print("| device | samples | v1 | personal | served (what) | finetune | served - finetune | s |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['device']} | {r['samples']} | {100 * r['v1']:.1f} | {100 * r['personal']:.1f} | "
                  f"{100 * r['served']:.1f} ({r['serving']}) | {100 * r['finetune']:.1f} | "
                  f"{100 * (r['served'] - r['finetune']):+.1f} | {r['seconds']} |")  # fmt: skip
        gaps = 100 * np.array([r["served"] - r["finetune"] for r in rows])
        print(f"\nserved - finetune: mean {gaps.mean():+.1f}, p10 {np.percentile(gaps, 10):+.1f}; "
              f"{sum(r['seconds'] for r in rows):.0f} s of personal passes")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
