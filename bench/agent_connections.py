"""Agent connections: how many simulated edge agents the real server holds at once, and how it answers them.

    .venv/bin/python bench/agent_connections.py --connections 10000

What it does (bench/README.md, "agent_connections.py", with the measured figures):

1. Starts the whole product with the real launcher (``python -m fleet.launcher run --no-demo``) in a
   subprocess, on the machine's PostgreSQL (a fresh ``fleet_bench_conn_<random>`` database, created by the
   launcher) and Redis (a unique ``REDIS_PREFIX``), and waits for ``/readyz``.
2. Creates the devices straight in that database (a small Django script in a subprocess): one cohort and N
   active devices, each with a fresh Ed25519 key. The keys go to a temp JSON file for the load generator.
3. Runs two phases: a baseline with few connections (the round-trip floor of this machine and this server,
   measured in the same run), then the target. In each, load-generator processes (asyncio + ``websockets``,
   no Django) open the connections at a fixed rate, speak the real protocol (challenge, signed hello,
   welcome), then heartbeat every ``interval * uniform(0.9, 1.1)`` seconds with the first heartbeat at a
   random offset, so beats are spread out. Round trips (heartbeat seq N sent -> heartbeat_ack seq N
   received) are recorded only in the steady-state window after the ramp.
4. Measures the server's RSS (uvicorn and its workers) idle before the phase and at the end of the steady
   window, the CPU used by the server, the Celery worker and the generators in that window, and whether
   every socket's presence entry in Redis is gone after the generators drop all connections at once.
5. Prints a Markdown table and the command line, writes ``bench/results/agent_connections.json``, keeps the
   launcher's output in ``bench/results/agent_connections_launcher.log``, then stops the launcher with
   SIGINT, drops the database and deletes its own Redis keys, also on failure.

The generators tune their own garbage collector the way ``fleet/asgi.py`` tunes the server's, and measure
their own event-loop lag, so a stall on the client side is reported instead of showing up as server latency.

Code: ``bench/fleetsim/`` (``server``, ``generator``, ``connections``, ``agent``, ``resources``, ``stats``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

from bench.fleetsim import RESULTS_DIR, say  # noqa: E402
from bench.fleetsim.connections import create_devices, render_details, render_table, run_phase  # noqa: E402
from bench.fleetsim.resources import raise_open_file_limit  # noqa: E402
from bench.fleetsim.server import Server  # noqa: E402

RESULTS_JSON = RESULTS_DIR / "agent_connections.json"
LAUNCHER_LOG = RESULTS_DIR / "agent_connections_launcher.log"
GENERATOR_LOG = RESULTS_DIR / "agent_connections_generator.log"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=10_000, help="target concurrent agents (big phase)")
    parser.add_argument("--baseline-connections", type=int, default=100, help="agents in the baseline phase (0: none)")
    parser.add_argument("--interval", type=int, default=30, help="heartbeat interval, seconds (sent to the server)")
    parser.add_argument("--hold", type=float, default=120.0, help="steady-state seconds after the ramp")
    parser.add_argument("--baseline-hold", type=float, default=None, help="steady seconds for the baseline (--hold)")
    parser.add_argument("--ramp-rate", type=float, default=400.0, help="new connections per second, all generators")
    parser.add_argument("--web-workers", type=int, default=2, help="uvicorn worker processes")
    parser.add_argument(
        "--generator-procs", type=int, default=2, help="load-generator processes (the machine has two cores)"
    )
    parser.add_argument(
        "--compression",
        choices=("deflate", "none"),
        default="deflate",
        help="permessage-deflate offered by the clients; 'deflate' is what edge_agent does (websockets default)",
    )
    parser.add_argument("--handshake-timeout", type=float, default=30.0)
    parser.add_argument("--ack-timeout", type=float, default=10.0, help="a heartbeat unanswered this long is lost")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of quiet before each phase")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="wait for presence cleanup after a phase")
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--output", type=Path, default=RESULTS_JSON)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command_line = shlex.join([Path(sys.executable).as_posix(), *sys.argv])
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    nofile = raise_open_file_limit()
    started = time.monotonic()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)

    workdir = Path(tempfile.mkdtemp(prefix="fleet-bench-conn-"))
    server = Server(
        workdir=workdir,
        database_url=args.database_url,
        redis_url=args.redis_url,
        log_path=LAUNCHER_LOG,
        kind="conn",
        web_workers=args.web_workers,
        worker_concurrency=1,
        env={"HEARTBEAT_INTERVAL_SECONDS": str(args.interval)},
    )
    phases: list[dict] = []
    error: str | None = None
    generator_log = open(GENERATOR_LOG, "w")  # noqa: SIM115
    report: dict = {}
    try:
        say(f"launcher: {shlex.join(server.command)} (log: {LAUNCHER_LOG.relative_to(BASE_DIR)})")
        say(f"database {server.dbname}, REDIS_PREFIX {server.prefix}, port {server.port}, RLIMIT_NOFILE {nofile}")
        server.start()
        ready_seconds = server.wait_ready(args.ready_timeout)
        say(f"server ready in {ready_seconds:.1f}s")

        keys_file = workdir / "devices.json"
        total = args.connections + max(0, args.baseline_connections)
        create_seconds = create_devices(server, total, keys_file)
        say(f"created {total} active devices with fresh Ed25519 keys in {create_seconds:.1f}s")

        plan = []
        if args.baseline_connections > 0:
            hold = args.baseline_hold if args.baseline_hold is not None else args.hold
            plan.append(("baseline", args.baseline_connections, args.connections, hold))
        plan.append(("target", args.connections, 0, args.hold))
        for name, connections, first_device, hold in plan:
            phases.append(
                run_phase(
                    name=name,
                    connections=connections,
                    first_device=first_device,
                    hold=hold,
                    args=args,
                    server=server,
                    keys_file=keys_file,
                    workdir=workdir,
                    generator_log=generator_log,
                )
            )
    except KeyboardInterrupt:
        error = "interrupted"
        say("interrupted; cleaning up")
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        say(f"failed: {error}")
    finally:
        generator_log.close()
        server.stop()
        server.drop_database()
        with contextlib.suppress(Exception):
            deleted = server.delete_redis_keys()
            say(f"stopped the server, dropped {server.dbname}, deleted {deleted} Redis keys under {server.prefix}:")
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)

    elapsed = time.monotonic() - started
    report = {
        "benchmark": "agent_connections",
        "command": command_line,
        "launcher_command": shlex.join(server.command),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "elapsed_seconds": elapsed,
        "error": error,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "rlimit_nofile": nofile},
        "phases": phases,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))

    print()
    print(f"Command: `{command_line}`")
    print()
    if phases:
        print(render_table(phases))
        print()
        print(render_details(phases))
        print()
    print(
        f"CPU % is of one core (this machine has {os.cpu_count()}; machine CPU % is of all of them, everything "
        f"running). KB/connection = (steady - idle RSS of uvicorn and its workers) / held. Round trips are "
        f"measured by the clients in the steady-state window only. Whole run: {elapsed:.0f} s."
    )
    print(f"JSON: {args.output}  launcher output: {LAUNCHER_LOG}")
    if error:
        print(f"ERROR: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
