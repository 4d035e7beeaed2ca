"""Dashboard at fleet scale: queries per page and server time, on a tiny fleet and on a fleet-sized database.

    .venv/bin/python bench/dashboard.py                        # 10,000 devices, 100,000 deltas, 1,000 versions
    .venv/bin/python bench/dashboard.py --runs 20 --explain    # + EXPLAIN ANALYZE of each page's slowest query

What it does (DESIGN.md, "Benchmarks: what the figures mean"; the issue: "with 10,000 devices, 100,000
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
``/system/`` pings the Celery workers (``fleet.health``); with no worker on this ``REDIS_PREFIX`` it waits
the full ping timeout (1.5 s), so its time is that timeout, not the page.
"""

from __future__ import annotations

import argparse
import hashlib
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


def _sha(*parts) -> str:
    return hashlib.sha256("-".join(str(p) for p in parts).encode()).hexdigest()


def _batched(model, rows, batch: int = 5000) -> list:
    created = []
    for start in range(0, len(rows), batch):
        created.extend(model.objects.bulk_create(rows[start : start + batch]))
    return created


COHORT_NAMES = ["eu-phones", "us-phones", "kiosks", "lab-boards", "apac-tablets", "fleet-cars"]
REJECTION_CODES = [
    ("norm_too_large", 40, "update norm 2.1e3 is above the bound 1000"),
    ("stale_base_version", 25, "base version is more than 5 behind"),
    ("bad_signature", 15, "envelope signature does not verify"),
    ("spec_mismatch", 10, "tensor lora_A of layer 3 has shape [8, 256], expected [8, 384]"),
    ("not_finite", 5, "NaN in lora_B of layer 1"),
    ("hash_mismatch", 5, "stored bytes do not match the envelope's sha256"),
]


def populate(sz: Sizes) -> dict:  # noqa: C901, PLR0912, PLR0915 (one linear script)
    """Fill the database with a fleet of the given size (deterministic: one seeded generator)."""
    import random
    from datetime import timedelta

    from django.db import connection
    from django.utils import timezone

    from accounts.models import User
    from devices.models import Cohort, Device, DeviceEvent, DeviceStatus, EnrollmentToken
    from training.models import (
        Adapter,
        AdapterVersion,
        Assignment,
        BaseModel,
        Delta,
        Rollout,
        Round,
        TrainingEvent,
    )

    rng = random.Random(20240601)
    now = timezone.now()
    hour, day = timedelta(hours=1), timedelta(days=1)

    admin = User.objects.create_user("bench-admin", email="admin@example.com", role="admin")
    User.objects.create_user("bench-operator", role="operator")
    User.objects.create_user("bench-viewer", role="viewer")

    names = [COHORT_NAMES[i] if i < len(COHORT_NAMES) else f"cohort-{i}" for i in range(sz.cohorts)]
    cohorts = Cohort.objects.bulk_create(
        Cohort(name=name, description=f"{name} fleet", created_at=now - 90 * day) for name in names
    )
    tokens = EnrollmentToken.objects.bulk_create(
        EnrollmentToken(
            cohort=cohorts[i % len(cohorts)],
            name=f"{cohorts[i % len(cohorts)].name} line {i}",
            prefix=f"fet_{i:04d}",
            token_hash=_sha("token", i),
            uses_left=None if i % 3 else 100,
            expires_at=now + 30 * day if i % 4 else now - day,
            requires_approval=bool(i % 2),
            created_by=admin,
            created_at=now - (60 - i) * day,
            revoked_at=now - day if i % 5 == 4 else None,
        )
        for i in range(sz.tokens)
    )
    tokens_of = {c.pk: [t for t in tokens if t.cohort_id == c.pk] for c in cohorts}

    base = BaseModel.objects.create(
        name="minilm-l6",
        family="bert",
        weights_sha256=_sha("base"),
        weights_size=90_900_000,
        parameter_count=22_700_000,
        created_by=admin,
        created_at=now - 90 * day,
    )
    spec = {"base_model.model.encoder.layer.0.attention.self.query.lora_A.weight": {"shape": [8, 384], "dtype": "F32"}}
    adapters = [
        Adapter.objects.create(
            name=name,
            base_model=base,
            rank=8,
            alpha=16,
            target_modules=["query", "value"],
            tensor_spec=spec,
            aggregation={"strategy": "fedavg", "params": {}},
            created_by=admin,
            created_at=now - 80 * day,
        )
        for name in ("assistant-lora", "keyboard-lora")
    ]
    # The last cohort trains the second adapter; the others the first.
    adapter_of_cohort = {
        c.pk: adapters[1] if i == len(cohorts) - 1 and len(cohorts) > 1 else adapters[0] for i, c in enumerate(cohorts)
    }
    for adapter in adapters:
        adapter.cohorts.set([c for c in cohorts if adapter_of_cohort[c.pk] == adapter] or cohorts[:1])

    # --- versions: a lineage per adapter, with a branch every 40 versions --------------------------------------
    n_first = max(2, round(sz.versions * 0.75))
    per_adapter = {adapters[0].pk: n_first, adapters[1].pk: max(2, sz.versions - n_first)}
    n_rounds_first = max(1, round(sz.rounds * 0.75))
    rounds_per_adapter = {adapters[0].pk: n_rounds_first, adapters[1].pk: max(1, sz.rounds - n_rounds_first)}
    versions: dict[int, list] = {}
    for adapter in adapters:
        n = per_adapter[adapter.pk]
        # The newest versions were made by the completed rounds (all rounds but the last 2 in progress/failed).
        by_rounds = min(n - 1, max(0, rounds_per_adapter[adapter.pk] - 3))
        rows = []
        for k in range(1, n + 1):
            if k == 1:
                source = AdapterVersion.Source.SEED
            elif k > n - by_rounds:
                source = AdapterVersion.Source.ROUND
            else:
                source = AdapterVersion.Source.IMPORT
            state = AdapterVersion.State.RELEASED
            if k % 25 == 0:
                state = AdapterVersion.State.REVOKED
            elif k > n - 2 and k > 2:
                state = AdapterVersion.State.CANDIDATE
            rows.append(
                AdapterVersion(
                    adapter=adapter,
                    number=k,
                    blob_sha256=_sha("version", adapter.pk, k),
                    size=120_000 + k,
                    source=source,
                    seed=k if source == AdapterVersion.Source.SEED else None,
                    note="" if k % 10 else f"checkpoint {k}",
                    metrics={
                        "eval_accuracy": round(0.55 + 0.4 * k / n + rng.uniform(-0.02, 0.02), 4),
                        "eval_loss": round(1.6 - 1.1 * k / n + rng.uniform(-0.03, 0.03), 4),
                        "eval_samples": 512,
                    },
                    state=state,
                    created_at=now - 60 * day + (k / n) * 59 * day,
                    created_by=admin,
                )
            )
        created = _batched(AdapterVersion, rows)
        for k, version in enumerate(created, start=1):
            if k > 1:
                version.parent = created[k - 4] if k % 40 == 0 and k > 3 else created[k - 2]
        AdapterVersion.objects.bulk_update(created[1:], ["parent"], batch_size=1000)
        versions[adapter.pk] = created

    released_of = {
        a.pk: [v for v in versions[a.pk] if v.state == AdapterVersion.State.RELEASED] or versions[a.pk]
        for a in adapters
    }

    def released(adapter) -> list:
        return released_of[adapter.pk]

    # --- devices and their events ------------------------------------------------------------------------------
    statuses = [DeviceStatus.ACTIVE] * 85 + [DeviceStatus.PENDING] * 5 + [DeviceStatus.QUARANTINED] * 4
    statuses += [DeviceStatus.RETIRED] * 6
    devices = []
    for i in range(sz.devices):
        cohort = cohorts[i % len(cohorts)]
        adapter = adapter_of_cohort[cohort.pk]
        good = released(adapter)
        status = DeviceStatus.ACTIVE if i == 0 else rng.choice(statuses)
        online = i == 0 or (status == DeviceStatus.ACTIVE and rng.random() < 0.6)
        draw = rng.random()
        if status == DeviceStatus.PENDING or draw < 0.08:
            running = None
        elif draw < 0.75:
            running = good[-1]
        else:
            running = good[max(0, len(good) - 1 - rng.randint(1, 5))]
        token = rng.choice(tokens_of[cohort.pk]) if tokens_of[cohort.pk] else None
        labels = {"site": "lab" if i == 0 else rng.choice(["lab", "field", "store"])}
        if rng.random() < 0.5:
            labels["tier"] = rng.choice(["gold", "silver"])
        enrolled = now - timedelta(days=rng.uniform(1, 60))
        devices.append(
            Device(
                name=f"{cohort.name}-{i:05d}",
                cohort=cohort,
                status=status,
                public_key=_sha("key", i)[:43],
                hardware={"ram_mb": rng.choice([2048, 4096, 8192]), "cpu": "arm64", "os": "android-14"},
                labels=labels,
                agent_version=rng.choice(["0.4.1", "0.4.2", "0.5.0"]),
                enrolled_at=enrolled,
                enrolled_with=token,
                last_seen_at=None
                if status == DeviceStatus.PENDING
                else now - timedelta(seconds=rng.uniform(0, 60) if online else rng.uniform(60, 7 * 86400)),
                online=online,
                battery_percent=round(rng.uniform(5, 100), 1),
                charging=rng.random() < 0.4,
                free_memory_mb=rng.randint(200, 3000),
                local_metrics={"eval_accuracy": round(rng.uniform(0.6, 0.9), 3)} if running else {},
                running_version=running,
                desired_version=good[-1] if status == DeviceStatus.ACTIVE else running,
            )
        )
    devices = _batched(Device, devices)
    busy = devices[0]  # the device-detail page shows this one: it gets the most deltas and events
    active = [d for d in devices if d.status == DeviceStatus.ACTIVE]
    active_of_adapter = {
        a.pk: [d for d in active if adapter_of_cohort[d.cohort_id] == a] or active or devices for a in adapters
    }

    kinds_after = {
        DeviceStatus.ACTIVE: "approved",
        DeviceStatus.PENDING: "updated",
        DeviceStatus.QUARANTINED: "quarantined",
        DeviceStatus.RETIRED: "retired",
    }
    events = []
    for device in devices:
        extra = (sz.deltas // 1000) if device is busy else 0
        for j in range(sz.events_per_device + extra):
            if j == 0:
                kind, actor, at = "enrolled", None, device.enrolled_at
            elif j == 1:
                kind, actor, at = kinds_after[device.status], admin, device.enrolled_at + hour
            else:
                kind, actor = ("online" if j % 2 else "offline"), None
                at = now - timedelta(seconds=rng.uniform(0, 2 * 86400))
            events.append(
                DeviceEvent(
                    device=device,
                    kind=kind,
                    actor=actor,
                    actor_label=actor.username if actor else ("device" if kind == "enrolled" else "system"),
                    detail={"token": "fet_0001"} if kind == "enrolled" else {},
                    created_at=at,
                )
            )
    _batched(DeviceEvent, events)
    del events

    # --- rounds, over the last 48 h per adapter ----------------------------------------------------------------
    rounds = []
    round_results = []  # (round index, version)
    for adapter in adapters:
        r = rounds_per_adapter[adapter.pk]
        chain = versions[adapter.pk]
        n_completed = min(len(chain) - 1, max(0, r - 3))
        window = 48 * hour / r
        for j in range(r):
            created = now - 48 * hour + j * window
            last = j == r - 1
            if last:
                state = Round.State.COLLECTING
            elif j < n_completed:
                state = Round.State.COMPLETED
            elif j == r - 2:
                state = Round.State.AGGREGATING
            else:
                state = Round.State.FAILED
            if state == Round.State.COMPLETED:
                result = chain[len(chain) - n_completed + j]
                base_version = chain[len(chain) - n_completed + j - 1]
            else:
                result, base_version = None, chain[-1]
            closed = None if last else created + window * 0.9
            rounds.append(
                Round(
                    adapter=adapter,
                    base_version=base_version,
                    strategy="fedavg",
                    params={},
                    buffer_size=500,
                    min_deltas=10,
                    deadline=created + 6 * hour,
                    state=state,
                    close_reason="" if last else "buffer_full",
                    failure="worker lost" if state == Round.State.FAILED else "",
                    attempts=0 if last else 1,
                    stats={"deltas": 480, "norm_mean": 0.42} if state == Round.State.COMPLETED else {},
                    opened_by=admin,
                    created_at=created,
                    closed_at=closed,
                    completed_at=closed + 2 * timedelta(minutes=1) if state == Round.State.COMPLETED else None,
                )
            )
            if result is not None:
                round_results.append((len(rounds) - 1, result))
    rounds = Round.objects.bulk_create(rounds)
    for index, version in round_results:
        version.round = rounds[index]
    AdapterVersion.objects.bulk_update([v for _, v in round_results], ["round"], batch_size=1000)
    collecting = next(r for r in rounds if r.adapter_id == adapters[0].pk and r.state == Round.State.COLLECTING)

    # --- deltas: spread over the rounds (and so over 48 h) -----------------------------------------------------
    codes = [code for code, weight, _ in REJECTION_CODES for _ in range(weight)]
    details = {code: detail for code, _, detail in REJECTION_CODES}
    counter = 0
    batch = []
    for g, round_ in enumerate(rounds):
        count = sz.deltas // len(rounds) + (1 if g < sz.deltas % len(rounds) else 0)
        start = round_.created_at
        end = round_.closed_at or now
        pool = active_of_adapter[round_.adapter_id]
        first = counter + 1
        for _ in range(count):
            counter += 1
            device = busy if counter % 200 == 0 else rng.choice(pool)
            at = start + (end - start) * rng.random()
            draw = rng.random()
            if draw < 0.08 or counter == first + 1:  # every round has a rejected delta, even a tiny one
                state, code = Delta.State.REJECTED, rng.choice(codes)
            elif round_.state == Round.State.COMPLETED:
                state, code = Delta.State.AGGREGATED, ""
            elif round_.state == Round.State.COLLECTING and draw > 0.96:
                state, code = Delta.State.RECEIVED, ""
            else:
                state, code = Delta.State.ACCEPTED, ""
            sha = _sha("delta", counter)
            batch.append(
                Delta(
                    device=device,
                    adapter_id=round_.adapter_id,
                    adapter_name=round_.adapter.name,
                    base_version_number=round_.base_version.number,
                    base_version=round_.base_version,
                    round=round_,
                    sha256=sha,
                    blob_sha256="" if code == "too_large" else sha,
                    size=4_200_000,
                    num_samples=rng.choice([32, 64, 128]),
                    counter=counter,
                    counter_claimed=code not in ("bad_signature", "hash_mismatch"),
                    envelope={"sha256": sha, "counter": counter, "adapter": round_.adapter.name},
                    signature=_sha("sig", counter)[:86],
                    metrics={"train_loss": round(rng.uniform(0.2, 1.2), 3)},
                    channel=Delta.Channel.WEBSOCKET if rng.random() < 0.9 else Delta.Channel.REST,
                    state=state,
                    rejection_code=code,
                    rejection_detail=details.get(code, ""),
                    staleness=rng.randint(0, 3),
                    norm=round(rng.uniform(0.1, 2.0), 3),
                    encoding="f32",
                    received_at=at,
                    verified_at=None if state == Delta.State.RECEIVED else at + timedelta(seconds=1),
                )
            )
            if len(batch) >= 5000:
                Delta.objects.bulk_create(batch)
                batch = []
    if batch:
        Delta.objects.bulk_create(batch)

    # --- rollouts and assignments ------------------------------------------------------------------------------
    phases = [
        {"percent": 10, "min_soak_seconds": 3600},
        {"percent": 50, "min_soak_seconds": 3600},
        {"percent": 100, "min_soak_seconds": 0},
    ]
    guards = [{"metric": "eval_accuracy", "min": 0.6, "min_reports": 10}]
    rollouts = []
    n_ro = sz.rollouts
    for j in range(n_ro):
        newest = j == n_ro - 1
        cohort = cohorts[0] if newest else cohorts[j % len(cohorts)]
        adapter = adapter_of_cohort[cohort.pk]
        good = released(adapter)
        version = good[min(len(good) - 1, int((j + 1) / n_ro * (len(good) - 1)))]
        if newest:
            state, phase = Rollout.State.RUNNING, 1
        elif j == n_ro - 2:
            state, phase = Rollout.State.PAUSED, 1
        elif j == n_ro - 3:
            state, phase = Rollout.State.DRAFT, 0
        elif j == n_ro - 4:
            state, phase = Rollout.State.ROLLED_BACK, 1
        else:
            state, phase = Rollout.State.COMPLETED, 2
        created = now - (n_ro - j) * 1.5 * day
        rollouts.append(
            Rollout(
                version=version,
                cohort=cohort,
                phases=phases,
                guards=guards,
                state=state,
                current_phase=phase,
                phase_started_at=None if state == Rollout.State.DRAFT else created + phase * 2 * hour,
                state_reason="guard breached: eval_accuracy 0.55 vs min 0.6" if state == "rolled_back" else "",
                created_at=created,
                created_by=admin,
                started_at=None if state == Rollout.State.DRAFT else created + timedelta(minutes=5),
                finished_at=created + day if state in ("completed", "rolled_back") else None,
            )
        )
    rollouts = Rollout.objects.bulk_create(rollouts)
    running = rollouts[-1]
    active_in = {c.pk: [d for d in active if d.cohort_id == c.pk] for c in cohorts}
    sendable = [r for r in rollouts if r.state != Rollout.State.DRAFT]
    share = {running.pk: min(len(active_in[running.cohort_id]), sz.assignments // 4 or 1)}
    others = [r for r in sendable if r.pk != running.pk]
    for r in others:
        share[r.pk] = min(len(active_in[r.cohort_id]), (sz.assignments - share[running.pk]) // max(1, len(others)))
    if not others:
        share[running.pk] = min(len(active_in[running.cohort_id]), sz.assignments)
    seq_of: dict = {}
    states_by_rollout = {
        Rollout.State.COMPLETED: ["installed"] * 90 + ["failed"] * 3 + ["superseded"] * 7,
        Rollout.State.RUNNING: ["pending"] * 30 + ["delivered"] * 20 + ["installed"] * 45 + ["failed"] * 5,
        Rollout.State.PAUSED: ["pending"] * 20 + ["delivered"] * 10 + ["installed"] * 55 + ["failed"] * 15,
        Rollout.State.ROLLED_BACK: ["superseded"] * 80 + ["failed"] * 20,
    }
    assignments = []
    for rollout in sendable:  # oldest first, so seq grows with time per device
        chosen = rng.sample(active_in[rollout.cohort_id], share[rollout.pk])
        for device in chosen:
            seq_of[device.pk] = seq_of.get(device.pk, 0) + 1
            state = rng.choice(states_by_rollout[rollout.state])
            at = rollout.started_at + timedelta(minutes=rng.uniform(0, 600))
            assignments.append(
                Assignment(
                    device=device,
                    rollout=rollout,
                    phase=rng.randint(0, rollout.current_phase),
                    version=rollout.version,
                    previous_version=device.running_version,
                    seq=seq_of[device.pk],
                    state=state,
                    reason="install failed: out of memory" if state == "failed" else "",
                    metrics={"eval_accuracy": round(rng.uniform(0.6, 0.92), 3)} if state == "installed" else {},
                    created_at=at,
                    delivered_at=at + timedelta(seconds=5) if state != "pending" else None,
                    reported_at=at + timedelta(minutes=3) if state in ("installed", "failed") else None,
                )
            )
    _batched(Assignment, assignments)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE devices_device d SET assignment_seq = s.m FROM "
            "(SELECT device_id, max(seq) AS m FROM training_assignment GROUP BY device_id) s WHERE d.id = s.device_id"
        )

    # --- training events (the audit trail) ---------------------------------------------------------------------
    tevents = []
    for adapter in adapters:
        tevents.append(
            TrainingEvent(
                kind="adapter.created",
                actor=admin,
                actor_label=admin.username,
                adapter=adapter,
                detail={"rank": 8},
                created_at=adapter.created_at,
            )
        )
        for v in versions[adapter.pk]:
            tevents.append(
                TrainingEvent(
                    kind="version.created",
                    actor=None if v.source == "round" else admin,
                    actor_label="system" if v.source == "round" else admin.username,
                    adapter=adapter,
                    version=v,
                    detail={"source": v.source},
                    created_at=v.created_at,
                )
            )
    for r in rounds:
        tevents.append(
            TrainingEvent(
                kind="round.opened",
                actor=admin,
                actor_label=admin.username,
                adapter_id=r.adapter_id,
                detail={"round": r.pk},
                created_at=r.created_at,
            )
        )
        if r.closed_at:
            tevents.append(
                TrainingEvent(
                    kind="round.closed",
                    actor=None,
                    actor_label="system",
                    adapter_id=r.adapter_id,
                    detail={"round": r.pk, "reason": "buffer_full"},
                    created_at=r.closed_at,
                )
            )
    for r in rollouts:
        kinds = ["rollout.created"]
        if r.started_at:
            kinds += ["rollout.started"] + ["rollout.phase"] * r.current_phase
        if r.state in ("completed", "rolled_back", "paused"):
            kinds.append(f"rollout.{r.state}")
        for i, kind in enumerate(kinds):
            tevents.append(
                TrainingEvent(
                    kind=kind,
                    actor=admin if i < 2 else None,
                    actor_label=admin.username if i < 2 else "system",
                    adapter=r.version.adapter,
                    version=r.version,
                    detail={"rollout": r.pk},
                    created_at=r.created_at + i * hour,
                )
            )
    _batched(TrainingEvent, tevents)

    return {
        "admin": admin,
        "device": busy.pk,
        "cohort": cohorts[0].name,
        "version": released(adapters[0])[-1].pk,
        "adapter": adapters[0].pk,
        "round": collecting.pk,
        "rollout": running.pk,
    }


def vacuum_analyze() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")


def table_counts() -> dict[str, int]:
    from devices.models import Cohort, Device, DeviceEvent, EnrollmentToken
    from training.models import AdapterVersion, Assignment, Delta, Rollout, Round, TrainingEvent

    models = {
        "cohorts": Cohort,
        "devices": Device,
        "device events": DeviceEvent,
        "tokens": EnrollmentToken,
        "versions": AdapterVersion,
        "rounds": Round,
        "deltas": Delta,
        "rollouts": Rollout,
        "assignments": Assignment,
        "training events": TrainingEvent,
    }
    return {name: model.objects.count() for name, model in models.items()}


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
