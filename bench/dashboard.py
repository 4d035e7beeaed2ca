"""Dashboard at fleet scale: queries per page and server time, on a tiny fleet and on a fleet-sized database.

    .venv/bin/python bench/dashboard.py                        # 10,000 devices, 100,000 deltas, 1,000 versions
    .venv/bin/python bench/dashboard.py --runs 20 --explain    # + EXPLAIN ANALYZE of each page's slowest query

What it does (bench/README.md, "dashboard.py", with the measured figures; the issue: "with 10,000 devices, 100,000
deltas and 1,000 versions in the database, every page renders with a bounded number of queries and the
overview in under 150 ms server time"):

1. Makes two fresh PostgreSQL databases on the machine's server (``<prefix>_small`` and ``<prefix>``),
   runs ``manage.py migrate`` in each, and fills them with ``bulk_create`` from one generator at two sizes:
   a tiny fleet (the baseline: 10 devices, 30 deltas, 10 versions...) and the fleet-sized one (10,000
   devices with ~3 events each, 1 base model and 2 adapters with 1,000 versions in a lineage with branches,
   200 rounds, 100,000 deltas over 48 h, 20 rollouts with 10,000 assignments, training events). Both are
   ``VACUUM ANALYZE``d after loading, as a database in steady state would be (autovacuum).
2. In a child process per database (Django reads ``DATABASE_URL`` once), it renders every dashboard page with
   Django's test ``Client`` signed in as an admin (``force_login``), in-process: no HTTP server, so the time
   is the server's own (middleware, session, queries, template), measured around ``client.get``. Each page
   gets ``--warmup`` requests with the queries captured (``CaptureQueriesContext``: the count, and the SQL
   time of the slowest queries), then ``--runs`` timed requests with nothing captured (median and p95).
   ``/healthz`` (no query, no template) is the floor. ``DEBUG`` is off, as in production.
3. Prints a Markdown table (per page: queries small / large, median ms small / large, p95 ms large, the
   SQL time of one captured large request, and this process's own CPU time per large request, which other
   load on the machine inflates far less than wall time) and the command line, writes
   ``bench/results/dashboard.json`` (every time, the three slowest queries of each page, and with
   ``--explain`` the plan of the slowest), then drops both databases (unless ``--keep``) and deletes its
   Redis keys (a unique ``REDIS_PREFIX``).

The detail pages show the busiest rows of their kind, so the large run is the worst case: the device with
the most deltas and events, the adapter with the longest lineage (past the page's lineage limit), the
collecting round (~500 deltas), the running rollout on the largest cohort (~2,000 assignments).
``/system/`` pings the Celery workers (``core.health``); with no worker on this ``REDIS_PREFIX`` it waits
the full ping timeout (1.5 s), so its time is that timeout, not the page.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
RESULTS_DIR = BASE_DIR / "bench" / "results"
RESULTS_JSON = RESULTS_DIR / "dashboard.json"
OVERVIEW_TARGET_MS = 150.0


@dataclass
class Sizes:
    cohorts: int
    devices: int
    events_per_device: int
    tokens: int
    versions: int
    rounds: int
    deltas: int
    rollouts: int
    assignments: int


def say(message: str) -> None:
    print(f"[bench] {message}", flush=True)


# --- parent: databases, child runs, report -------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--deltas", type=int, default=100_000)
    parser.add_argument("--versions", type=int, default=1_000, help="adapter versions in all (3/4 on one adapter)")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--rollouts", type=int, default=20)
    parser.add_argument("--assignments", type=int, default=10_000)
    parser.add_argument("--cohorts", type=int, default=4)
    parser.add_argument("--small-devices", type=int, default=10, help="the baseline fleet (other sizes follow)")
    parser.add_argument("--warmup", type=int, default=2, help="requests per page with queries captured")
    parser.add_argument("--runs", type=int, default=10, help="timed requests per page")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each page, wait up to this long for the rest of the machine to use under half a core",
    )
    parser.add_argument("--explain", action="store_true", help="EXPLAIN ANALYZE each page's slowest query (large)")
    parser.add_argument("--postgres", default=os.environ.get("BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432"))
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--db-prefix", default="fleet_bench_dashboard")
    parser.add_argument("--keep", action="store_true", help="keep both databases (to EXPLAIN by hand)")
    parser.add_argument("--child", choices=("small", "large"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def sizes_for(args: argparse.Namespace) -> dict[str, Sizes]:
    large = Sizes(
        cohorts=args.cohorts,
        devices=args.devices,
        events_per_device=3,
        tokens=12,
        versions=args.versions,
        rounds=args.rounds,
        deltas=args.deltas,
        rollouts=args.rollouts,
        assignments=args.assignments,
    )
    n = args.small_devices
    small = Sizes(
        cohorts=args.cohorts,
        devices=n,
        events_per_device=3,
        tokens=3,
        versions=max(4, n),
        rounds=4,
        deltas=3 * n,
        rollouts=2,
        assignments=n,
    )
    return {"small": small, "large": large}


def _admin_connection(postgres: str):
    import psycopg

    return psycopg.connect(f"{postgres.rstrip('/')}/postgres", autocommit=True)


def create_database(postgres: str, name: str) -> None:
    with _admin_connection(postgres) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def drop_database(postgres: str, name: str) -> None:
    with _admin_connection(postgres) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def delete_redis_keys(url: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    for start in range(0, len(keys), 500):
        client.delete(*keys[start : start + 500])
    return len(keys)


def run_child(args: argparse.Namespace, phase: str, sizes: Sizes, database: str, redis_prefix: str) -> dict:
    env = {
        **os.environ,
        "DATABASE_URL": f"{args.postgres.rstrip('/')}/{database}",
        "REDIS_URL": args.redis_url,
        "REDIS_PREFIX": redis_prefix,
        "FLEET_ENV": "development",
        "DEBUG": "false",
        "DJANGO_SETTINGS_MODULE": "fleet.settings",
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = Path(handle.name)
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        phase,
        "--spec",
        json.dumps(asdict(sizes)),
        "--out",
        str(out),
        "--warmup",
        str(args.warmup),
        "--runs",
        str(args.runs),
        "--wait-idle",
        str(args.wait_idle),
    ] + (["--explain"] if args.explain and phase == "large" else [])
    try:
        subprocess.run(argv, env=env, cwd=BASE_DIR, check=True)
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)


def _fmt(value, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def render_table(results: dict) -> str:
    small, large = results["small"]["pages"], results["large"]["pages"]
    lines = [
        "| page | queries small | queries large | median ms small | median ms large | p95 ms large | SQL ms large "
        "| CPU ms large |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, row in large.items():
        base = small.get(key, {})
        flag = "" if base.get("queries") == row["queries"] else " ⚠"
        lines.append(
            f"| {row['label']} | {base.get('queries', '—')} | {row['queries']}{flag} | {_fmt(base.get('median_ms'))} | "
            f"{_fmt(row['median_ms'])} | {_fmt(row['p95_ms'])} | {_fmt(row['sql_ms'])} | {_fmt(row['cpu_ms'])} |"
        )
    return "\n".join(lines)


def verdict(results: dict) -> list[str]:
    small, large = results["small"]["pages"], results["large"]["pages"]
    overview = large["overview"]["median_ms"]
    unbounded = [row["label"] for key, row in large.items() if small.get(key, {}).get("queries") != row["queries"]]
    s = results["large"]["sizes"]
    return [
        f"Target (large: {s['devices']:,} devices, {s['deltas']:,} deltas, {s['versions']:,} versions): overview "
        f"median {overview:.1f} ms server time vs < {OVERVIEW_TARGET_MS:.0f} ms: "
        + ("**met**" if overview < OVERVIEW_TARGET_MS else "**missed**")
        + f" (p95 {large['overview']['p95_ms']:.1f} ms; /healthz floor {large['healthz']['median_ms']:.2f} ms).",
        "Queries bounded (same count on the tiny and the large database for every page): "
        + ("**yes**" if not unbounded else "**no**: " + ", ".join(unbounded))
        + f"; at most {max(row['queries'] for row in large.values())} per page.",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    command = shlex.join([".venv/bin/python", "bench/dashboard.py", *(sys.argv[1:] if argv is None else argv)])
    sizes = sizes_for(args)
    databases = {"small": f"{args.db_prefix}_small", "large": args.db_prefix}
    redis_prefix = f"bench-dashboard-{secrets.token_hex(4)}"
    results: dict = {}
    started = time.monotonic()
    try:
        for phase in ("small", "large"):
            say(f"{phase}: database {databases[phase]}, {asdict(sizes[phase])}")
            create_database(args.postgres, databases[phase])
            results[phase] = run_child(args, phase, sizes[phase], databases[phase], redis_prefix)
            results[phase]["database"] = databases[phase]
    finally:
        if args.keep:
            say(f"kept databases {', '.join(databases.values())}")
        else:
            for name in databases.values():
                drop_database(args.postgres, name)
        delete_redis_keys(args.redis_url, redis_prefix)
    table = render_table(results)
    lines = verdict(results)
    report = {
        "command": command,
        "warmup": args.warmup,
        "runs": args.runs,
        "elapsed_s": round(time.monotonic() - started, 1),
        "machine": {"cpus": os.cpu_count()},
        **results,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    RESULTS_JSON.write_text(json.dumps(report, indent=2, default=str))
    for phase in ("small", "large"):
        counts = results[phase]["counts"]
        say(
            f"{phase}: populated in {results[phase]['populate_s']:.1f} s: "
            + ", ".join(f"{value:,} {name}" for name, value in counts.items())
        )
    print()
    print(table)
    print()
    print(
        f"Server time = `client.get` in-process (Django test Client, admin session, DEBUG off), median and p95 "
        f"of {args.runs} after {args.warmup} warm-up requests (queries counted in the warm-up); SQL ms = the "
        f"summed query time of one captured large request (as the client waits for it); CPU ms = this process's "
        f"own CPU time per request, median (Django, templates, the driver: the part other load cannot inflate "
        f"much). ⚠ = query count differs small vs large."
    )
    for line in lines:
        print(line)
    for phase in ("small", "large"):
        pages = results[phase]["pages"].values()
        machine = statistics.median(row["machine_cores"] for row in pages)
        own = statistics.median(row["bench_process_cores"] for row in pages)
        print(
            f"Machine ({os.cpu_count()} cores) during the {phase} timed requests: median {machine:.2f} cores busy, "
            f"{own:.2f} of them this process (the rest: PostgreSQL and other users)."
        )
    print(f"\n`{command}`  ({report['elapsed_s']:.0f} s; results in {RESULTS_JSON.relative_to(BASE_DIR)})")
    return 0


# --- child: populate one database and measure the pages ------------------------------------------------------


def child_main(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(BASE_DIR))
    import django

    django.setup()
    from dashboard_data import populate, table_counts, vacuum_analyze
    from django.core.management import call_command

    sizes = Sizes(**json.loads(args.spec))
    t0 = time.monotonic()
    call_command("migrate", verbosity=0, interactive=False)
    migrate_s = time.monotonic() - t0
    t0 = time.monotonic()
    targets = populate(sizes)
    vacuum_analyze()
    populate_s = time.monotonic() - t0
    say(f"{args.child}: migrated in {migrate_s:.1f} s, populated + VACUUM ANALYZE in {populate_s:.1f} s")
    pages = measure(targets, warmup=args.warmup, runs=args.runs, explain=args.explain, idle=args.wait_idle)
    Path(args.out).write_text(
        json.dumps(
            {
                "sizes": asdict(sizes),
                "counts": table_counts(),
                "migrate_s": round(migrate_s, 1),
                "populate_s": round(populate_s, 1),
                "targets": {k: str(v) for k, v in targets.items() if k != "admin"},
                "pages": pages,
            },
            default=str,
        )
    )
    return 0


def pages_for(t: dict) -> list[tuple[str, str, str]]:
    """(key, label, url): the same pages on both databases (ids differ, the rows they point at are alike)."""
    return [
        ("healthz", "`/healthz` (floor)", "/healthz"),
        ("overview", "overview `/`", "/"),
        ("devices", "`/devices/`", "/devices/"),
        (
            "devices_filtered",
            "`/devices/` filtered (cohort, status, online, label)",
            f"/devices/?cohort={t['cohort']}&status=active&online=yes&label=site%3Dlab",
        ),
        ("devices_last_page", "`/devices/` last page", "/devices/?page=9999"),
        ("devices_version", "`/devices/?version=`", f"/devices/?version={t['version']}"),
        ("devices_search", "`/devices/?q=` (search)", "/devices/?q=0004"),
        ("device_detail", "device detail", f"/devices/{t['device']}/"),
        ("cohorts", "`/cohorts/`", "/cohorts/"),
        ("enrollment_tokens", "`/enrollment-tokens/`", "/enrollment-tokens/"),
        ("models", "`/models/`", "/models/"),
        ("adapter_detail", "adapter detail", f"/adapters/{t['adapter']}/"),
        ("rounds", "`/rounds/`", "/rounds/"),
        ("round_detail", "round detail (collecting)", f"/rounds/{t['round']}/"),
        (
            "round_detail_rejected",
            "round detail, rejected, last page",
            f"/rounds/{t['round']}/?state=rejected&page=9999",
        ),
        ("rollouts", "`/rollouts/`", "/rollouts/"),
        ("rollout_detail", "rollout detail (running)", f"/rollouts/{t['rollout']}/"),
        ("rollout_new", "`/rollouts/new/`", "/rollouts/new/"),
        ("api_tokens", "`/settings/api-tokens/`", "/settings/api-tokens/"),
        ("users", "`/settings/users/`", "/settings/users/"),
        ("system", "`/system/` (waits for the Celery ping)", "/system/"),
    ]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def machine_busy() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    times = os.times()
    return times.user + times.system


def wait_idle(limit: float) -> float:
    """Wait (at most ``limit`` seconds) until the machine, this process aside, used under half a core over 1 s."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit:
        busy, own = machine_busy(), own_cpu()
        time.sleep(1.0)
        if (machine_busy() - busy) - (own_cpu() - own) < 0.5:
            break
    return time.perf_counter() - started


class QueryTimer:
    """``connection.execute_wrapper``: each query's own time in ms, in execution order (finer than the
    millisecond-rounded times ``CaptureQueriesContext`` records)."""

    def __init__(self) -> None:
        self.ms: list[float] = []

    def __call__(self, execute, sql, params, many, context):
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            self.ms.append((time.perf_counter() - started) * 1000)


def measure(targets: dict, *, warmup: int, runs: int, explain: bool, idle: float) -> dict:
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    client = Client()
    client.force_login(targets["admin"])
    results = {}
    for key, label, url in pages_for(targets):
        waited = wait_idle(idle) if idle else 0.0
        counts, captured, timed = [], [], []
        for _ in range(max(1, warmup)):
            timer = QueryTimer()
            with CaptureQueriesContext(connection) as queries, connection.execute_wrapper(timer):
                response = client.get(url)
            if response.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.content[:500]!r}")
            counts.append(len(queries))
            captured, timed = list(queries.captured_queries), timer.ms
        times, cpu = [], []
        busy, own, wall = machine_busy(), own_cpu(), time.perf_counter()
        for _ in range(runs):
            started, started_cpu = time.perf_counter(), time.process_time()
            response = client.get(url)
            times.append((time.perf_counter() - started) * 1000)
            cpu.append((time.process_time() - started_cpu) * 1000)
            if response.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {response.status_code}")
        wall = time.perf_counter() - wall
        pairs = sorted(zip(timed, captured, strict=False), key=lambda pair: pair[0], reverse=True)
        row = {
            "label": label,
            "url": url,
            "queries": counts[-1],
            "queries_per_warmup": counts,
            "median_ms": round(statistics.median(times), 2),
            "p95_ms": round(_percentile(times, 0.95), 2),
            "min_ms": round(min(times), 2),
            "times_ms": [round(t, 2) for t in times],
            "cpu_ms": round(statistics.median(cpu), 2),
            "sql_ms": round(sum(timed), 2),
            "bytes": len(response.content),
            "waited_idle_s": round(waited, 1),
            "machine_cores": round((machine_busy() - busy) / wall, 2),
            "bench_process_cores": round((own_cpu() - own) / wall, 2),
            "slowest_queries": [{"ms": round(ms, 2), "sql": q["sql"][:3000]} for ms, q in pairs[:3]],
        }
        if explain and pairs and pairs[0][1]["sql"].lstrip().upper().startswith("SELECT"):
            with connection.cursor() as cursor:
                cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + pairs[0][1]["sql"])
                row["explain"] = "\n".join(line for (line,) in cursor.fetchall())
        results[key] = row
        say(
            f"  {label}: {row['queries']} queries, median {row['median_ms']:.1f} ms, SQL {row['sql_ms']:.1f} ms "
            f"(machine {row['machine_cores']:.1f} cores busy, this process {row['bench_process_cores']:.1f})"
        )
    return results


if __name__ == "__main__":
    sys.exit(main())
