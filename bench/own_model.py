"""A team's own model through the product (issue 51), the sensor model of ``demo/sensor_model.py``: what training it
costs an agent, and what each device gains from its personalization.

    .venv/bin/python bench/own_model.py --seeds 101           # 8 devices, 8 rounds (~12 min)
    .venv/bin/python bench/own_model.py --smoke               # 3 devices, 2 rounds, 1 repeat (~3 min)

1. Training cost on this CPU (``bench/own_model_cost.py``): LoRA as the product trains an exported program against
   full fine-tuning of the same exported module, for the sensor model and a wider one of the same kind, each in a
   fresh process: peak RSS of a pass over the idle process with the model loaded, samples per second, and the
   update's size (float32 safetensors) against the model's.
2. Per seed, personalization through the product's own path (``bench/own_model_fleet.py``): the launcher on a fresh
   database and Redis prefix (``bench/fleetsim/server.py``); through the API, the ``.pt2`` and its card uploaded as
   an ``exported-program`` base model, an adapter with the API's defaults (no targets named: the family's own, and
   the demo's FedBuff with auto-release, buffer 3), a cohort, an enrollment token, version 1 seeded, released and
   rolled out to 100%. Then ``--devices`` real agents (``bench/fleetlearn/fleet.py``: ``DeviceRuntime`` and
   ``AgentConnection`` over the WebSocket), each a wearer with its own sensor (offset, gain, noise drawn from the
   seed) whose application hands its 60 to 150 windows to ``Agent.add_samples`` again and again, until ``--rounds``
   rounds complete or ``--max-minutes``. Then, on each device's 200 held-out TEST windows (never handed to its
   agent): version 1, the newest released version, what ``Agent(home).served()`` serves, and the baseline, a plain
   local fine-tune of version 1's adapter on the windows the device holds (``Models.finetune``: ``train_adapter``
   with early stopping; the mean of ``--finetune-seeds`` runs). Summary: mean, 10th percentile and the share of
   devices not worse than version 1, for the served model and for the fine-tune.

Seeds: 1, 2, 3 for tuning; 101 and up held out. Tables to stdout, JSON to ``bench/results/own_model.json``, each
seed's server log to ``bench/results/own_model_<seed>.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

from bench.fleetsim import RESULTS_DIR, say  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="--devices 3 --rounds 2 --repeats 1 --finetune-seeds 1")
    p.add_argument("--parts", default="cost,fleet", help="cost, fleet or both")
    p.add_argument("--repeats", type=int, default=3, help="runs of each training-cost configuration (medians)")
    p.add_argument("--seeds", default="1", help="comma-separated device seeds (tuning 1,2,3; held out 101 and up)")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--max-minutes", type=float, default=8.0, help="per seed, from the first agent's start")
    p.add_argument("--finetune-seeds", type=int, default=3, help="training seeds of the plain fine-tune per device")
    p.add_argument("--batch", type=int, default=32, help="windows an application hands over at a time")
    p.add_argument("--feed-seconds", type=float, default=8.0)
    p.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--keep", action="store_true", help="keep the agents' homes and the server's data folder")
    args = p.parse_args(argv)
    if args.smoke:
        args.devices, args.rounds, args.repeats, args.finetune_seeds = 3, 2, 1, 1
    return args


def measure_device(d, models, v1, released, seed: int, runs: int) -> dict:
    """One device's row: its models on its TEST windows, and what its agent did and reports."""
    # torch and the product load in the run, not at --help (as bench/fleet_learning.py does)
    from bench.fleetlearn.measure import both_models, device_report
    from edge_agent.api import Agent

    held, test = d.held_samples(), d.data.test
    try:
        served, about = Agent(d.home).served()
        served_accuracy = models.accuracy(served, test)
    except Exception as error:  # noqa: BLE001  (a device that never installed a version serves nothing: v1)
        served_accuracy, about = models.accuracy(v1[1], test), {"serving": f"none ({error})", "version": None}
    tuned = [models.accuracy(models.finetune(v1[0], held, seed=seed * 1000 + d.data.index + 500 * k)[0], test)
             for k in range(max(runs, 1))]  # fmt: skip
    return {
        "index": d.data.index, "name": d.name, "group": d.data.group, "small": False, "sensor": d.data.transform,
        "view": d.data.describe(), "samples": len(held["y"]), "handed": d.handed, "test_samples": len(test["y"]),
        "v1": models.accuracy(v1[1], test), "released": models.accuracy(released, test), "served": served_accuracy,
        "serving": about.get("serving"), "installed": about.get("version"),
        "finetune": float(np.mean(tuned)), "finetune_runs": tuned,
        "passes": d.passes, "uploads": d.uploads, "discarded": d.discarded, "failures": d.failures,
        "reported": device_report(d.home), **both_models(d.home, models, test, held),
    }  # fmt: skip


def summary(rows: list[dict]) -> dict:
    """Per model: mean and 10th percentile of the devices' TEST accuracies, and the devices not worse than v1."""
    out = {}
    for key in ("v1", "released", "served", "finetune"):
        values = np.asarray([r[key] for r in rows])
        not_worse = int(sum(r[key] >= r["v1"] - 1e-9 for r in rows))
        out[key] = {"mean": float(values.mean()), "p10": float(np.percentile(values, 10)), "not_worse": not_worse,
                    "devices": len(rows), "not_worse_share": not_worse / len(rows)}  # fmt: skip
    gaps = np.asarray([r["served"] - r["finetune"] for r in rows])
    out["served_minus_finetune"] = {"mean": float(gaps.mean()), "p10": float(np.percentile(gaps, 10))}
    return out


def summary_table(s: dict, released: int) -> str:
    names = {"v1": "version 1", "released": f"newest released (v{released})", "served": "served (the agent's)",
             "finetune": "plain local fine-tune of v1 (baseline)"}  # fmt: skip
    lines = ["| model | mean | 10th percentile | not worse than v1 |", "|---|---|---|---|"]
    for key, name in names.items():
        m = s[key]
        lines.append(f"| {name} | {100 * m['mean']:.1f} | {100 * m['p10']:.1f} | {m['not_worse']}/{m['devices']} "
                     f"({100 * m['not_worse_share']:.0f}%) |")  # fmt: skip
    gap = s["served_minus_finetune"]
    lines.append(f"| served - fine-tune, per device | {100 * gap['mean']:+.1f} | {100 * gap['p10']:+.1f} | |")
    return "\n".join(lines)


def rounds_table(rounds: list[dict], deltas: list[dict], versions: dict, short) -> str:
    lines = ["| round | base | version | state | deltas | from (device, samples, base) |", "|---|---|---|---|---|---|"]
    for n, r in enumerate((r for r in rounds if r.get("result_version")), 1):
        members = [f"{short(x['device_name'])} {x['num_samples']} v{x['base_version']}"
                   for x in deltas if x["round"] == r["id"]]  # fmt: skip
        state = versions.get(r["result_version"], {}).get("state")
        lines.append(f"| {n} | v{r['base_version']} | v{r['result_version']} | {state} | {r['accepted']} | "
                     f"{', '.join(members)} |")  # fmt: skip
    return "\n".join(lines)


def one_seed(seed: int, args, program: bytes) -> dict:
    import torch

    from bench.fleet_learning import run_fleet
    from bench.fleetlearn.measure import Models
    from bench.fleetlearn.report import devices_table
    from bench.fleetsim.server import Server
    from bench.own_model_fleet import ADAPTER, COHORT, SensorDevice, sensor_split, set_up

    torch.set_num_threads(1)
    wall = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix=f"own-model-{seed}-"))
    log = RESULTS_DIR / f"own_model_{seed}.log"
    server = Server(workdir=workdir, database_url=args.database_url, redis_url=args.redis_url, log_path=log,
                    kind="own", web_workers=1, worker_concurrency=1)  # fmt: skip
    say(f"seed {seed}: {args.devices} devices; database {server.dbname}; log {log}")
    try:
        server.start()
        say(f"server ready in {server.wait_ready(180):.1f}s at {server.base_url}")
        api, setup = set_up(server, program, args.devices, say)
        devices = [SensorDevice(data=d, home=workdir / "agents" / f"device-{d.index:02d}", cohort=COHORT, wrap=True,
                                per_batch=args.batch, feed_seconds=args.feed_seconds)
                   for d in sensor_split(seed, args.devices)]  # fmt: skip
        for d in devices:
            say(f"  {d.name}: {len(d.data.train['y'])} windows, test {len(d.data.test['y'])}, {d.data.describe()}")
        _, minutes = asyncio.run(run_fleet(devices, server.base_url, setup["tokens"], api, ADAPTER, args))

        versions = {v["number"]: v for v in api.versions(ADAPTER)}
        rounds, deltas = api.rounds(ADAPTER), api.deltas(ADAPTER)
        say("measuring every device's models on its held-out test windows")
        models = Models(devices[0].home, workdir / "data" / "blobs")
        v1_tensors = models.version_tensors(versions[1]["blob_sha256"])
        newest = max((v for v in versions.values() if v["state"] == "released"), key=lambda v: v["number"])
        released = models.build(models.version_tensors(newest["blob_sha256"]))
        v1 = (v1_tensors, models.build(v1_tensors))
        rows = [measure_device(d, models, v1, released, seed, args.finetune_seeds) for d in devices]
        s = summary(rows)
        done = sum(1 for r in rounds if r.get("result_version"))
        names = {d.name: f"{d.data.index:02d}" for d in devices}
        print(f"\n### seed {seed}: rounds ({done} in {minutes:.1f} min; {len(deltas)} deltas, "
              f"{sum(x['state'] == 'rejected' for x in deltas)} rejected)\n")  # fmt: skip
        print(rounds_table(rounds, deltas, versions, lambda name: names.get(name, name)))
        print(f"\n### seed {seed}: devices (TEST accuracy, %; released = v{newest['number']})\n")
        print(devices_table(rows))
        print("\nsensors: " + "; ".join(f"{r['index']:02d} {r['view']}" for r in rows))
        print(f"\n### seed {seed}: summary over {len(rows)} devices (TEST accuracy, %)\n")
        print(summary_table(s, newest["number"]))
        return {
            "seed": seed, "minutes": round(minutes, 2), "rounds_done": done, "summary": s, "devices": rows,
            "setup": {k: v for k, v in setup.items() if k != "tokens"}, "versions": list(versions.values()),
            "rounds": rounds, "deltas": deltas, "server_log_problems": server.log_problems(0),
            "seconds_total": round(time.monotonic() - wall, 1),
        }  # fmt: skip
    finally:
        server.stop()
        server.drop_database()
        server.delete_redis_keys()
        if args.keep:
            say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv=None) -> int:
    from bench.own_model_cost import cost_table, measure, write_models

    args = parse(argv)
    parts = {p.strip() for p in args.parts.split(",")}
    result = {"args": vars(args), "cost": None, "seeds": []}
    folder = Path(tempfile.mkdtemp(prefix="own-model-programs-"))
    try:
        paths = write_models(folder)
        if "cost" in parts:
            say(f"training cost: 2 models x LoRA / full, {args.repeats} repeat(s), each in a fresh process")
            result["cost"] = measure(paths, args.repeats, say)
            print("\n### training cost on this CPU (medians; in brackets LoRA / full fine-tuning of the same model)\n")
            print(cost_table(result["cost"]))
        if "fleet" in parts:
            program = paths["sensor"].read_bytes()
            result["seeds"] = [one_seed(int(s), args, program) for s in args.seeds.split(",") if s.strip()]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / "own_model.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
