"""Server optimizers through the product (issue 53): rounds to reach the shared accuracy plain FedAvg reaches.

    /work/main/.venv/bin/python bench/server_optimizers.py --seeds 1          # ~3 min a run on a quick host
    /work/main/.venv/bin/python bench/server_optimizers.py --seeds 1 --optimizers fedadam --set '{"server_lr": 0.03}'

For each server optimizer (none: plain FedAvg; ``fedavgm``, ``fedadagrad``, ``fedadam``, ``fedyogi`` at their
defaults, ``--set`` on top), one ``fleet_learning.py`` run on the same seed's harsh split: the real server started
by its launcher, 12 real agents fed by their application, the adapter's aggregation set to ``fedavg`` rounds of
``--buffer`` deltas with the optimizer, auto-release through the release gate, ``--rounds`` rounds. Per round, the
server's evaluation of the newest released version (what devices run). Then per optimizer: the evaluation after
the last round, the best, and the rounds it took to reach plain FedAvg's evaluation after its last round (the
baseline, run first in the same run). JSON per run in ``bench/results/fleet_learning_<seed>.json`` (overwritten by
the next run), the table's in ``bench/results/server_optimizers_<seed>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

from bench import fleet_learning  # noqa: E402
from training.federation.strategies.server_optimizers import OPTIMIZERS  # noqa: E402

RESULTS = BASE_DIR / "bench" / "results"


def released_curve(result: dict) -> list[float]:
    """After each round, the server's evaluation of the newest released version (version 1's before any)."""
    curve, newest = [], (1, result["summary"]["v1_eval"])
    for row in sorted(result["rounds"], key=lambda r: r["round_id"]):
        if row["state"] == "released" and row["version"] > newest[0] and row.get("eval_accuracy") is not None:
            newest = (row["version"], row["eval_accuracy"])
        curve.append(newest[1])
    return curve


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="besides plain fedavg, which always runs")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--buffer", type=int, default=6, help="deltas a round")
    p.add_argument("--max-minutes", type=float, default=12.0)
    p.add_argument(
        "--set", default="{}", help="aggregation settings over each optimizer's, e.g. '{\"server_lr\": 0.03}'"
    )
    args = p.parse_args(argv)
    extra = json.loads(args.set)
    for seed in (int(s) for s in args.seeds.split(",") if s.strip()):
        rows = []
        for optimizer in (None, *[o for o in args.optimizers.split(",") if o]):
            aggregation = {"strategy": "fedavg", "buffer_size": args.buffer, "min_deltas": 2,
                           **({"server_optimizer": optimizer, **extra} if optimizer else {})}  # fmt: skip
            run = fleet_learning.parse([
                "--seeds", str(seed), "--rounds", str(args.rounds), "--max-minutes", str(args.max_minutes),
                "--finetune-seeds", "1", "--buffer", str(args.buffer), "--aggregation", json.dumps(aggregation),
            ])  # fmt: skip
            result = fleet_learning.one_seed(seed, run)
            curve = released_curve(result)
            served = result["summary"]["served_minus_v1_mean_pts"]
            rows.append({"optimizer": optimizer or "none (fedavg)", "aggregation": aggregation, "curve": curve,
                         "rounds": len(curve), "served_mean": served})  # fmt: skip
        target = rows[0]["curve"][-1] if rows[0]["curve"] else None
        print(f"\n### seed {seed}: the newest released version's evaluation (%), fedavg rounds of {args.buffer}\n")
        print("| optimizer | rounds | after the last | best | rounds to reach fedavg's last | served - v1, mean |")
        print("|---|---|---|---|---|---|")
        for row in rows:
            curve = row["curve"]
            reached = next((i + 1 for i, value in enumerate(curve) if target is not None and value >= target), None)
            row["rounds_to_fedavg"] = reached
            print(f"| {row['optimizer']} | {row['rounds']} | {100 * curve[-1]:.1f} | {100 * max(curve):.1f} | "
                  f"{reached if reached is not None else 'not reached'} | {row['served_mean']:+.1f} |"
                  if curve else f"| {row['optimizer']} | 0 | - | - | - | - |")  # fmt: skip
        (RESULTS / f"server_optimizers_{seed}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
