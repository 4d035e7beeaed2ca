"""Live traffic for ``bench/faults.py``: the fleet simulator's agents (``ingest_agent``) connected the whole
run, uploading at a steady rate that can be paused (to let a fault's uploads settle and be checked) and
resumed; every 0.2 s the connections held are sampled (how long agents took to come back) and late outcomes
are asked for, as ``ingest_run``'s sweep does.

All times are ``time.perf_counter()``, the clock the agents' stats use.
"""

from __future__ import annotations

import asyncio
import random
import time

from bench.fleetsim.ingest_agent import IdlePool, IngestAgent, IngestStats
from bench.fleetsim.ingest_run import _ramp, _schedule


class Traffic:
    def __init__(self, agents: list[IngestAgent], stats: IngestStats, pool: IdlePool, *, rate: float, ramp_rate: float):
        self.agents, self.stats, self.pool = agents, stats, pool
        self.rate, self.ramp_rate = rate, ramp_rate
        self.stop = asyncio.Event()
        self.runs: list[asyncio.Task] = []
        self.skipped: list[float] = []
        self.samples: list[tuple[float, int]] = []  # (when, connections held)
        self.scheduler: asyncio.Task | None = None
        self.sweeper: asyncio.Task | None = None

    async def connect(self, timeout: float) -> float:
        """Connect every agent (ramped); seconds until all were connected."""
        started = time.monotonic()
        self.stats.recording = True
        self.sweeper = asyncio.create_task(self._sweep())
        ramp = asyncio.create_task(_ramp(self.agents, self.ramp_rate, self.stop, self.runs))
        deadline = started + timeout + len(self.agents) / self.ramp_rate
        while time.monotonic() < deadline and self.stats.connected < len(self.agents):
            await asyncio.sleep(0.2)
        await ramp
        if self.stats.connected < len(self.agents):
            raise RuntimeError(f"only {self.stats.connected} of {len(self.agents)} agents connected in time")
        return time.monotonic() - started

    def resume(self) -> None:
        if self.scheduler is None:
            self.scheduler = asyncio.create_task(_schedule(self.rate, self.pool, self.skipped))

    def pause(self) -> None:
        if self.scheduler is not None:
            self.scheduler.cancel()
            self.scheduler = None

    def in_flight(self) -> list[IngestAgent]:
        return [agent for agent in self.agents if agent.upload is not None]

    async def drain(self, timeout: float) -> int:
        """Wait (up to ``timeout``) until no upload is in flight; how many still are."""
        deadline = time.monotonic() + timeout
        while self.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return len(self.in_flight())

    def burst(self, count: int, rng: random.Random, chunks: int) -> list[IngestAgent]:
        """Start ``count`` uploads at once on idle agents, each armed to lose its socket mid-upload (after 1 to
        ``chunks - 1`` of its chunks were sent)."""
        started = []
        for _ in range(count):
            agent = self.pool.pop_random()
            if agent is None:
                break
            agent.cut_after_chunks = rng.randint(1, max(1, chunks - 1))
            agent.start_upload()
            started.append(agent)
        return started

    def held(self, since: float, until: float = float("inf")) -> list[tuple[float, int]]:
        return [(at, held) for at, held in self.samples if since <= at <= until]

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            now = time.perf_counter()
            self.samples.append((now, self.stats.connected))
            for agent in self.agents:
                if agent.overdue(now):
                    agent.last_poll = now
                    agent._spawn(agent.poll())

    async def close(self) -> None:
        self.pause()
        if self.sweeper is not None:
            self.sweeper.cancel()
        self.stop.set()
        for task in self.runs:
            task.cancel()
        await asyncio.gather(*self.runs, return_exceptions=True)
        await asyncio.gather(*(agent.close() for agent in self.agents), return_exceptions=True)
