"""The demo fleet ``make run`` starts: a seeded setup and simulated devices running the real agent code.

On first start ``seed`` creates (through the product's services, idempotently) two cohorts, the
``digits-cnn`` base model, the ``digits-lora`` adapter with continuous personalization on (each round's
version is released and rolled out at once), version 1 and its rollouts, and pre-authorized enrollment
tokens. ``run_fleet`` then runs N full agents in this one process, each with its own identity, key,
outbox, non-IID data shard and power state: they enroll over HTTP, connect over the WebSocket, train,
upload, install new versions and report metrics. Some go offline now and then and come back, some run on
battery, and the last one is misbehaving (its updates are blown up 10,000 times, so the server rejects them).
Each device has a user too (``_user``): now and then its application asks the served model about a few digits
the user writes (``Agent.predict``), and the user corrects some wrong answers and confirms some right ones
(``Agent.feedback_many``), so the dashboard shows what users say of each version (correction rates).

The devices' homes (``DATA_DIR/demo/device-NN``: key, ``agent.json``, outbox, checkpoints) outlive a run, so a
restart finds the fleet as it left it. A home is bound to the server it enrolled with (``agent.json``'s URL) and
to the database that enrolled it (its device, under its key, is a row there): ``reset_unbound_homes`` removes the
homes a run against another URL or port, or another database (or one emptied since), would find dead, and they
enroll again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import shutil
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from django.utils import timezone
from safetensors.torch import save as save_safetensors

from devices.models import Cohort, Device, DeviceStatus
from devices.services import cohort_create, device_transition, enrollment_token_create
from edge_agent.api import Agent, NotReady
from edge_agent.assignments import AssignmentHandler
from edge_agent.connection import AgentConnection, Backoff
from edge_agent.enroll import enroll
from edge_agent.families import get_family
from edge_agent.families.common import pretrain
from edge_agent.feedback import FeedbackError
from edge_agent.identity import KEY_FILE, STATE_FILE, AgentState, load_or_create_key, public_key_b64
from edge_agent.lora_layers import adapter_tensors
from edge_agent.rest import DeviceSession
from edge_agent.runtime import AgentConfig, DeviceRuntime
from edge_agent.training import Interrupted
from edge_agent.uploads import OutboxUploads
from training.models import Adapter, BaseModel, Rollout
from training.registry.services import adapter_create, base_model_create, version_create_seeded, version_transition
from training.rollouts.lifecycle import rollout_create, rollout_start

logger = logging.getLogger("demo")
COHORTS = ("eu-phones", "us-wearables")
ADAPTER = "digits-lora"
BASE_CONFIG = {"seed": 1}
FACTORY_FRACTION = 0.03  # of the digits train set; devices draw their shards from the rest
ENROLL_ATTEMPTS = 6
# A device's user (``_user``): about every USER_EVERY_SECONDS the application asks the served model about
# USER_ANSWERS digits the user writes; the user corrects a wrong answer CORRECTED_SHARE of the time and confirms a
# right one CONFIRMED_SHARE of the time, and says nothing otherwise, as users do.
USER_EVERY_SECONDS = 8.0
USER_ANSWERS = 6
CORRECTED_SHARE, CONFIRMED_SHARE = 0.5, 0.3


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def seed(*, devices: int) -> dict[str, str]:
    """Create what the demo needs (once) and fresh enrollment tokens for ``devices`` (none for 0: the setup
    alone, ``run --devices 0``); returns {cohort: raw token}."""

    cohorts = [Cohort.objects.filter(name=n).first() or cohort_create(name=n) for n in COHORTS]
    base = BaseModel.objects.filter(name="digits").first()
    if base is None:
        base = base_model_create(name="digits", family="digits-cnn", family_config=BASE_CONFIG, weights=factory_base())
        _say(f"trained the digits-cnn base at the factory on {FACTORY_FRACTION:.0%} of the digits")
    adapter = Adapter.objects.filter(name=ADAPTER).first()
    if adapter is None:
        adapter = adapter_create(
            name=ADAPTER,
            base_model=base,  # the family's default shape (edge_agent/families/digits.py)
            cohorts=cohorts,
            aggregation={
                "strategy": "fedbuff",
                "buffer_size": max(3, devices // 2),
                "min_deltas": 2,
                "round_timeout_seconds": 90,
                "auto_release": True,
            },
        )
        _say(f"created adapter {ADAPTER} (fedbuff, K={max(3, devices // 2)}, new versions released automatically)")
    if not adapter.versions.exists():
        version = version_create_seeded(adapter=adapter, seed=1, note="demo seed")
        version_transition(version=version, action="release", actor=None, reason="demo")
        for cohort in cohorts:
            rollout_start(
                rollout=rollout_create(version=version, cohort=cohort, phases=[{"percent": 100}], actor=None),
                actor=None,
            )
        _say("seeded version 1 and rolled it out to both cohorts")
    elif not Rollout.objects.filter(version__adapter=adapter).exists():
        _say("note: the demo adapter has versions but no rollout; devices wait for one")
    tokens = {}
    for cohort in cohorts if devices else ():
        issued = enrollment_token_create(
            cohort=cohort,
            name="demo fleet",
            expires_at=timezone.now() + timedelta(hours=12),
            uses=devices,
            requires_approval=False,
        )
        tokens[cohort.name] = issued.raw
    return tokens


def factory_base() -> bytes:
    """The demo's base model weights: ``digits-cnn`` trained centrally on the factory part of the digits (a
    second or two), so version 1 is already useful and the fleet's rounds start from a real model."""

    family = get_family("digits-cnn")
    model = family.build(BASE_CONFIG)
    factory, _ = family.dataset({"factory_fraction": FACTORY_FRACTION, "part": "factory"})
    pretrain(model, factory, seed=BASE_CONFIG["seed"])
    return save_safetensors({key: value.contiguous() for key, value in model.state_dict().items()})


class SabotagedRuntime(DeviceRuntime):
    """The misbehaving device: a real trained update, blown up 10,000 times, and not clipped to the adapter's
    bound as a well-behaved agent clips it (the server rejects it ``norm_too_large``)."""

    def delta_tensors(self, model, started):
        trained = adapter_tensors(model)
        return {k: started[k] + (trained[k] - started[k]) * 10_000 for k in trained}

    def clip_update(self, upload, started, training):
        return upload


@dataclass
class DemoDevice:
    index: int
    total: int
    home: Path
    cohort: str
    flaky: bool  # goes offline now and then
    on_battery: bool
    misbehaving: bool

    @property
    def scenario(self) -> str:
        """How this device's user differs (``digits_users``): half see the digits as they are (their own label
        mix only), a quarter through their own sensor (rotation, scale, contrast), a quarter name two pairs of
        labels their own way. The shared version serves the first half well; the others need their own."""
        return ("label", "feature", "label", "concept")[self.index % 4]

    @property
    def name(self) -> str:
        return f"demo-{self.index:02d}{'-rogue' if self.misbehaving else ''}"

    def configure(self) -> AgentConfig:
        config = AgentConfig.load(self.home)
        config.data = {
            "kind": "simulated",
            "device_index": self.index,
            "num_devices": self.total,
            "alpha": 0.5,
            "per_poll": 32,
            "factory_fraction": FACTORY_FRACTION,
            "scenario": self.scenario,
            "wrap": True,
        }
        config.power = (
            {"kind": "simulated", "level": 70.0, "charging": False, "drain_per_hour": 30.0, "seed": self.index}
            if self.on_battery
            else {"kind": "simulated", "level": 100.0, "charging": True, "seed": self.index}
        )
        config.policy = {"min_new_samples": 32, "min_battery_percent": 30.0}
        config.train = {"epochs": 3, "lr": 0.01, "replay_ratio": 0.25}
        config.train_interval_seconds = 8.0
        config.train_window = 240  # the stream repeats the shard: a pass needs no more than two rounds of it
        config.save(self.home)
        return config


def _enroll(device: DemoDevice, server: str, token: str) -> AgentState:
    """Enroll once (a device that has its state keeps it); a failure is reported and retried with backoff, so
    a server that is still starting or refused one request does not leave a dead device in the demo."""

    if (device.home / STATE_FILE).exists():
        return AgentState.load(device.home)
    for attempt in range(1, ENROLL_ATTEMPTS + 1):
        try:
            return enroll(
                home=device.home,
                server=server,
                token=token,
                name=device.name,
                labels={"demo": "true", "power": "battery" if device.on_battery else "mains", "user": device.scenario},
            )
        except Exception as error:  # noqa: BLE001  (any failure is reported and retried; the last is raised)
            if attempt == ENROLL_ATTEMPTS:
                _say(f"{device.name}: enrollment failed {attempt} times, giving up: {error}")
                raise
            wait = min(2.0**attempt, 30.0)
            _say(f"{device.name}: enrollment failed ({error}); retrying in {wait:.0f}s")
            time.sleep(wait)
    raise AssertionError("unreachable")


def _unbound(home: Path, server: str) -> tuple[str, Device | None] | None:
    """Why ``home`` cannot run against ``server`` and this database, with the device it enrolled as if that is a row
    of this database; None if it can (or has not enrolled yet)."""
    if not (home / STATE_FILE).exists():
        return None
    try:
        state = AgentState.load(home)
        key = load_or_create_key(home) if (home / KEY_FILE).exists() else None
    except (OSError, ValueError, TypeError) as error:  # a home broken by hand cannot run either
        return f"unreadable ({error})", None
    device = None if key is None else Device.objects.filter(id=state.device_id, public_key=public_key_b64(key)).first()
    if state.server.rstrip("/") != server.rstrip("/"):
        return f"enrolled with {state.server}, not {server}", device
    if device is None:
        return "their devices are not in this database (enrolled with another one, or it was emptied since)", None
    return None


def reset_unbound_homes(devices: list[DemoDevice], server: str) -> list[DemoDevice]:
    """Remove the homes of ``devices`` bound to another server or database (``_unbound``), so those devices enroll
    again here, and say why in one line; returns them. A device of this database whose home is removed (the same
    database behind another URL) is retired, so the dashboard does not list it as a device gone silent. A home
    bound to this server and database is kept as it is: a restart of the same product keeps each device's state."""
    unbound = {device.home: found for device in devices if (found := _unbound(device.home, server)) is not None}
    reset = [device for device in devices if device.home in unbound]
    retired = 0
    for device in reset:
        shutil.rmtree(device.home)
        row = unbound[device.home][1]
        if row is not None and row.status != DeviceStatus.RETIRED:
            device_transition(device=row, action="retire", actor=None, reason="demo fleet reset: another server URL")
            retired += 1
    if reset:
        reasons = "; ".join(sorted({why for why, _ in unbound.values()}))
        old = f"; their {retired} old devices here are retired" if retired else ""
        _say(
            f"starting {len(reset)} of {len(devices)} demo devices anew (their homes in {reset[0].home.parent} "
            f"removed; they enroll again): {reasons}{old}"
        )
    return reset


def _users_digits(config: AgentConfig) -> dict:
    """The digits this device's user writes: its shard of the pool, as its user sees and names them (the same
    data the simulated source hands the agent)."""
    train, _ = get_family("digits-cnn").dataset({k: v for k, v in config.data.items() if k != "kind"})
    return train


def _user_moment(agent: Agent, digits: dict, rng: random.Random, writing: threading.Lock) -> int:
    """The user writes a few digits, the application shows the served model's answers, and the user corrects or
    confirms some of them. Returns how many answers the user spoke to (0 before a version is installed)."""
    picked = [rng.randrange(len(digits["y"])) for _ in range(USER_ANSWERS)]
    try:
        answer = agent.predict({"x": digits["x"][picked].numpy()})
    except NotReady:
        return 0
    said = []
    for answer_id, predicted, index in zip(answer["ids"], answer["labels"], picked, strict=True):
        label = int(digits["y"][index])
        if rng.random() < (CONFIRMED_SHARE if predicted == label else CORRECTED_SHARE):
            said.append((answer_id, label))
    if said:
        with writing:  # the store takes one writer at a time: this user's samples or the simulated source's
            agent.feedback_many(said)
    return len(said)


async def _user(device: DemoDevice, config: AgentConfig, stop: asyncio.Event, writing: threading.Lock) -> None:
    agent = Agent(device.home)
    digits = await asyncio.to_thread(_users_digits, config)
    rng = random.Random(10_000 + device.index)  # noqa: S311  (simulation, not crypto)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=USER_EVERY_SECONDS * rng.uniform(0.5, 1.5))
        if stop.is_set():
            break
        try:
            await asyncio.to_thread(_user_moment, agent, digits, rng, writing)
        except FeedbackError as error:  # an answer gone meanwhile (answers_keep): the user's word is refused
            logger.info("%s: feedback refused: %s", device.name, error)
        except Exception:
            logger.exception("%s: the user's feedback failed", device.name)


async def _run_device(
    device: DemoDevice,
    server: str,
    token: str,
    stop: asyncio.Event,
    gate: threading.Semaphore,
    halt: threading.Event,
):
    state = await asyncio.to_thread(_enroll, device, server, token)
    key = load_or_create_key(device.home)
    config = device.configure()
    runtime_class = SabotagedRuntime if device.misbehaving else DeviceRuntime
    runtime = runtime_class(home=device.home, state=state, key=key, config=config)
    runtime.stopping = halt  # the fleet stopping: a pass in progress checkpoints and ends at its next step

    session = DeviceSession(server=state.server, device_id=state.device_id, key=key)
    handler = AssignmentHandler(home=device.home, state=state, session=session, evaluate=runtime.evaluate_versions)
    rng = random.Random(device.index)  # noqa: S311  (simulation, not crypto)
    writing = threading.Lock()  # the device's sample store: its simulated source (in a pass) or its user

    def train() -> dict:
        with gate, writing:  # two cores for a whole fleet: one training at a time keeps the server responsive
            if halt.is_set():  # stopped while it waited for its turn: no pass begins now
                return {"status": "stopped"}
            return runtime.train_once()

    async def trainer():
        while not stop.is_set():
            try:
                outcome = await asyncio.to_thread(train)
                if outcome["status"] == "trained":
                    before, after = outcome.get("before") or {}, outcome.get("after") or {}
                    _say(
                        f"{device.name}: trained on v{outcome.get('version')}, local accuracy "
                        f"{before.get('accuracy', float('nan')):.2f} -> {after.get('accuracy', float('nan')):.2f}"
                    )
            except Interrupted:
                pass  # the fleet is stopping; the pass resumes from its checkpoint at the next start
            except Exception:
                logger.exception("%s: training failed", device.name)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=config.train_interval_seconds * rng.uniform(0.8, 1.5))

    async def connected_for(seconds: float | None):
        session_stop = asyncio.Event()
        connection = AgentConnection(
            home=device.home,
            state=state,
            key=key,
            heartbeat=runtime.heartbeat,
            backoff=Backoff(cap=10.0),
            on_command=handler,
            uploads=OutboxUploads(runtime.outbox),
        )
        task = asyncio.create_task(connection.run(session_stop))
        waits = [asyncio.create_task(stop.wait())]
        done, _ = await asyncio.wait([task, *waits], timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        session_stop.set()
        for waiter in waits:
            waiter.cancel()
        with contextlib.suppress(Exception):
            await task

    training = asyncio.create_task(trainer())
    using = asyncio.create_task(_user(device, config, stop, writing))
    try:
        while not stop.is_set():
            if device.flaky:
                await connected_for(rng.uniform(40, 90))
                if stop.is_set():
                    break
                gone = rng.uniform(15, 30)
                _say(f"{device.name}: going offline for {gone:.0f}s (it keeps training; uploads wait in its outbox)")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=gone)
            else:
                await connected_for(None)
    finally:
        await training
        await using


def plan(total: int, root: Path) -> list[DemoDevice]:
    return [
        DemoDevice(
            index=i,
            total=total,
            home=root / f"device-{i:02d}",
            cohort=COHORTS[i % len(COHORTS)],
            flaky=i % 5 == 2,
            on_battery=i % 4 == 1,
            misbehaving=i == total - 1,
        )
        for i in range(total)
    ]


async def run_fleet(*, server: str, devices: list[DemoDevice], tokens: dict[str, str], stop: asyncio.Event) -> None:
    import torch

    torch.set_num_threads(1)
    gate = threading.Semaphore(1)
    halt = threading.Event()  # ``stop`` as the training threads see it
    _say(
        f"{len(devices)} devices: {sum(d.flaky for d in devices)} go offline now and then, "
        f"{sum(d.on_battery for d in devices)} on battery, 1 misbehaving ({devices[-1].name})"
    )
    tasks = [asyncio.create_task(_run_device(d, server, tokens[d.cohort], stop, gate, halt)) for d in devices]

    async def relay() -> None:
        await stop.wait()
        _say("stopping the fleet")
        halt.set()

    relaying = asyncio.create_task(relay())
    await asyncio.gather(*tasks, return_exceptions=True)
    relaying.cancel()
    _say("fleet stopped")
