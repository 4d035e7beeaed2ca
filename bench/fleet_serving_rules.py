"""Which model a device serves, judged again on a finished ``fleet_learning.py`` run: for each device, the rule
as shipped (``edge_agent.personal.choose``) and variants of it, applied to what the device's last pass measured
on its held slice, and scored on the device's TEST set with the two models it chose between (``shared_model``,
``personal_model`` in ``bench/results/fleet_learning_<seed>.json``). Nothing is trained: a run's devices are
the same under every rule, so the rules differ only in what they serve.

    .venv/bin/python bench/fleet_serving_rules.py --seeds 1,2,3

The variants relax the sign test where the installed version reads every label the device holds right (no
``misread`` class: nothing says the device names or sees digits its own way), serving it when the held slice
has it ahead with a p-value of at most the variant's level. Pick a rule on tuning seeds only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from edge_agent.personal import CHANCE, PersonalSettings, choose, sign_test

RESULTS = Path(__file__).resolve().parent / "results"
LEVELS = (CHANCE, 0.15, 0.3, 0.55, 1.0)  # sign-test p of 5-0, 3-0 (0.125), 2-0 (0.25), 1-0 (0.5), any lead


def judged(device: dict) -> tuple[dict, dict] | None:
    """The held-slice figures of the device's last pass as ``choose`` takes them, or None if it made none."""
    c = device.get("choice") or {}
    if c.get("serving") is None:
        return None
    n = int(c.get("val_samples") or 0)
    shared = {"accuracy": _number(c.get("shared_accuracy")), "only_right": c.get("shared_only_right"),
              "distinct": n, "misread_labels": len(device.get("misread") or [])}  # fmt: skip
    personal = {"accuracy": _number(c.get("personal_accuracy")), "only_right": c.get("personal_only_right"),
                "distinct": n}  # fmt: skip
    return shared, personal


def _number(value) -> float:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else float("nan")


def relaxed(level: float, settings: PersonalSettings):
    def rule(shared: dict, personal: dict) -> str:
        shipped = choose(shared, personal, settings)
        if shipped == "shared" or shared.get("misread_labels"):
            return shipped
        n = int(personal.get("distinct") or 0)
        if n < max(settings.min_val_samples, 1) or not shared["accuracy"] >= personal["accuracy"] + settings.margin:
            return shipped
        ahead, behind = int(shared.get("only_right") or 0), int(personal.get("only_right") or 0)
        return "shared" if ahead > behind and sign_test(ahead, behind) <= level else shipped

    return rule


def score(devices: list[dict], rule) -> dict:
    served, changed = [], 0
    for d in devices:
        inputs = judged(d)
        if inputs is None or d.get("personal_model") is None or d.get("shared_model") is None:
            served.append(d["served"])  # no pass or no own model: every rule serves what the agent served
            continue
        pick = rule(*inputs)
        served.append(d["personal_model"] if pick == "personal" else d["shared_model"])
        changed += pick != d["serving"]
    served = np.asarray(served)
    finetune = np.asarray([d["finetune"] for d in devices])
    v1 = np.asarray([d["v1"] for d in devices])
    gaps = served - finetune
    return {
        "not_worse": int((served >= v1 - 1e-9).sum()),
        "mean": 100 * gaps.mean(),
        "p10": 100 * np.percentile(gaps, 10),
        "p10_acc": 100 * (np.percentile(served, 10) - np.percentile(finetune, 10)),
        "changed": changed,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", required=True, help="comma-separated seeds with results in bench/results/")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    runs = {s: json.loads((RESULTS / f"fleet_learning_{s}.json").read_text())["devices"] for s in seeds}
    settings = PersonalSettings(method="ditto")  # the default setting; margin and sizes as the server gives them
    rules = {"shipped (sign test p <= 5%)": lambda shared, personal: choose(shared, personal, settings)}
    rules |= {f"reads every label: p <= {level:g}": relaxed(level, settings) for level in LEVELS[1:]}
    print("| rule | seed | served >= v1 | served - finetune mean | p10 | p10 of accuracies | devices changed |")
    print("|---|---|---|---|---|---|---|")
    for name, rule in rules.items():
        for seed, devices in [*runs.items(), ("pooled", [d for ds in runs.values() for d in ds])]:
            s = score(devices, rule)
            print(f"| {name} | {seed} | {s['not_worse']}/{len(devices)} | {s['mean']:+.1f} | {s['p10']:+.1f} | "
                  f"{s['p10_acc']:+.1f} | {s['changed']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
