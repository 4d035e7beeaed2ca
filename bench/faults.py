"""Faults during live traffic, and proof that nothing is lost.

    nice -n 10 .venv/bin/python bench/faults.py                       # every fault, one after the other
    nice -n 10 .venv/bin/python bench/faults.py --faults redis,cut    # a subset

What it does:

1. Starts the product's embedded PostgreSQL and Redis (``fleet/devstack.py``) in a temporary folder of its own
   (``bench/fleetsim/services.py``), so it can stop and start them; the machine's PostgreSQL and Redis are not
   touched. Then the product with its real launcher (``python -m fleet.launcher run --no-demo``, web + Celery
   worker + beat) pointed at them (``bench/fleetsim/server.py``).
2. Provisions a cohort, a base model and an adapter (fedavg, ``--buffer-size`` deltas per round, a 15 s round
   deadline so the last deltas of a fault close a round too), enrolls ``--agents`` simulated agents
   (``bench/fleetsim/ingest_agent.py``: the signed hello, heartbeats, resumable chunked uploads over the socket,
   reconnect with the edge agent's backoff) and lets them upload ``--rate`` deltas/s of ``--delta-kb`` KiB,
   sent in ``--chunk-kb`` chunks so that an upload is several chunks long.
3. One fault after the other on the same server and fleet (``--faults``): ``--before`` seconds of traffic,
   the fault (``bench/fleetsim/fault_inject.py``), ``--after`` seconds of traffic once it is over, then no new
   uploads and a wait (up to ``--settle``) until nothing is in motion: no upload in flight, no delta
   ``received`` or ``accepted`` and not yet aggregated, no round aggregating. Then the checks of
   ``bench/fleetsim/fault_checks.py`` on the database: every delta an agent was told was accepted during that
   fault is counted in exactly one round exactly once, none lost, no round stuck, none left ``received``;
   every agent connected again by itself; the uploads the fault interrupted were resumed or retried and
   counted once.
4. Prints progress, a Markdown table (one row per fault) with details, and writes ``bench/results/faults.json``;
   the launcher's output goes to ``bench/results/faults_launcher.log``.

This script holds the options, the whole run's report and the entry point; the run itself (steps 1 to 3, and
each fault's verdict) is ``FaultRun`` in ``bench/faults_run.py``, the table and details ``bench/faults_report.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

from bench.faults_report import render_details, render_table  # noqa: E402
from bench.faults_run import FaultRun  # noqa: E402
from bench.fleetsim import RESULTS_DIR, say  # noqa: E402
from bench.fleetsim.stats import fmt  # noqa: E402

RESULTS_JSON = RESULTS_DIR / "faults.json"
ALL_FAULTS = ("redis", "postgres", "worker", "worker-main", "web", "web-main", "cut")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default="all", help=f"comma-separated, in this order: {','.join(ALL_FAULTS)}")
    parser.add_argument("--agents", type=int, default=300)
    parser.add_argument("--rate", type=float, default=10.0, help="uploads started per second, all agents together")
    parser.add_argument("--delta-kb", type=float, default=64.0, help="delta size, KiB of float32 values")
    parser.add_argument("--chunk-kb", type=int, default=16, help="bytes per chunk frame, KiB (the agent sends 256)")
    parser.add_argument("--buffer-size", type=int, default=20, help="adapter's round buffer size K")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds of traffic before the first fault")
    parser.add_argument("--before", type=float, default=15.0, help="seconds of traffic before each fault")
    parser.add_argument("--after", type=float, default=45.0, help="seconds of traffic after each fault is over")
    parser.add_argument("--downtime", type=float, default=10.0, help="seconds Redis / PostgreSQL stay down")
    parser.add_argument("--settle", type=float, default=300.0, help="longest wait for a fault's uploads to settle")
    parser.add_argument("--cut", type=int, default=60, help="agents whose socket is cut mid-upload (cut fault)")
    parser.add_argument("--redis-stop", choices=("term", "kill"), default="term")
    parser.add_argument("--postgres-stop", choices=("fast", "immediate"), default="fast")
    parser.add_argument("--rescue-seconds", type=int, default=30, help="server's DELTA_VERIFY_RESCUE_SECONDS")
    parser.add_argument(
        "--round-rescue-seconds", type=int, default=30, help="server's ROUND_AGGREGATION_RESCUE_SECONDS"
    )
    parser.add_argument("--interval", type=int, default=30, help="heartbeat seconds (sent to the server)")
    parser.add_argument("--backoff-cap", type=float, default=30.0, help="agents' reconnect backoff cap, seconds")
    parser.add_argument("--result-timeout", type=float, default=20.0, help="ask for an outcome not pushed by then")
    parser.add_argument("--ramp-rate", type=float, default=100.0, help="new connections per second at the start")
    parser.add_argument("--web-workers", type=int, default=2)
    parser.add_argument("--worker-concurrency", type=int, default=2)
    parser.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE", help="repeatable")
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    parser.add_argument("--output", type=Path, default=RESULTS_JSON)
    args = parser.parse_args(argv)
    names = ALL_FAULTS if args.faults == "all" else tuple(f.strip() for f in args.faults.split(",") if f.strip())
    unknown = [f for f in names if f not in ALL_FAULTS]
    if unknown or not names:
        parser.error(f"unknown fault(s) {unknown}: choose from {', '.join(ALL_FAULTS)}")
    args.fault_names = list(names)
    try:
        args.server_env_vars = dict(item.split("=", 1) for item in args.server_env)
    except ValueError:
        parser.error("--server-env takes NAME=VALUE")
    return args


async def main_async(args: argparse.Namespace, command_line: str) -> int:
    from bench.fleetsim.loop_health import tune_gc

    run = FaultRun(args)
    started = time.monotonic()
    error = None
    try:
        tune_gc()
        await run.run()
    except (KeyboardInterrupt, asyncio.CancelledError):
        error = "interrupted"
        say("interrupted; cleaning up")
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        say(f"failed: {error}")
    finally:
        await run.close()
    elapsed = time.monotonic() - started
    report = {
        "benchmark": "faults",
        "command": command_line,
        "launcher_command": shlex.join(run.server.command) if run.server else None,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "elapsed_seconds": elapsed,
        "error": error,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "delta_bytes": getattr(run, "delta_bytes", None),
        "setup": run.setup,
        "faults": run.results,
        "final": getattr(run, "final", None),
        "agent_errors_whole_run": dict(Counter(kind for _, kind in run.stats.errors)) if hasattr(run, "stats") else {},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str))
    print()
    print(f"Command: `{command_line}`")
    if run.server:
        print(f"Server: `{shlex.join(run.server.command)}` on embedded PostgreSQL and Redis of its own")
    print()
    if run.results:
        print(render_table(run.results, args.agents))
        print()
        print(render_details(run.results))
        print()
    print(
        f"{args.agents} agents, {args.rate:g} uploads/s of {fmt((report['delta_bytes'] or 0) / 1024, 0)} KiB in "
        f"{args.chunk_kb} KiB chunks, K={args.buffer_size}; {args.before:g}s of traffic before each fault and "
        f"{args.after:g}s after it. Whole run: {elapsed:.0f}s."
    )
    print(f"JSON: {args.output}")
    failed = [r["fault"] for r in run.results if r["verdict"] != "PASS"]
    if error or failed:
        print(f"ERROR: {error}" if error else f"FAILED: {', '.join(failed)}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from bench.fleetsim.loop_health import run_main

    return run_main(main_async, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
