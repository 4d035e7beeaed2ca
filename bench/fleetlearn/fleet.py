"""Real agents, as ``demo/fleet_demo.py`` runs them (``_enroll``, ``_run_device``), fed by an application.

Each device enrolls over HTTP with its own key, connects over the WebSocket (``AgentConnection`` with the
``AssignmentHandler`` and ``OutboxUploads``), and trains with ``DeviceRuntime.train_once`` on the demo's local
settings (``DemoDevice.configure``: 3 epochs, lr 0.01, replay 0.25, 32 new samples to train, a pass every
8 s x U(0.8, 1.5), window 240, mains power), one training at a time across the fleet (the demo's gate). The one
difference: its samples come from the application (``data.kind = "app"``) through ``Agent(home).add_samples``,
once version 1 is installed, ``per_batch`` at a time every ``feed_seconds`` (x U(0.8, 1.5)). With ``wrap`` the
application hands them again and again as the demo's own source does (``SimulatedStream`` with ``wrap``, a
multiple of ``SPLIT_EVERY`` so a sample keeps its slice, a little fresh pixel noise on a repeat): a user who
keeps writing the same digits; without it, once. A device with fewer than ``SPLIT_EVERY`` samples hands them
once.

With ``correct`` (``fleet_learning.py --feed feedback``) the application hands no labelled sample: it asks the
served model (``Agent.predict``) about each sample as its user writes it, and the user corrects a wrong answer with
probability ``correct`` (``Agent.feedback`` with the right label) and says nothing otherwise; each batch, the served
model's accuracy on the device's TEST set is recorded in ``curve`` (the benchmark's eyes only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bench.fleetlearn.measure import as_tensors
from bench.fleetlearn.split import DeviceData
from edge_agent.api import Agent, NotReady
from edge_agent.assignments import AdapterStore, AssignmentHandler
from edge_agent.connection import AgentConnection, Backoff
from edge_agent.enroll import enroll
from edge_agent.families import get_family
from edge_agent.identity import STATE_FILE, AgentState, load_or_create_key
from edge_agent.rest import DeviceSession
from edge_agent.runtime import AgentConfig, DeviceRuntime
from edge_agent.samples import SPLIT_EVERY, SimulatedStream
from edge_agent.uploads import OutboxUploads

logger = logging.getLogger("bench.fleetlearn")
COHORTS = ("eu-phones", "us-wearables")  # demo.fleet_demo.COHORTS


@dataclass
class FleetDevice:
    data: DeviceData
    home: Path
    cohort: str
    wrap: bool
    per_batch: int
    feed_seconds: float
    handed: int = 0  # samples handed to the agent so far
    passes: int = 0
    uploads: int = 0
    discarded: int = 0
    failures: int = 0
    correct: float | None = None  # feedback alone: the share of wrong answers the user corrects
    answers: int = 0
    wrong: int = 0
    corrections: int = 0
    curve: list = field(default_factory=list)  # {"seconds", "answers", "corrections", "test_accuracy"} per batch
    started: float = 0.0

    @property
    def name(self) -> str:
        return f"bench-{self.data.index:02d}-{self.data.group}{'-small' if self.data.small else ''}"

    def stream(self) -> SimulatedStream:
        n = len(self.data.train["y"])
        wrap = self.wrap and n >= SPLIT_EVERY
        return SimulatedStream(self.data.train, per_poll=self.per_batch, seed=self.data.index, wrap=wrap,
                               multiple=SPLIT_EVERY)  # fmt: skip

    def app_samples(self, batch: dict) -> dict:
        """What the application hands ``Agent.add_samples`` of a batch from the stream: digits in [0, 1] (a repeat's
        fresh noise clipped back)."""
        return {"x": batch["x"].clip(0.0, 1.0), "y": batch["y"]}

    def held_samples(self) -> dict:
        """The distinct samples the agent holds (the stream's first pass: a repeat of one is the same digit)."""
        order = self.stream().order
        return {k: np.asarray(v)[np.sort(order)] for k, v in self.data.train.items()}

    def configure(self) -> AgentConfig:
        config = AgentConfig.load(self.home)
        config.data = {"kind": "app", "device_index": self.data.index}
        config.power = {"kind": "simulated", "level": 100.0, "charging": True, "seed": self.data.index}
        config.policy = {"min_new_samples": 32, "min_battery_percent": 30.0}
        config.train = {"epochs": 3, "lr": 0.01, "replay_ratio": 0.25}
        config.train_interval_seconds = 8.0
        config.train_window = 240
        config.save(self.home)
        return config


def _enroll(device: FleetDevice, server: str, token: str) -> AgentState:
    if (device.home / STATE_FILE).exists():
        return AgentState.load(device.home)
    for attempt in range(1, 7):
        try:
            return enroll(home=device.home, server=server, token=token, name=device.name,
                          labels={"bench": "fleet_learning", "user": device.data.group})  # fmt: skip
        except Exception as error:  # noqa: BLE001  (retried, the last raised)
            if attempt == 6:
                raise
            print(f"[bench] {device.name}: enrollment failed ({error}); retrying", flush=True)
            time.sleep(min(2.0**attempt, 30.0))
    raise AssertionError("unreachable")


async def _feed(device: FleetDevice, stop: asyncio.Event, rng: random.Random) -> None:
    """The application: waits for the first installed version (the schema), then hands samples over."""
    agent = Agent(device.home)
    stream = device.stream()
    while not stop.is_set():
        try:
            agent.schema()
            break
        except NotReady:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
    device.started = time.monotonic()
    while not stop.is_set():
        batch = stream.poll()
        if batch is None:
            return
        if device.correct is None:
            device.handed += agent.add_samples(device.app_samples(batch))
        else:
            x = batch["x"].clip(0.0, 1.0)
            await asyncio.to_thread(_answer_and_correct, device, agent, x, batch["y"], rng)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=device.feed_seconds * rng.uniform(0.8, 1.5))


def _answer_and_correct(device: FleetDevice, agent: Agent, x, truth, rng: random.Random) -> None:
    """The user of ``--feed feedback``: sees an answer for each sample, corrects a wrong one now and then."""
    answer = agent.predict({"x": x})
    for answer_id, said, right in zip(answer["ids"], answer["labels"], truth.tolist(), strict=True):
        device.answers += 1
        if said != right:
            device.wrong += 1
            if rng.random() < device.correct:
                agent.feedback(answer_id, int(right))
                device.corrections += 1
                device.handed += 1
    model, _ = agent.served()
    family = get_family(AdapterStore(device.home).state()["current"]["training"]["family"])
    with torch.no_grad():
        accuracy = float(family.evaluate(model.eval(), as_tensors(device.data.test))["accuracy"])
    device.curve.append({"seconds": round(time.monotonic() - device.started, 1), "answers": device.answers,
                         "corrections": device.corrections, "test_accuracy": accuracy})  # fmt: skip


async def run_device(device: FleetDevice, server: str, token: str, stop: asyncio.Event, gate: threading.Semaphore):
    state = await asyncio.to_thread(_enroll, device, server, token)
    key = load_or_create_key(device.home)
    config = device.configure()
    runtime = DeviceRuntime(home=device.home, state=state, key=key, config=config)
    session = DeviceSession(server=state.server, device_id=state.device_id, key=key)
    handler = AssignmentHandler(home=device.home, state=state, session=session, evaluate=runtime.evaluate_versions)
    rng = random.Random(device.data.index)  # noqa: S311  (simulation)

    def train() -> dict:
        with gate:
            return runtime.train_once()

    async def trainer():
        while not stop.is_set():
            try:
                outcome = await asyncio.to_thread(train)
                device.passes += 1
                if outcome["status"] == "trained":
                    device.uploads += 1
                elif outcome["status"] == "discarded":
                    device.discarded += 1
            except Exception:
                device.failures += 1
                logger.exception("%s: training failed", device.name)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=config.train_interval_seconds * rng.uniform(0.8, 1.5))

    connection = AgentConnection(home=device.home, state=state, key=key, heartbeat=runtime.heartbeat,
                                 backoff=Backoff(cap=10.0), on_command=handler,
                                 uploads=OutboxUploads(runtime.outbox))  # fmt: skip
    session_stop = asyncio.Event()
    connected = asyncio.create_task(connection.run(session_stop))
    feeding = asyncio.create_task(_feed(device, stop, random.Random(1000 + device.data.index)))  # noqa: S311
    training = asyncio.create_task(trainer())
    await stop.wait()
    await training  # a pass under way ends first
    await feeding
    session_stop.set()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(connected, timeout=15)
