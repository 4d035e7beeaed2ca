"""Fleet simulator: thousands of enrolled agents in one process uploading signed deltas; the sustained ingest.

    .venv/bin/python bench/fleet_simulator.py --agents 2000 --rate 100 --delta-kb 300 --duration 75

What it does (bench/README.md, "fleet_simulator.py", with the measured figures):

1. Makes one real delta per agent before anything is timed (``bench/fleetsim/deltas.py``: valid safetensors for
   the adapter's tensor spec, about ``--delta-kb`` KiB of float32; every upload rewrites its last value and signs
   a fresh envelope with a new counter, so the server counts each as a new delta).
2. Baseline, same run: the same agents upload the same bytes at the same rate to a no-op server on the same
   transport (``bench/fleetsim/echo_server.py``: uvicorn with the product's flags, protocol answered, nothing
   stored or verified).
3. Starts the product (``python -m fleet.launcher run --no-demo``, scaled like ``make run``: 2 web processes,
   worker concurrency 2) on a fresh database on the machine's PostgreSQL and a fresh ``REDIS_PREFIX``, or uses
   ``--server`` with ``--admin-token``. Through the REST API with an admin token it creates a cohort, a base
   model of the ``bench.fleetsim.family:BenchLinear`` family sized so the adapter's deltas are ``--delta-kb``,
   an adapter (fedavg, ``buffer_size`` 100 so rounds close and aggregate during the run, a large ``max_norm``
   and ``max_staleness`` since the agents keep uploading against version 1), its first version and a
   pre-authorized enrollment token; every agent enrolls with its own Ed25519 key.
4. Per upload mode (``--upload ws,rest``), a phase: connect every agent (challenge, signed hello), heartbeat
   on jittered intervals, upload at ``--rate`` deltas/s in total (``ws``: delta_begin + 45,000-byte chunks on
   the socket; ``rest``: one PUT), ``--drop-fraction`` of the agents lose their socket during the window and
   come back with backoff (an upload in progress resumes). Each agent learns the verification outcome from the
   ``delta_result`` command pushed on its socket (or asks after ``--result-timeout``).
5. Reports the ingest rate (accepted outcomes inside the ``--duration`` window / its seconds), p50/p99 from the
   first byte sent to the verified outcome, errors by kind, connections held, CPU and RSS of the server's
   processes (uvicorn, Celery worker, our database's PostgreSQL backends, Redis) and of the simulator itself,
   and checks with the API that every accepted delta was counted in a round. ``--profile`` samples the web
   and worker processes with py-spy during the window. Prints a Markdown table, writes
   ``bench/results/fleet_simulator.json``, then stops the server, drops the database and its Redis keys.

Code: ``bench/fleetsim/`` (``ingest_agent``, ``ingest_run``, ``ingest_report``, ``provision``, ``deltas``,
``family``, ``echo_server``, ``http_client``, ``profiling``, and ``server`` / ``resources`` shared with
``agent_connections.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

from bench.fleetsim import RESULTS_DIR, say  # noqa: E402
from bench.fleetsim.ingest_report import render_details, render_table  # noqa: E402
from bench.fleetsim.provision import local_tensor_spec  # noqa: E402
from bench.fleetsim.resources import (  # noqa: E402
    listening_tree,
    processes_named,
    wait_for_quiet_machine,
)

RESULTS_JSON = RESULTS_DIR / "fleet_simulator.json"
LAUNCHER_LOG = RESULTS_DIR / "fleet_simulator_launcher.log"
ECHO_LOG = RESULTS_DIR / "fleet_simulator_echo.log"
PROFILE_DIR = RESULTS_DIR / "fleet_simulator_profiles"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=2000, help="simulated devices, all in this process")
    parser.add_argument(
        "--rate", default="100", help="uploads started per second, all agents together; a list (20,50,100) runs each"
    )
    parser.add_argument("--delta-kb", type=float, default=300.0, help="delta size, KiB of float32 values")
    parser.add_argument("--duration", type=float, default=75.0, help="measured seconds per phase")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds of uploads before the measurement")
    parser.add_argument("--drain", type=float, default=30.0, help="seconds for uploads in flight after the window")
    parser.add_argument("--upload", default="ws", help="ws, rest or both (ws,rest): one phase each")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the no-op server phases")
    parser.add_argument("--drop-fraction", type=float, default=0.1, help="agents whose socket is cut in the window")
    parser.add_argument("--interval", type=int, default=30, help="heartbeat seconds (sent to the server)")
    parser.add_argument("--ramp-rate", type=float, default=100.0, help="new connections per second at a phase start")
    parser.add_argument("--compression", choices=("none", "deflate"), default="none", help="permessage-deflate")
    parser.add_argument("--result-timeout", type=float, default=20.0, help="ask for an outcome not pushed by then")
    parser.add_argument("--backoff-cap", type=float, default=30.0, help="reconnect backoff cap, seconds")
    parser.add_argument("--handshake-timeout", type=float, default=30.0)
    parser.add_argument("--connect-timeout", type=float, default=60.0, help="extra seconds for all to connect")
    parser.add_argument("--family", choices=("bench", "digits-cnn"), default="bench", help="base model family")
    parser.add_argument("--buffer-size", type=int, default=100, help="adapter's round buffer size K")
    parser.add_argument("--max-norm", type=float, default=1e6, help="adapter's verification bound on the L2 norm")
    parser.add_argument("--web-workers", type=int, default=2, help="uvicorn processes (make run: 2 here)")
    parser.add_argument("--worker-concurrency", type=int, default=2, help="Celery worker pool (make run: 2 here)")
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for the product's processes (e.g. OMP_NUM_THREADS=1); repeatable",
    )
    parser.add_argument(
        "--enroll",
        choices=("api", "services"),
        default="services",
        help="api: POST /api/v1/enroll/ per agent; services: device_enroll in a Django script (own server only)",
    )
    parser.add_argument(
        "--wait-idle", type=float, default=0.0, help="before each phase, wait up to this long for a quiet machine"
    )
    parser.add_argument("--profile", action="store_true", help="py-spy the web and worker processes in the window")
    parser.add_argument(
        "--profile-waits", action="store_true", help="with --profile: count blocked threads too (py-spy --idle)"
    )
    parser.add_argument(
        "--profile-gil", action="store_true", help="with --profile: only the thread holding the GIL (py-spy --gil)"
    )
    parser.add_argument("--server", help="an already running server (http://host:port) instead of starting one")
    parser.add_argument("--admin-token", default=os.environ.get("FLEET_ADMIN_TOKEN"), help="with --server")
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--output", type=Path, default=RESULTS_JSON)
    args = parser.parse_args(argv)
    try:
        args.rates = [float(r) for r in str(args.rate).split(",") if r.strip()]
    except ValueError:
        parser.error("--rate takes numbers, e.g. 100 or 20,50,100")
    args.modes = ["ws", "rest"] if args.upload == "both" else [m.strip() for m in args.upload.split(",") if m.strip()]
    if not args.modes or any(m not in ("ws", "rest") for m in args.modes):
        parser.error("--upload takes ws, rest, both or ws,rest")
    try:
        args.server_env_vars = dict(item.split("=", 1) for item in args.server_env)
    except ValueError:
        parser.error("--server-env takes NAME=VALUE")
    if args.server and args.enroll == "services":
        args.enroll = "api"  # no database access to an already running server
    if args.server and not args.admin_token:
        parser.error("--server needs --admin-token (or FLEET_ADMIN_TOKEN): an admin's API token")
    return args


class Run:
    """The whole run: keys and deltas made once, then the phases, each on a fresh set of agent objects."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.phases: list[dict] = []
        self.server = None
        self.accepted_total = 0

    def prepare(self) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from bench.fleetsim.deltas import make_delta

        started = time.monotonic()
        self.spec = local_tensor_spec(self.args.family, self.args.delta_kb)
        self.keys = [Ed25519PrivateKey.generate() for _ in range(self.args.agents)]
        self.deltas = [make_delta(self.spec, index) for index in range(self.args.agents)]
        self.delta_bytes = len(self.deltas[0].data)
        say(
            f"made {len(self.deltas):,} deltas of {self.delta_bytes:,} bytes ({self.delta_bytes / 1024:.0f} KiB) and "
            f"keys in {time.monotonic() - started:.1f}s"
        )

    def agents(self, cfg, stats, pool, device_ids: list[str]) -> list:
        from bench.fleetsim.ingest_agent import IngestAgent

        return [
            IngestAgent(i, device_ids[i], self.keys[i], self.deltas[i], cfg, stats, pool)
            for i in range(self.args.agents)
        ]

    def config(self, mode: str, base_url: str, adapter: str, base_version: int):
        from bench.fleetsim.ingest_agent import IngestConfig

        a = self.args
        return IngestConfig(
            mode=mode,
            ws_url=base_url.replace("http://", "ws://", 1) + "/ws/agent/",
            base_url=base_url,
            adapter=adapter,
            base_version=base_version,
            interval=a.interval,
            handshake_timeout=a.handshake_timeout,
            compression=a.compression,
            result_timeout=a.result_timeout,
            backoff_cap=a.backoff_cap,
        )

    def plan(self, server: str, mode: str, rate: float):
        from bench.fleetsim.ingest_run import PhasePlan

        a = self.args
        return PhasePlan(
            name=f"{server}, {mode}",
            mode=mode,
            rate=rate,
            warmup=a.warmup,
            duration=a.duration,
            drain=a.drain,
            drop_fraction=a.drop_fraction,
            ramp_rate=a.ramp_rate,
            connect_timeout=a.connect_timeout,
        )

    async def phase(self, server, mode, rate, base_url, adapter, base_version, groups, **extra):
        from bench.fleetsim.ingest_agent import IdlePool, IngestStats
        from bench.fleetsim.ingest_run import ResourceWindow, run_phase

        if self.args.wait_idle > 0:
            await asyncio.to_thread(wait_for_quiet_machine, self.args.wait_idle, say)
        stats, pool = IngestStats(), IdlePool(random.Random(11))
        agents = self.agents(self.config(mode, base_url, adapter, base_version), stats, pool, extra["device_ids"])
        say(f"phase {server}, {mode}: {len(agents):,} agents, {rate:g} uploads/s")
        profiling = None
        if extra.get("profile_groups"):
            profiling = asyncio.create_task(self._profile(extra["profile_groups"], f"{mode}-{rate:g}", stats))
        result = await run_phase(self.plan(server, mode, rate), agents, stats, pool, ResourceWindow(groups))
        result.update(server=server, warmup_seconds=self.args.warmup, drain_seconds=self.args.drain)
        if profiling is not None:
            result["profile"] = await profiling
        say(
            f"phase {server}, {mode}: {result['ingest_per_second']:.1f} deltas/s accepted, p50 "
            f"{result['first_byte_to_verified_ms'].get('p50') or 0:.0f} ms, p99 "
            f"{result['first_byte_to_verified_ms'].get('p99') or 0:.0f} ms, "
            f"{sum(result['errors_in_window'].values())} errors, held >= {result['held_min']}"
        )
        self.phases.append(result)
        return result, stats

    async def _profile(self, groups, name: str, stats) -> dict:
        from bench.fleetsim import profiling

        while not stats.recording:  # start with the measured window, end with it
            await asyncio.sleep(0.2)
        files = await profiling.record(
            groups(),
            self.args.duration - 2,
            PROFILE_DIR / name,
            waits=self.args.profile_waits,
            gil=self.args.profile_gil,
        )
        return {name: profiling.fold(paths) for name, paths in files.items()}

    async def baselines(self) -> None:
        from bench.fleetsim.echo_server import EchoServer
        from bench.fleetsim.server import free_port

        for mode in self.args.modes:
            echo = EchoServer(
                port=free_port(),
                web_workers=self.args.web_workers,
                interval=self.args.interval,
                log_path=ECHO_LOG,
                base_dir=BASE_DIR,
            )
            echo.start()
            try:
                import psutil

                groups = lambda echo=echo: {"web": echo.processes(), "simulator": [psutil.Process()]}  # noqa: E731
                ids = [str(uuid.uuid4()) for _ in range(self.args.agents)]
                await self.phase("no-op", mode, max(self.args.rates), echo.base_url, "echo", 1, groups, device_ids=ids)
            finally:
                echo.stop()
            await asyncio.sleep(2)

    def start_server(self) -> tuple[str, str]:
        from bench.fleetsim.provision import ADMIN_SCRIPT
        from bench.fleetsim.server import Server

        a = self.args
        workdir = Path(tempfile.mkdtemp(prefix="fleet-bench-sim-"))
        self.workdir = workdir
        self.server = Server(
            workdir=workdir,
            database_url=a.database_url,
            redis_url=a.redis_url,
            log_path=LAUNCHER_LOG,
            kind="sim",
            web_workers=a.web_workers,
            worker_concurrency=a.worker_concurrency,
            env={
                "HEARTBEAT_INTERVAL_SECONDS": str(a.interval),
                "ENROLLMENT_RATE": "1000000/min",  # thousands of agents enroll from one address
                **a.server_env_vars,
            },
        )
        say(f"launcher: {shlex.join(self.server.command)} (log: {LAUNCHER_LOG.relative_to(BASE_DIR)})")
        say(f"database {self.server.dbname}, REDIS_PREFIX {self.server.prefix}, port {self.server.port}")
        self.server.start()
        say(f"server ready in {self.server.wait_ready(a.ready_timeout):.1f}s")
        out = self.server.run_django(ADMIN_SCRIPT, f"sim-admin-{self.server.run_id}", what="creating the admin")
        return self.server.base_url, out.strip().splitlines()[-1]

    def product_groups(self):
        import psutil

        server = self.server
        me = psutil.Process()
        if server is None:  # --server: the processes listening on its port, and their uvicorn supervisor
            return lambda: {"web": listening_tree(self.args.server), "simulator": [me]}

        def groups() -> dict:
            return {
                "web": server.web_processes(),
                "worker": server.worker_processes(),
                "beat": server.beat_processes(),
                "launcher": [psutil.Process(server.process.pid)],
                "postgres": processes_named("postgres", server.dbname),
                "redis": processes_named("redis-server"),
                "simulator": [me],
            }

        return groups

    def worker_profile_groups(self):
        server = self.server
        if server is None:
            return None
        return lambda: {"web": server.web_workers(), "worker": server.worker_processes()[1:]}

    async def product(self) -> None:
        from bench.fleetsim.http_client import Api
        from bench.fleetsim.provision import enroll_all, enroll_with_services, provision, server_totals

        a = self.args
        if a.server:
            base_url, token = a.server.rstrip("/"), a.admin_token
        else:
            base_url, token = self.start_server()
        api = Api(base_url, token)
        name = f"sim-{uuid.uuid4().hex[:8]}"
        aggregation = {
            "strategy": "fedavg",
            "buffer_size": a.buffer_size,
            "min_deltas": 2,
            "max_norm": a.max_norm,
            "max_staleness": 1_000_000,
        }
        setup = await provision(
            api, name=name, family=a.family, delta_kb=a.delta_kb, agents=a.agents, aggregation=aggregation
        )
        if setup.tensor_spec != self.spec:
            raise RuntimeError("the server's tensor spec differs from the one the deltas were made for")
        started = time.monotonic()
        if a.enroll == "api":
            ids = await enroll_all(base_url, setup.enrollment_token, self.keys)
        else:
            ids = await asyncio.to_thread(enroll_with_services, self.server, setup.enrollment_token, self.keys)
        say(
            f"adapter {setup.adapter} (K={a.buffer_size}); enrolled {len(ids):,} agents ({a.enroll}) in "
            f"{time.monotonic() - started:.1f}s"
        )
        self.setup = {"adapter": setup.adapter, "cohort": setup.cohort, "aggregation": aggregation}
        for mode in a.modes:
            for rate in a.rates:
                offset = self.server.log_offset() if self.server else None
                result, stats = await self.phase(
                    "product",
                    mode,
                    rate,
                    base_url,
                    setup.adapter,
                    setup.base_version,
                    self.product_groups(),
                    device_ids=ids,
                    profile_groups=self.worker_profile_groups() if a.profile else None,
                )
                self.accepted_total += sum(1 for c in stats.completions if c[3] in ("accepted", "aggregated"))
                await asyncio.sleep(3)  # rounds closed by the last deltas aggregate
                result["server_totals"] = await server_totals(api, setup.adapter)
                result["accepted_total"] = self.accepted_total
                if offset is not None:
                    result["log_problems"] = self.server.log_problems(offset)

    def stop_server(self) -> None:
        if self.server is None:
            return
        self.server.stop()
        self.server.drop_database()
        try:
            deleted = self.server.delete_redis_keys()
            say(
                f"stopped the server, dropped {self.server.dbname}, deleted {deleted} Redis keys under "
                f"{self.server.prefix}:"
            )
        except Exception as exc:
            say(f"could not delete the Redis keys under {self.server.prefix}: {exc}")
        shutil.rmtree(self.workdir, ignore_errors=True)


async def run(args: argparse.Namespace, command_line: str) -> int:
    from bench.fleetsim.loop_health import tune_gc

    simulation = Run(args)
    started = time.monotonic()
    error = None
    try:
        simulation.prepare()
        tune_gc()
        if args.baseline:
            await simulation.baselines()
        await simulation.product()
    except (KeyboardInterrupt, asyncio.CancelledError):
        error = "interrupted"
        say("interrupted; cleaning up")
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        say(f"failed: {error}")
    finally:
        simulation.stop_server()
    elapsed = time.monotonic() - started
    report = {
        "benchmark": "fleet_simulator",
        "command": command_line,
        "launcher_command": shlex.join(simulation.server.command) if simulation.server else None,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "elapsed_seconds": elapsed,
        "error": error,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count()},
        "delta_bytes": getattr(simulation, "delta_bytes", None),
        "setup": getattr(simulation, "setup", None),
        "phases": simulation.phases,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str))

    print()
    print(f"Command: `{command_line}`")
    if simulation.server:
        extra = " ".join(f"{k}={v}" for k, v in args.server_env_vars.items())
        print(
            f"Server: `{(extra + ' ') if extra else ''}{shlex.join(simulation.server.command)}` "
            f"({args.web_workers} web processes, worker concurrency {args.worker_concurrency}; `make run` on this "
            f"2-core machine: 2 and 2)"
        )
    print()
    if simulation.phases:
        print(render_table(simulation.phases))
        print()
        print(render_details(simulation.phases))
        print()
    delta_kib = f"{report['delta_bytes'] / 1024:.0f} KiB" if report["delta_bytes"] else "-"
    print(
        f"Deltas of {delta_kib}; ingest = uploads whose accepted outcome reached the agent inside the measured window, "
        f"per second (the API confirms each accepted delta was counted in a round). CPU % is of one core (this "
        f"machine has {os.cpu_count()}; machine CPU % is of all of them, everything running, other users' work "
        f"included); the simulator runs on the same cores. postgres = this database's backends only; redis = the "
        f"whole shared redis-server. Whole run: {elapsed:.0f} s."
    )
    print(f"JSON: {args.output}")
    if error:
        print(f"ERROR: {error}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from bench.fleetsim.loop_health import run_main

    return run_main(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
