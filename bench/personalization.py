"""Personalization: what devices that differ as users do gain over the shared version 1, on the digits fleet.

Per scenario (``label``: label skew only; ``feature``: each device's own rotation, scale and contrast;
``concept``: each device swaps two pairs of labels) and seed, one split (``bench/personalization_data.py``): a
factory-trained base is version 1; ``--devices`` devices hold Dirichlet(0.3) label shards of the rest of the
digits train set, seen through their profiles, a random quarter of each device's samples its local test slice.
On that split every selected method of the registry (``bench/personalization_methods.py``) runs: plain-torch
references (no product training code) in a full and a LoRA form: version 1 alone, local fine-tuning, FedAvg,
FedAvg then fine-tuning, Ditto, FedPer; and the forgetting measurement (local fine-tuning on data that drifted,
with and without replay).

Reported per scenario and row, as mean +- standard deviation over the seeds: the mean and the 10th percentile
of the per-device accuracies on the local test slices, the share of devices better than version 1 and the
share not worse (at most one test sample below version 1 on that device). Prints Markdown tables, writes
``bench/results/personalization.json`` (``--json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import personalization_product  # noqa: F401  (registers the product's rows)
import torch
from personalization_data import Config, prepare_split
from personalization_methods import METHODS, select

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SCENARIOS = ("label", "feature", "concept")


def device_stats(acc: np.ndarray, v1: np.ndarray, n_test: np.ndarray) -> dict:
    """One run's figures over its devices (those with test samples). Not worse: accuracy at most one test
    sample (1 / n_test of that device) below version 1's."""
    ok = ~np.isnan(acc)
    acc, v1, n_test = acc[ok], v1[ok], n_test[ok]
    return {
        "mean": float(acc.mean()),
        "p10": float(np.percentile(acc, 10)),  # numpy's default, linear interpolation
        "better": float((acc > v1 + 1e-9).mean()),
        "not_worse": float((acc >= v1 - 1 / n_test - 1e-9).mean()),
        "devices": int(ok.sum()),
    }


def forgetting_stats(acc: np.ndarray, extras: dict, n_test: np.ndarray) -> dict:
    before, later = np.asarray(extras["before_drift"]), np.asarray(extras["later"])
    ok = ~np.isnan(acc)
    return {
        "before": float(before[ok].mean()),
        "after": float(acc[ok].mean()),
        "change": float(acc[ok].mean() - before[ok].mean()),
        "forgot": float((acc[ok] < before[ok] - 1 / n_test[ok] - 1e-9).mean()),
        "later": float(np.nanmean(later)),
    }


def run_split(scenario: str, seed: int, config: Config, methods) -> list[dict]:
    began = time.monotonic()
    split = prepare_split(scenario, seed, config)
    n_test = split.test.n.numpy()
    v1 = METHODS["version1"].fn(split).accuracy
    print(
        f"[{scenario} seed {seed}] split ready ({time.monotonic() - began:.1f} s): version 1 mean {np.nanmean(v1):.3f}",
        file=sys.stderr,
        flush=True,
    )
    runs = []
    for method in methods:
        started = time.monotonic()
        result = method.fn(split)
        acc = np.asarray(result.accuracy, dtype=float)
        if method.table == "forgetting":
            stats = forgetting_stats(acc, result.extras, n_test)
        else:
            stats = device_stats(acc, v1, n_test)
            stats.update({f"{k}_mean": float(np.nanmean(v)) for k, v in result.extras.items()})
        runs.append(
            {
                "scenario": scenario, "seed": seed, "method": method.name, "table": method.table, "stats": stats,
                "seconds": time.monotonic() - started, "accuracy": acc.tolist(),
                "extras": {k: np.asarray(v, dtype=float).tolist() for k, v in result.extras.items()},
            }
        )  # fmt: skip
        shown = stats.get("mean", stats.get("after"))
        print(
            f"[{scenario} seed {seed}] {method.name}: {shown:.3f} ({runs[-1]['seconds']:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    runs.append(
        {
            "scenario": scenario, "seed": seed, "method": "_split", "version1": v1.tolist(),
            "test_samples": n_test.tolist(), "train_samples": split.train.n.tolist(),
            "factory_samples": split.factory_samples, "profiles": [d["profile"] for d in split.devices],
        }
    )  # fmt: skip
    return runs


def summarize(runs: list[dict]) -> list[dict]:
    """One row per scenario and method: every figure's mean and standard deviation over the seeds."""
    rows = []
    keys = dict.fromkeys((r["scenario"], r["method"], r["table"]) for r in runs if r["method"] != "_split")
    for scenario, method, table_name in keys:
        per_seed = [r for r in runs if r["scenario"] == scenario and r["method"] == method]
        row = {"scenario": scenario, "method": method, "table": table_name, "seeds": [r["seed"] for r in per_seed]}
        for figure in per_seed[0]["stats"]:
            values = [r["stats"][figure] for r in per_seed]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            row[figure] = {"mean": statistics.fmean(values), "sd": spread, "values": values}
        rows.append(row)
    return rows


def _cell(figure: dict | None, digits: int = 3, scale: float = 1.0) -> str:
    if figure is None:
        return ""
    return f"{scale * figure['mean']:.{digits}f} ± {scale * figure['sd']:.{digits}f}"


def _form(method: str) -> str:
    return METHODS[method].form if method in METHODS else ""


def table(rows: list[dict], scenario: str) -> list[str]:
    """The personalization rows of one scenario (any set of methods)."""
    lines = [
        "| method | form | mean acc | 10th pct acc | better than v1 | not worse than v1 | shared model mean acc |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["scenario"] != scenario or row["table"] != "personalization":
            continue
        name = row["method"].rsplit("-", 1)[0] if _form(row["method"]) in ("full", "lora") else row["method"]
        lines.append(
            f"| {name} | {_form(row['method'])} | {_cell(row['mean'])} | {_cell(row['p10'])} | {_cell(row['better'])} "
            f"| {_cell(row['not_worse'])} | {_cell(row.get('shared_mean'))} |"
        )
    return lines


def forgetting_table(rows: list[dict]) -> list[str]:
    lines = [
        "| scenario | form | replay | earliest acc before drift | after drift | change (points) | devices that forgot "
        "| later data acc | kept within 2 points |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["table"] != "forgetting":
            continue
        replay = "yes" if "replay" in row["method"] else "no"
        lines.append(
            f"| {row['scenario']} | {_form(row['method'])} | {replay} | {_cell(row['before'])} | {_cell(row['after'])} "
            f"| {_cell(row['change'], 1, 100)} | {_cell(row['forgot'])} | {_cell(row['later'])} "
            f"| {'yes' if row['change']['mean'] >= -0.02 else 'no'} |"
        )
    return lines


def report(data: dict) -> None:
    config = data["config"]
    print(f"\n## Personalization: {config['devices']} devices, {config['rounds']} rounds, digits\n")
    print(f"`{data['command']}`\n")
    for scenario in dict.fromkeys(row["scenario"] for row in data["rows"]):
        lines = table(data["rows"], scenario)
        if len(lines) > 2:
            print(f"### {scenario}\n")
            print("\n".join(lines) + "\n")
    lines = forgetting_table(data["rows"])
    if len(lines) > 2:
        print("### forgetting\n")
        print("\n".join(lines) + "\n")
    print(
        f"Mean ± standard deviation over seeds {data['seeds']}. Accuracy per device on its local test slice; mean and "
        "10th percentile over devices; better = above version 1 on that device; not worse = at most one test "
        "sample below it. Forgetting: accuracy on the held-out slice of a device's earliest data after local "
        "fine-tuning on its later data (another device's label mix, its own profile); devices that forgot = "
        "more than one test sample below their accuracy before the drift."
    )
    print(
        f"\n{data['runs_done']} method runs in {data['seconds'] / 60:.1f} min ({data['cpu_seconds'] / 60:.1f} min of "
        f"CPU); load average {data['load_before'][0]:.2f} before, {data['load_after'][0]:.2f} after; "
        f"torch {data['torch']}, {data['threads']} thread(s). Settings: {json.dumps(config)}"
    )


def merge(parts: list[dict]) -> dict:
    """Runs of the same settings made by several processes (other scenarios, seeds or methods), as one run:
    their runs together (a method of a scenario and seed once), the rows summarized again, the wall time of the
    longest and the CPU of all."""
    if len(parts) == 1:
        return parts[0]
    configs = {json.dumps(part["config"], sort_keys=True) for part in parts}
    if len(configs) > 1:
        raise SystemExit("these runs used different settings: their figures cannot be put in one table")
    runs, seen = [], set()
    for run in (run for part in parts for run in part["runs"]):
        key = (run["scenario"], run["seed"], run["method"])
        if key not in seen:  # a row two files both ran (version1) counts once, from the first that has it
            seen.add(key)
            runs.append(run)
    return {
        **parts[0],
        "command": " ; ".join(part["command"] for part in parts),
        "seconds": max(part["seconds"] for part in parts),
        "cpu_seconds": sum(part["cpu_seconds"] for part in parts),
        "load_after": max((part["load_after"] for part in parts), key=lambda load: load[0]),
        "seeds": sorted({seed for part in parts for seed in part["seeds"]}),
        "rows": summarize(runs),
        "runs_done": sum(run["method"] != "_split" for run in runs),
        "runs": runs,
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    groups = sorted({m.group for m in METHODS.values()})
    parser.add_argument("--methods", default="all", help=f"names or groups ({', '.join(groups)}), or all")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (a split and training each)")
    parser.add_argument("--devices", type=int, default=Config.devices)
    parser.add_argument("--rounds", type=int, default=Config.rounds)
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="any other setting of Config, e.g. lr=0.003"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--json", type=Path, default=RESULTS / "personalization.json")
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        help="print the tables of earlier runs' JSON files "
        "(several: one table of all their runs, e.g. scenarios run as parallel processes)",
    )
    args = parser.parse_args(argv)
    names = [m for m in args.methods.split(",") if m]
    try:
        args.methods = list(METHODS.values()) if names == ["all"] else select(names)
    except ValueError as error:
        parser.error(str(error))
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    overrides = {"devices": args.devices, "rounds": args.rounds}
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in types:
            parser.error(f"unknown setting {name!r}: use one of {sorted(types)}")
        overrides[name] = {"int": int, "float": float, "str": str}[types[name]](value)
    args.config = Config(**overrides)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        report(merge([json.loads(path.read_text()) for path in args.from_json]))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    command = ".venv/bin/python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    began, cpu, load_before = time.monotonic(), time.process_time(), os.getloadavg()
    runs: list[dict] = []

    def results(complete: bool) -> dict:
        data = {
            "command": command, "seconds": time.monotonic() - began, "cpu_seconds": time.process_time() - cpu,
            "load_before": load_before, "load_after": os.getloadavg(), "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "seeds": args.seeds, "config": args.config.as_dict(), "rows": summarize(runs),
            "runs_done": sum(r["method"] != "_split" for r in runs), "complete": complete, "runs": runs,
        }  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1))
        return data

    splits = [(scenario, seed) for scenario in args.scenarios for seed in args.seeds]
    for done, (scenario, seed) in enumerate(splits, 1):
        runs += run_split(scenario, seed, args.config, args.methods)
        if done < len(splits):  # a long run cut short keeps what it finished (--from-json reads it)
            results(complete=False)
            print(f"{done}/{len(splits)} splits done; so far in {os.path.relpath(args.json, ROOT)}", file=sys.stderr)
    report(results(complete=True))
    print(f"wrote {os.path.relpath(args.json, ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
