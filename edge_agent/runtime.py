"""The device's own loop: collect local samples, decide whether to train, train the installed adapter,
package the delta into the outbox (``edge_agent.uploads`` hands the outbox to the socket uploader).

Local settings live in ``<home>/settings.json`` (data source, power source, policy, training, encoding);
what to train (family, LoRA configuration) comes from the signed manifest of the installed version.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from edge_agent.assignments import AdapterStore, build_model
from edge_agent.delta import CLIP_SHARE, clip_to_bound
from edge_agent.families import get_family
from edge_agent.families.common import LABEL, concat
from edge_agent.feedback import Answers, heartbeat_feedback
from edge_agent.identity import AgentState, atomic_write
from edge_agent.lora_layers import adapter_tensors
from edge_agent.packaging import Outbox
from edge_agent.personal import (
    PersonalSettings,
    PersonalStore,
    derive,
    hide_rows,
    own_start,
    personalize,
    private_keys,
    proximal_penalty,
)
from edge_agent.power import PowerState, SimulatedPower, SysfsPower, TrainingPolicy
from edge_agent.samples import SPLIT_EVERY, ReplayBuffer, SampleStore, SimulatedStream, device_split
from edge_agent.small_devices import serve_small
from edge_agent.training import TrainConfig, train_adapter
from edge_agent.unlabeled import UnlabeledStore

logger = logging.getLogger("edge_agent.runtime")
UNLABELED_PER_PASS = 240  # unlabeled samples a personal pass reads at most, where no train_window is set
CONFIG_FILE = "settings.json"
LAST_TRAINING_FILE = "last_training.json"
TRAINING_RUN_FILE = "training_run.json"  # the samples a training pass uses, until it has ended
JUDGE_MIN_SAMPLES = 10  # a smaller validation slice does not stop, pick or discard a pass (TrainConfig)


@dataclass
class AgentConfig:
    """Local, per-device settings (never sent by the server)."""

    data: dict[str, Any] = field(default_factory=lambda: {"kind": "simulated", "device_index": 0, "num_devices": 10})
    power: dict[str, Any] = field(default_factory=lambda: {"kind": "sysfs"})
    policy: dict[str, Any] = field(default_factory=lambda: {"min_new_samples": 32, "min_battery_percent": 30.0})
    train: dict[str, Any] = field(default_factory=lambda: {"epochs": 3, "lr": 0.01, "replay_ratio": 0.25})
    encoding: str = "f32"
    train_interval_seconds: float = 30.0
    train_window: int = 1000  # a pass trains on at most the newest this many samples (0: all of them)
    rejected_keep_files: int = 100  # inbox/rejected/ keeps at most this many refused files (edge_agent.inbox)
    rejected_keep_mib: float = 128.0  # and at most this many MiB of them, the oldest removed first
    answers_keep: int = 1000  # the inputs of at most this many recent answers are kept (edge_agent.feedback)
    answers_keep_days: float = 7.0  # and none older than this, the oldest dropped first
    unlabeled_keep: int = 2000  # at most this many unlabeled samples are kept, the oldest dropped first

    @classmethod
    def load(cls, home: Path) -> AgentConfig:
        path = home / CONFIG_FILE
        if not path.exists():
            return cls()
        values = json.loads(path.read_text())
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{path}: unknown settings {sorted(unknown)}")
        return cls(**values)

    def save(self, home: Path) -> None:
        atomic_write(home / CONFIG_FILE, json.dumps(self.__dict__, indent=2).encode(), mode=0o600)


def power_source(config: dict[str, Any]):
    kind = config.get("kind", "sysfs")
    if kind == "simulated":
        return SimulatedPower(**{k: v for k, v in config.items() if k != "kind"})
    if kind == "sysfs":
        return SysfsPower()
    raise ValueError(f"unknown power source {kind!r}: use 'sysfs' or 'simulated'")


class DeviceRuntime:
    def __init__(self, *, home: Path, state: AgentState, key, config: AgentConfig | None = None):
        self.home, self.state, self.key = home, state, key
        self.config = config or AgentConfig.load(home)
        self.adapters = AdapterStore(home)
        self.outbox = Outbox(home)
        self.samples = SampleStore(home / "samples")
        self.personal = PersonalStore(home)
        self.power = power_source(self.config.power)
        self.policy = TrainingPolicy(**self.config.policy)
        self.last: dict[str, Any] = self._read_last()
        # Set when the agent stops (SIGTERM): a pass in progress checkpoints before its next optimizer step and
        # raises training.Interrupted; the pass is taken up again, from its checkpoint, at the next start.
        self.stopping = threading.Event()

    def _read_last(self) -> dict:
        path = self.home / LAST_TRAINING_FILE
        return json.loads(path.read_text()) if path.exists() else {}

    def _note(self, **outcome) -> dict:
        outcome["at"] = time.time()
        self.last = outcome
        atomic_write(self.home / LAST_TRAINING_FILE, json.dumps(outcome).encode(), mode=0o600)
        return outcome

    def power_state(self) -> PowerState | None:
        return self.power.read()

    def heartbeat(self) -> dict:
        power = self.power_state()
        beat: dict[str, Any] = {}
        if power is not None:
            if power.battery_percent is not None:
                beat["battery"] = round(float(power.battery_percent), 1)
            beat["charging"] = bool(power.charging)
        after = (self.last.get("after") or {}) if self.last.get("status") == "trained" else {}
        metrics = {f"val_{k}": round(float(v), 4) for k, v in after.items() if isinstance(v, int | float)}
        if metrics:
            beat["metrics"] = metrics
        personal = self.personal.report()
        if personal is not None:
            beat["personal"] = personal
        unlabeled = len(UnlabeledStore.of(self.home, self.config))
        feedback = heartbeat_feedback(Answers(self.home), self.adapters.state(), len(self.samples), unlabeled)
        if feedback is not None:
            beat["feedback"] = feedback
        return beat

    def _source(self, family, training: dict) -> SimulatedStream | None:
        """The simulated demo source (``data.kind == "simulated"``): this device's shard, seen as its user sees
        it, arriving for as long as the agent runs (``wrap``, on unless set false)."""
        data = self.config.data
        if data.get("kind") != "simulated":
            return None
        shard_config = {**training.get("family_config", {}), **{k: v for k, v in data.items() if k != "kind"}}
        train, _ = family.dataset(shard_config)
        stream = SimulatedStream(
            train,
            per_poll=int(data.get("per_poll", 16)),
            seed=int(data.get("device_index", 0)),
            wrap=bool(data.get("wrap", True)),
            multiple=SPLIT_EVERY,
        )
        stream.seek(len(self.samples))
        return stream

    def _window(self, count: int) -> int:
        """Where this pass's samples start: the newest ``train_window`` of the first ``count`` (older ones live
        on in the replay buffer), on a multiple of ``SPLIT_EVERY`` so every sample keeps its slice
        (``device_split``)."""
        window = int(self.config.train_window or 0)
        if not window or count <= window:
            return 0
        start = count - window
        return start + (-start % SPLIT_EVERY)

    def _model(self, training: dict, tensors: dict, base_sha: str):
        return get_family(training["family"]), build_model(training, tensors, self.adapters.base_path(base_sha))

    def evaluate_versions(self, previous: Path | None, candidate: Path, manifest: dict) -> dict:
        """Guard metrics for an assignment: the candidate on this device's validation and held slices (the samples
        each pass holds out of its own training; ``device_split``), and the change against the version it replaces
        (when there is one and it was trained the same way); with a personal model, that model as the candidate
        would carry it against the candidate, on the held slice alone as the device's reports (no pass of either
        trained on it: ``personal_accuracy``, ``shared_accuracy``, ``personal_gain``), so rollout guards can hold a
        version that leaves personal models worse."""
        training = manifest.get("training")
        if not training:
            return {}
        family = get_family(training["family"])
        source = self._source(family, training)
        if source is not None and len(self.samples) == 0:
            self.samples.collect(source, max_polls=1)
        if len(self.samples) == 0:
            return {}
        total = len(self.samples)
        recent = self.samples.load(self._window(total), total)
        _, val, held = device_split({k: torch.as_tensor(v) for k, v in recent.items()})
        if not len(next(iter(val.values()))):
            return {}
        metrics: dict[str, float] = {}
        guard = concat([val, held])
        for label, path in (("", candidate), ("previous_", previous)):
            if path is None or not Path(path).exists():
                continue
            _, model = self._model(training, load_file(str(path)), manifest["base_model_sha256"])
            with torch.no_grad():
                for name, value in family.evaluate(model.eval(), guard).items():
                    metrics[f"{label}val_{name}"] = round(float(value), 6)
        for name in [k for k in metrics if not k.startswith("previous_")]:
            if f"previous_{name}" in metrics:
                metrics[f"{name}_change"] = round(metrics[name] - metrics[f"previous_{name}"], 6)
        settings = PersonalSettings.from_training(training)
        mine = self.personal.tensors() if self.personal.state().get("adapter") == manifest.get("adapter") else None
        if settings.method != "none" and mine is not None and len(next(iter(held.values()))):
            shared, measured = load_file(str(candidate)), {}
            for name, tensors in (("shared", shared), ("personal", derive(shared, mine, settings))):
                _, model = self._model(training, tensors, manifest["base_model_sha256"])
                measured[name] = round(float(family.evaluate(model.eval(), held)["accuracy"]), 6)
            metrics |= {"shared_accuracy": measured["shared"], "personal_accuracy": measured["personal"],
                        "personal_gain": round(measured["personal"] - measured["shared"], 6)}  # fmt: skip
        return metrics

    def _pass_samples(self, current: dict) -> int:
        """How many samples (from the start of the store) this pass trains on. A pass cut short (power loss,
        kill) is taken up on the same samples, so train_adapter's fingerprint matches and it resumes from its
        checkpoint; samples that arrived since wait for the next pass. Otherwise: all of them."""
        path, total = self.home / TRAINING_RUN_FILE, len(self.samples)
        try:
            interrupted = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:  # written atomically, so only a hand edit gets here: start afresh
            interrupted = {}
        count = int(interrupted.get("count", 0))
        if interrupted.get("sha256") == current.get("sha256") and self.samples.trained_count < count <= total:
            return count  # (a pass that got as far as marking its samples trained has ended: not this one)
        atomic_write(path, json.dumps({"sha256": current.get("sha256"), "count": total}).encode(), mode=0o600)
        return total

    def delta_tensors(self, model, started: dict) -> dict:
        """The adapter to upload the change of (a hook: the demo's misbehaving device overrides it)."""
        return adapter_tensors(model)

    def clip_update(self, upload: dict, started: dict, training: dict) -> dict:
        """``upload`` with its change from ``started`` within the adapter's bound (``max_norm`` in the manifest's
        training setting: ``edge_agent.delta.clip_to_bound``), so an update a little above it is not refused
        ``norm_too_large`` and the samples spent for nothing (a hook: the demo's misbehaving device skips it)."""
        bound = training.get("max_norm")
        clipped, norm = clip_to_bound(upload, started, bound, only_b=bool(training.get("ffa")))
        if clipped is not upload:
            logger.info("clipped the update from L2 norm %.4g to %.4g, within the adapter's bound %.4g",
                        norm, CLIP_SHARE * bound, bound)  # fmt: skip
        return clipped

    def _recent(self, count: int) -> tuple[dict, dict, dict]:
        """The local train, validation and held slices (``device_split``) of this pass: the newest
        ``train_window`` of ``count``."""
        data = {k: torch.as_tensor(v) for k, v in self.samples.load(self._window(count), count).items()}
        return device_split(data)

    def _train_config(self, checkpoint_dir: Path) -> TrainConfig:
        defaults = {"refit": True, "judge_min_samples": JUDGE_MIN_SAMPLES, "restrict_classes": True}
        return TrainConfig(
            **{**defaults, **self.config.train, "checkpoint_dir": checkpoint_dir, "should_stop": self.stopping.is_set}
        )

    def _unlabeled(self, settings: PersonalSettings) -> dict | None:
        """The newest unlabeled samples, as many as a pass's labelled window (``train_window``, else 240), for the
        personal pass to pseudo-label where the setting says so (``edge_agent.pseudo_labels``)."""
        if settings.unlabeled == "none":
            return None
        store = UnlabeledStore.of(self.home, self.config)
        return store.load_recent(int(self.config.train_window or UNLABELED_PER_PASS)) or None

    def _replay(self) -> ReplayBuffer:
        return ReplayBuffer(self.home / "replay.npz", seed=int(self.config.data.get("device_index", 0)))

    def personal_pass(
        self, current: dict, *, count: int, trained: dict | None = None, train_personal=True, released=None
    ) -> dict:
        """Make, measure and choose the personal model from the installed shared version ``current`` and the
        first ``count`` samples (``edge_agent.personal``). ``trained`` is the shared pass's adapter, whose
        private modules a ``private_modules`` device keeps; ``released`` the rows its shared pass found
        (``own_start``), not looked for twice. Marked pending first, so a pass cut short is taken
        up again (and resumes from its checkpoint) before anything else."""
        training = current["training"]
        settings = PersonalSettings.from_training(training)
        family = get_family(training["family"])
        state = self.personal.state()
        same = state.get("adapter") == current["adapter"] and state.get("method") == settings.method
        personal = self.personal.tensors() if same else None
        if settings.method == "finetune" and state.get("version") != current["version"]:
            personal = None  # re-derived from the new shared version
        pending = {"sha256": current["sha256"], "count": count}
        resumed = state.get("pending") or {}
        if settings.method == "private_modules" and trained is not None:
            personal = trained
            self.personal.keep_start(trained)  # nowhere else on disk: a pass cut short resumes from these
            pending["start"] = True
        elif resumed.get("start") and resumed.get("sha256") == current["sha256"] and self.personal.start_path.exists():
            personal, pending["start"] = load_file(str(self.personal.start_path)), True
        self.personal.save(None, pending=pending)
        train, val, held = self._recent(count)
        base_sha = self.adapters.state()["base_model_sha256"]
        shared = load_file(current["path"])
        outcome = personalize(
            build=lambda tensors: self._model(training, tensors, base_sha)[1],
            shared=shared,
            personal=personal,
            train=train,
            val=val,
            held=held,
            settings=settings,
            family=family,
            config=self._train_config(self.personal.checkpoint_dir),
            replay=self._replay(),
            train_personal=train_personal,
            released=released,
            unlabeled=self._unlabeled(settings) if train_personal else None,
        )
        parts = [part[LABEL] for part in (train, val, held) if part and LABEL in part]
        labels = torch.cat(parts).tolist() if parts else []  # every label the pass's samples carry
        outcome, earlier = serve_small(self.personal, current, outcome, settings, labels, shared)
        measured = outcome.personal or outcome.shared
        state = self.personal.save(
            outcome.tensors,
            adapter=current["adapter"],
            version=current["version"],
            shared_sha256=current["sha256"],
            method=settings.method,
            serving=outcome.serving,
            shared_accuracy=round(float(outcome.shared.get("accuracy", 0.0)), 6),
            personal_accuracy=round(float(measured.get("accuracy", 0.0)), 6),
            val_samples=int(outcome.shared.get("samples", 0)),
            shared_only_right=outcome.shared.get("only_right"),
            personal_only_right=measured.get("only_right"),
            trained_samples=len(train.get("y", ())) if train else 0,
            samples=count,
            pending=None,
            notes=[*(outcome.result.notes if outcome.result is not None else []), *outcome.notes],
            **earlier,
        )
        self.personal.start_path.unlink(missing_ok=True)
        logger.info(
            "personal model (%s) on %s v%s: shared %.3f, personal %.3f; serving %s",
            settings.method, current["adapter"], current["version"], state["shared_accuracy"],
            state["personal_accuracy"], state["serving"],
        )  # fmt: skip
        return state

    def _follow_new_version(self, current: dict, *, train: bool) -> dict:
        """A shared version installed since the personal pass, and no shared pass due (too few new samples):
        where the power rules allow (``train``), the personal pass again on the samples the device holds, so its
        own model follows what the fleet learned (ditto pulled toward the new version, finetune redone from it,
        private modules refitted to its body) even when its user hands it no more samples; otherwise both
        measured on the held slice and chosen again, so the device does not serve a pairing it never judged."""
        state = self.personal.state()
        method = PersonalSettings.from_training(current["training"]).method
        if method == "none" or not state.get("file") or state.get("pending") or not len(self.samples):
            return {}
        if state.get("shared_sha256") == current["sha256"]:
            return {}
        return {"personal": self.personal_pass(current, count=len(self.samples), train_personal=train)}

    def _personal_on_few_samples(self, current: dict) -> dict:
        """Too few new samples for a shared pass, and the device holds at least twice the samples its personal
        model was last trained on (or has none yet): the personal pass alone on all of them, nothing uploaded.
        A device whose user hands it fewer than ``min_new_samples`` samples in all would otherwise never train
        and serve the shared version (a small own-names device on the fleet benchmark: 31.5% on its test data
        where a fine-tune of its 7 samples reached 86.3%; bench/README.md, "fleet_learning.py"); doubling keeps
        the extra passes to a handful (at 1, 2, 4, 8, 16 samples when they come one at a time), each on a few
        samples, until the shared passes take over."""
        state = self.personal.state()
        if PersonalSettings.from_training(current["training"]).method == "none" or state.get("pending"):
            return {}
        total = len(self.samples)
        ours = state.get("adapter") == current["adapter"] and state.get("file")
        before = int(state.get("samples", state.get("trained_samples", 0)) or 0) if ours else 0
        if not total or total < 2 * before or total == before:
            return {}
        return {"personal": self.personal_pass(current, count=total)}

    def train_once(self, *, force: bool = False) -> dict:
        """One pass of the loop; returns (and records) what it decided and why."""
        current = self.adapters.state().get("current")
        if not current or not current.get("training"):
            return self._note(status="skipped", reason="no adapter installed yet: waiting for an assignment")
        training = current["training"]
        family = get_family(training["family"])
        source = self._source(family, training)
        if source is not None:
            self.samples.collect(source, max_polls=1)
        pending = self.personal.state().get("pending") or {}
        if not force:
            new_samples = self.samples.new_count()
            if pending.get("sha256") == current.get("sha256"):
                new_samples = max(new_samples, self.policy.min_new_samples)  # only the power rules decide
            power = self.power_state()
            go, reason = self.policy.decide(new_samples=new_samples, power=power)
            if not go:
                allowed = not self.policy.waiting_for(power=power)  # the personal pass needs no new samples
                personal = self._follow_new_version(current, train=allowed)
                if not personal and allowed:
                    personal = self._personal_on_few_samples(current)
                return self._note(status="skipped", reason=reason, **personal)
        if pending.get("sha256") == current.get("sha256") and int(pending.get("count", 0)) <= len(self.samples):
            personal = self.personal_pass(current, count=int(pending["count"]))
            return self._note(status="personalized", reason="finished a personal pass that was cut short",
                              personal=personal, version=current["version"])  # fmt: skip
        settings = PersonalSettings.from_training(training)
        started = {k: v.clone() for k, v in load_file(current["path"]).items()}
        private = private_keys(started, settings.private_modules) if settings.method == "private_modules" else set()
        own = settings.method == "ditto" and self.personal.state().get("adapter") == current["adapter"]
        mine = self.personal.tensors() if private or own else None
        family, model = self._model(
            training, derive(started, mine if private else None, settings), self.adapters.state()["base_model_sha256"]
        )
        count = self._pass_samples(current)
        train, val, _ = self._recent(count)
        rows = own_start(model, started, mine, train, settings, family)  # ditto: this user's own names
        mu = float(training.get("proximal_mu") or 0.0)  # FedProx: mu/2 ||w - w_start||^2, w_start what it starts from
        anchor = proximal_penalty(model, adapter_tensors(model), mu) if mu > 0 else None
        result = train_adapter(
            model, train, val, config=self._train_config(self.home / "checkpoints"), family=family,
            replay=self._replay(), penalty=anchor,
        )  # fmt: skip
        trained = adapter_tensors(model)
        personal = {}
        if result.discarded:
            self.samples.mark_trained(count)
            (self.home / TRAINING_RUN_FILE).unlink(missing_ok=True)
            logger.info("discarded the update: %s", result.reason)
            if settings.method != "none":
                personal = self.personal_pass(current, count=count, released=rows)
            return self._note(status="discarded", reason=result.reason, before=result.before, after=result.after,
                              personal=personal)  # fmt: skip
        upload = self.delta_tensors(model, started)
        for key in private:  # the device's own modules: no change of them leaves the device
            upload[key] = started[key]
        hide_rows(upload, started, rows)  # nor of its own classifier rows
        upload = self.clip_update(upload, started, training)
        item, added = self.outbox.put_delta(
            upload,
            started,
            key=self.key,
            device_id=self.state.device_id,
            adapter=current["adapter"],
            base_version=current["version"],
            num_samples=max(1, result.num_samples),
            encoding=self.config.encoding,
            only_b=bool(training.get("ffa")),
        )
        metrics = {f"before_{k}": v for k, v in result.before.items()} | {
            f"after_{k}": v for k, v in result.after.items()
        }
        atomic_write(item.path.with_suffix(".metrics.json"), json.dumps(metrics).encode(), mode=0o600)
        self.samples.mark_trained(count)
        (self.home / TRAINING_RUN_FILE).unlink(missing_ok=True)
        logger.info(
            "trained %s v%s on %d samples: %s -> %s; delta %s queued (counter %d)",
            current["adapter"],
            current["version"],
            result.num_samples,
            result.before,
            result.after,
            item.sha256[:12],
            item.counter,
        )
        if settings.method != "none":
            personal = self.personal_pass(current, count=count, trained=trained, released=rows)
        return self._note(
            status="trained",
            reason="policy allowed" if not force else "forced",
            before=result.before,
            after=result.after,
            sha256=item.sha256,
            counter=item.counter,
            new=added,
            version=current["version"],
            personal=personal,
        )
