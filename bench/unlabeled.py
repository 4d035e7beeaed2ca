"""Learning from unlabeled samples (issue 52): the personal pass with 10% of a device's samples labelled.

    /work/main/.venv/bin/python bench/unlabeled.py --seeds 1,2,3            # tuning seeds
    /work/main/.venv/bin/python bench/unlabeled.py --seeds 201,202 --labelled 0.1

On ``fleet_learning.py``'s harsh split (``bench/fleetlearn/split.py``: Dirichlet(0.2) labels, a third of the devices
with their own sensor, a third with their own names for three digits, a tenth under 10 samples), each device's
application hands its samples over again and again (``FleetDevice.stream``, 32 at a time, to 480), and labels
``--labelled`` of its distinct samples (at least one; chosen by the seed); the rest arrive unlabeled. Three runs of
the agent's own personal pass on the same stream, as ``fleet_learning_offline.py`` runs it (``--passes`` passes as
the store grows, the newest 240 labelled samples, ``device_split``, a replay buffer, version 1 as the shared
version), differing only in what they learn from:

- ``labelled only``: the labelled samples (``unlabeled: none``);
- ``pseudo-labels``: the labelled samples and the newest 240 unlabeled ones, pseudo-labelled
  (``unlabeled: "pseudo_label"``, ``edge_agent.pseudo_labels``, with ``--set``'s settings);
- ``all labelled``: every sample labelled (the upper bound: what ``fleet_learning_offline.py`` measures).

Then on each device's TEST set: what ``choose`` serves after the last pass, against version 1 (the shared version).
Per group (label mix, own sensor, own names): the mean, the 10th percentile, the share of devices served no worse
than version 1, and the share of the gap between labelled only and all labelled that pseudo-labels close.
JSON to ``bench/results/unlabeled_<seed>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

from bench.fleet_learning_offline import FAMILY, Fleet, store, window  # noqa: E402
from bench.fleetlearn.fleet import FleetDevice  # noqa: E402
from bench.fleetlearn.split import make_split  # noqa: E402
from edge_agent import personal  # noqa: E402
from edge_agent.protocol import PERSONALIZATION_DEFAULTS  # noqa: E402
from edge_agent.runtime import JUDGE_MIN_SAMPLES, UNLABELED_PER_PASS  # noqa: E402
from edge_agent.samples import ReplayBuffer, device_split  # noqa: E402
from edge_agent.training import TrainConfig  # noqa: E402

MODES = ("labelled only", "pseudo-labels", "all labelled")
GROUPS = ("label", "feature", "concept")
RESULTS = BASE_DIR / "bench" / "results"


def feed(device: FleetDevice, share: float, seed: int) -> tuple[dict, np.ndarray]:
    """The application's stream to ``STORE`` samples, and which of them carry their label: those of the distinct
    samples chosen as labelled (``share`` of them, at least one)."""
    samples = store(device)
    keys = [row.tobytes() for row in samples["x"]]
    distinct = sorted(set(keys))
    rng = np.random.default_rng(seed)
    chosen = {distinct[i] for i in rng.permutation(len(distinct))[: max(1, round(share * len(distinct)))]}
    return samples, np.array([key in chosen for key in keys])


def run(fleet: Fleet, samples: dict, labelled: np.ndarray, settings, passes: int, mode: str, index: int) -> dict:
    n = len(samples["y"])
    counts = sorted({int(c) for c in np.linspace(max(32, n // passes), n, passes).clip(max=n)}) if n >= 32 else [n]
    mine, outcome, guessed = None, None, 0
    settings = replace(settings, unlabeled="pseudo_label" if mode == "pseudo-labels" else "none")
    with tempfile.TemporaryDirectory() as tmp:
        replay = ReplayBuffer(Path(tmp) / "replay.npz", seed=index)
        for count in counts:
            seen = np.arange(n) < count
            mask = seen if mode == "all labelled" else seen & labelled
            have = {k: v[mask] for k, v in samples.items()}
            if not len(have["y"]):
                continue
            rest = {"x": torch.as_tensor(samples["x"][seen & ~labelled][-UNLABELED_PER_PASS:])}
            train, val, held = device_split(window(have, len(have["y"])))
            config = TrainConfig(epochs=3, lr=0.01, replay_ratio=0.25, refit=True, restrict_classes=True,
                                 judge_min_samples=JUDGE_MIN_SAMPLES, seed=count)  # fmt: skip
            replay.add(train)
            outcome = personal.personalize(build=fleet.build, shared=fleet.v1, personal=mine, train=train,
                                           val=val, held=held, settings=settings, family=FAMILY,
                                           config=config, replay=replay,
                                           unlabeled=rest if len(rest["x"]) else None)  # fmt: skip
            mine = outcome.tensors
            notes = outcome.result.notes if outcome.result is not None else []
            guessed = max([guessed, *(int(note.split()[0]) for note in notes if "pseudo-labelled" in note)])
    return {"tensors": mine, "serving": outcome.serving if outcome else "shared", "pseudo": guessed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1")
    p.add_argument("--labelled", type=float, default=0.1, help="share of each device's distinct samples labelled")
    p.add_argument("--passes", type=int, default=6)
    p.add_argument("--set", default="{}", help="JSON over PERSONALIZATION_DEFAULTS, e.g. '{\"confidence\": 0.9}'")
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help="the modes to run; the others are read from the seed's last JSON (tuning one mode)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    settings = personal.PersonalSettings.from_training({"personalization": {**PERSONALIZATION_DEFAULTS,
                                                                              **json.loads(args.set)}})  # fmt: skip
    fleet, pooled = Fleet(), {mode: [] for mode in MODES}
    RESULTS.mkdir(parents=True, exist_ok=True)
    modes = [m for m in args.modes.split(",") if m]
    for seed in (int(s) for s in args.seeds.split(",") if s.strip()):
        rows, began = [], time.monotonic()
        path = RESULTS / f"unlabeled_{seed}.json"
        earlier = {r["device"]: r for r in json.loads(path.read_text())} if set(modes) != set(MODES) else {}
        for data in make_split(seed, 12, 0.2):
            device = FleetDevice(data=data, home=Path("."), cohort="", wrap=True, per_batch=32, feed_seconds=8.0)
            samples, labelled = feed(device, args.labelled, seed * 1000 + data.index)
            row = {"device": f"{data.index:02d}{data.group[0].upper()}{'s' if data.small else ''}",
                   "group": data.group, "distinct": len({r.tobytes() for r in samples["x"]}),
                   "labelled": len({r.tobytes() for r in samples["x"][labelled]}),
                   "v1": fleet.accuracy(fleet.v1, data.test)}  # fmt: skip
            for mode in MODES:
                if mode not in modes:
                    row[mode] = earlier[row["device"]][mode]
                    continue
                made = run(fleet, samples, labelled, settings, args.passes, mode, data.index)
                own = fleet.accuracy(made["tensors"], data.test) if made["tensors"] is not None else row["v1"]
                row[mode] = own if made["serving"] == "personal" else row["v1"]
                if mode == "pseudo-labels":
                    row["pseudo"] = made["pseudo"]
            rows.append(row)
            print(f"[bench] seed {seed} {row['device']}: " + ", ".join(f"{m} {100 * row[m]:.1f}" for m in
                  ("v1", *MODES)) + f" ({row.get('pseudo', '-')} pseudo-labelled)", flush=True)  # fmt: skip
        path.write_text(json.dumps(rows, indent=1))
        report(f"seed {seed} ({time.monotonic() - began:.0f} s)", rows, args.labelled)
        for mode in MODES:
            pooled[mode].extend(rows)
    seeds = [s for s in args.seeds.split(",") if s.strip()]
    if len(seeds) > 1:
        report(f"seeds {', '.join(seeds)} pooled", pooled[MODES[0]], args.labelled)
    print(f"\nsettings: {settings.as_dict()}")
    return 0


def report(title: str, rows: list[dict], share: float) -> None:
    print(f"\n### {title}: {share:.0%} of each device's distinct samples labelled, served model on TEST\n")
    print(
        "| group | devices | v1 | labelled only: mean / p10 / not worse | pseudo-labels | all labelled | gap closed |"
    )
    print("|---|---|---|---|---|---|---|")
    for group in (*GROUPS, "all"):
        chosen = [r for r in rows if group in ("all", r["group"])]
        if not chosen:
            continue
        v1 = np.array([r["v1"] for r in chosen])
        cells = []
        for mode in MODES:
            served = np.array([r[mode] for r in chosen])
            cells.append(f"{100 * served.mean():.1f} / {100 * np.percentile(served, 10):.1f} / "
                         f"{int((served >= v1 - 1e-9).sum())}/{len(chosen)}")  # fmt: skip
        means = [np.mean([r[mode] for r in chosen]) for mode in MODES]
        gap = means[2] - means[0]
        closed = f"{(means[1] - means[0]) / gap:.0%}" if gap >= 0.01 else f"no gap ({100 * gap:+.1f} pts)"
        print(f"| {group} | {len(chosen)} | {100 * v1.mean():.1f} | " + " | ".join(cells) + f" | {closed} |")


if __name__ == "__main__":
    sys.exit(main())
