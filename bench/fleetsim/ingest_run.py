"""One measured phase of the fleet simulator, on the event loop that runs every agent:

1. the agents connect (ramped at ``ramp_rate`` per second) and the phase waits for (nearly) all of them;
2. the scheduler starts uploads at ``rate`` per second in total, each on a random connected agent with no
   upload in progress (none free: the tick is counted as skipped), for ``warmup`` seconds unmeasured;
3. the measured window (``duration`` seconds): outcomes, errors, heartbeat round trips and connections held
   are recorded, a ``drop_fraction`` of the agents lose their socket at random moments, and the server's
   processes and this one are measured (``ResourceWindow``);
4. no new uploads; uploads in flight get ``drain`` seconds to finish; then every socket is closed.

Ingest rate = uploads whose accepted outcome arrived inside the window / window seconds. Latency = from the
first byte of the upload (``delta_begin`` sent, or the PUT's request line) to the outcome, for the same uploads.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass

from bench.fleetsim.ingest_agent import IdlePool, IngestAgent, IngestStats
from bench.fleetsim.loop_health import install_gc_probe, lag_monitor
from bench.fleetsim.resources import cpu_percent, cpu_seconds, machine_cpu, rss
from bench.fleetsim.stats import summary


@dataclass
class PhasePlan:
    name: str
    mode: str
    rate: float
    warmup: float
    duration: float
    drain: float
    drop_fraction: float
    ramp_rate: float
    connect_timeout: float


class ResourceWindow:
    """CPU (percent of one core) and RSS of named process groups over a window; ``groups()`` is called again
    at every sample, so processes that appear meanwhile (new database backends) are counted too."""

    def __init__(self, groups):
        self.groups = groups
        self.seen: dict[str, dict[int, object]] = {}
        self.cpu0: dict[str, dict[int, float]] = {}
        self.peak: dict[str, int] = {}

    def _refresh(self) -> None:
        for name, processes in self.groups().items():
            known = self.seen.setdefault(name, {})
            for process in processes:
                known.setdefault(process.pid, process)
            self.peak[name] = max(self.peak.get(name, 0), rss(list(known.values())))

    def begin(self) -> None:
        import psutil

        self._refresh()
        self.cpu0 = {name: cpu_seconds(list(known.values())) for name, known in self.seen.items()}
        self.system0, self.t0 = psutil.cpu_times(), time.monotonic()

    def sample(self) -> None:
        self._refresh()

    def end(self) -> dict:
        import psutil

        self._refresh()
        seconds = time.monotonic() - self.t0
        out = {"seconds": seconds, "machine_cpu_percent_of_all_cores": machine_cpu(self.system0, psutil.cpu_times())}
        for name, known in self.seen.items():
            processes = list(known.values())
            out[name] = {
                "processes": len(processes),
                "cpu_percent_of_core": cpu_percent(self.cpu0.get(name, {}), cpu_seconds(processes), seconds),
                "rss_mb_end": rss(processes) / 2**20,
                "rss_mb_peak": self.peak.get(name, 0) / 2**20,
            }
        ours = sum(entry["cpu_percent_of_core"] for entry in out.values() if isinstance(entry, dict))
        cores = psutil.cpu_count() or 1
        out["rest_of_machine_cpu_percent_of_core"] = max(0.0, out["machine_cpu_percent_of_all_cores"] * cores - ours)
        return out


class _CurrentStats:
    """The GC probe is installed once per process; it reports into whichever phase is running."""

    stats: IngestStats | None = None

    @property
    def recording(self) -> bool:
        return self.stats is not None and self.stats.recording

    @property
    def gc_pauses_ms(self) -> list[float]:
        return self.stats.gc_pauses_ms


_CURRENT = _CurrentStats()
_PROBE_INSTALLED = False


async def _ramp(agents: list[IngestAgent], rate: float, stop: asyncio.Event, tasks: list) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    for index, agent in enumerate(agents):
        delay = start + index / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(agent.run(stop)))


async def _schedule(rate: float, pool: IdlePool, skipped: list[float]) -> None:
    loop = asyncio.get_running_loop()
    period, next_at = 1.0 / rate, loop.time()
    while True:
        next_at += period
        delay = next_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        agent = pool.pop_random()
        if agent is None:
            skipped.append(time.perf_counter())
        else:
            agent.start_upload()


async def _sweep(agents: list[IngestAgent], stats: IngestStats, held: list, resources: ResourceWindow) -> None:
    """Twice a second: poll for late outcomes and count the connections held; every 5 s sample RSS."""
    ticks = 0
    while True:
        await asyncio.sleep(0.5)
        now = time.perf_counter()
        for agent in agents:
            if agent.overdue(now):
                agent.last_poll = now
                agent._spawn(agent.poll())
        if stats.recording:
            held.append(stats.connected)
            ticks += 1
            if ticks % 10 == 0:
                resources.sample()


async def _drops(agents: list[IngestAgent], count: int, seconds: float, rng: random.Random) -> int:
    done = 0
    moments = sorted(rng.uniform(0, seconds) for _ in range(count))
    started = time.monotonic()
    for at in moments:
        await asyncio.sleep(max(0.0, at - (time.monotonic() - started)))
        connected = [a for a in agents if a.socket is not None and not a.dropping]
        if connected and rng.choice(connected).drop():
            done += 1
    return done


async def run_phase(plan: PhasePlan, agents: list[IngestAgent], stats: IngestStats, pool: IdlePool, resources):
    global _PROBE_INSTALLED
    _CURRENT.stats = stats
    if not _PROBE_INSTALLED:
        install_gc_probe(_CURRENT)
        _PROBE_INSTALLED = True
    rng = random.Random(7)
    stop = asyncio.Event()
    runs: list[asyncio.Task] = []
    monitor = asyncio.create_task(lag_monitor(stats))
    connect_started = time.monotonic()
    ramp = asyncio.create_task(_ramp(agents, plan.ramp_rate, stop, runs))
    deadline = connect_started + plan.connect_timeout + len(agents) / plan.ramp_rate
    while time.monotonic() < deadline and stats.connected < 0.99 * len(agents):
        await asyncio.sleep(0.2)
    await ramp
    connect_seconds = time.monotonic() - connect_started
    connected_at_start = stats.connected

    skipped: list[float] = []
    held: list[int] = []
    scheduler = asyncio.create_task(_schedule(plan.rate, pool, skipped))
    sweeper = asyncio.create_task(_sweep(agents, stats, held, resources))
    await asyncio.sleep(plan.warmup)

    stats.recording = True
    t0 = time.perf_counter()
    resources.begin()
    dropper = asyncio.create_task(_drops(agents, round(plan.drop_fraction * len(agents)), plan.duration, rng))
    await asyncio.sleep(plan.duration)
    t1 = time.perf_counter()
    usage = resources.end()
    stats.recording = False
    drops_done = await dropper if dropper.done() else (dropper.cancel(), 0)[1]

    scheduler.cancel()
    drain_started = time.monotonic()
    while any(a.upload is not None for a in agents) and time.monotonic() - drain_started < plan.drain:
        await asyncio.sleep(0.2)
    unfinished = sum(a.upload is not None for a in agents)
    for task in (sweeper, monitor):
        task.cancel()
    stop.set()
    for task in runs:
        task.cancel()
    await asyncio.gather(*runs, return_exceptions=True)
    await asyncio.gather(*(a.close() for a in agents), return_exceptions=True)
    result = _result(
        plan, stats, t0, t1, usage, held, skipped, connect_seconds, connected_at_start, drops_done, unfinished
    )
    result["agents"] = len(agents)
    return result


def _result(plan, stats, t0, t1, usage, held, skipped, connect_seconds, connected_at_start, drops, unfinished):
    window = t1 - t0
    inside = [c for c in stats.completions if t0 <= c[2] <= t1]
    accepted = [c for c in inside if c[3] in ("accepted", "aggregated")]
    rejected = Counter(c[4] or c[3] for c in inside if c[3] == "rejected")
    return {
        "phase": plan.name,
        "mode": plan.mode,
        "offered_per_second": plan.rate,
        "window_seconds": window,
        "uploads_started_in_window": sum(1 for s in stats.started if t0 <= s <= t1),
        "ticks_skipped_no_idle_agent": sum(1 for s in skipped if t0 <= s <= t1),
        "accepted_in_window": len(accepted),
        "ingest_per_second": len(accepted) / window if window else None,
        "rejected_in_window": dict(rejected),
        "first_byte_to_verified_ms": summary([(c[2] - c[0]) * 1000 for c in accepted]),
        "first_byte_to_stored_ms": summary([(c[1] - c[0]) * 1000 for c in accepted]),
        "stored_to_verified_ms": summary([(c[2] - c[1]) * 1000 for c in accepted]),
        "outcome_learnt": dict(Counter(c[5] for c in inside)),
        "errors_in_window": dict(stats.error_counts(t0, t1)),
        "errors_whole_phase": dict(stats.error_counts()),
        "connect_seconds": connect_seconds,
        "connected_at_start": connected_at_start,
        "held": summary(held),
        "held_min": min(held, default=0),
        "drops": drops,
        "handshakes": stats.handshakes,
        "polls": stats.polls,
        "unfinished_after_drain": unfinished,
        "heartbeat_rtt_ms": summary([rtt for sent, rtt in stats.heartbeats if t0 <= sent <= t1]),
        "simulator_loop_lag_ms": summary(stats.lag_ms),
        "simulator_gc_pauses_ms": summary(stats.gc_pauses_ms),
        "resources": usage,
    }
