"""On-device training of the adapter: the frozen base stays as it is, only the LoRA tensors and the modules
to save learn.

``train_adapter`` runs micro-batches with gradient accumulation (effective batch = ``micro_batch`` x
``accum_steps``), optionally with gradient checkpointing, with SGD, AdamW or Adafactor; mixes samples from
a ``ReplayBuffer`` into every micro-batch against forgetting; optionally adds an online EWC penalty; evaluates
on the local validation slice after every epoch, keeps the best epoch and stops early when validation stops
improving; and, when even the best epoch is worse on local validation than the adapter it started from,
discards the update and restores the starting tensors. With ``checkpoint_dir`` it checkpoints atomically
every ``checkpoint_every`` optimizer steps and at every epoch end, and resumes an interrupted run. With
``should_stop`` (the agent stopping: SIGTERM) it checkpoints where it stands and raises ``Interrupted`` before
the next optimizer step, so a stop waits for one step, not for the pass; the next run resumes from there.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_agent.checkpoint import CheckpointManager
from edge_agent.ewc import OnlineEWC
from edge_agent.families.common import (
    LABEL,
    classification_evaluate,
    classification_loss,
    concat,
    restricted_classification_loss,
    size,
    take,
)
from edge_agent.lora_layers import adapter_parameters, adapter_tensors, load_adapter_tensors
from edge_agent.samples import ReplayBuffer

OPTIMIZERS = ("sgd", "adamw", "adafactor")


@dataclass
class TrainConfig:
    epochs: int = 5
    micro_batch: int = 16
    accum_steps: int = 1
    optimizer: str = "adamw"
    lr: float = 1e-2
    weight_decay: float = 0.0
    momentum: float = 0.9  # SGD only
    max_grad_norm: float | None = 1.0
    gradient_checkpointing: bool = False
    replay_ratio: float = 0.0  # share of every micro-batch drawn from the replay buffer
    update_replay: bool = True  # add the training samples to the replay buffer afterwards
    patience: int = 2  # epochs without improvement before stopping early
    min_delta: float = 0.0
    metric: str = "loss"  # "loss" (lower is better) or "accuracy" (higher is better)
    discard_tolerance: float = 0.0  # how much worse than the start the best epoch may be and still be kept
    checkpoint_dir: Path | str | None = None
    checkpoint_every: int = 0  # optimizer steps between checkpoints (0: only at epoch ends)
    checkpoint_keep: int = 2
    seed: int = 0
    max_steps: int | None = None
    progress_bar: bool | None = None  # None: when stderr is a terminal
    # After the held-out run has chosen how many epochs help (its best epoch), train again from the start on
    # the training and validation slices together for that many: the validation samples are too many to leave
    # out on a device with little data (README, "Personalization"). The result still reports the held-out
    # figures of the first run.
    refit: bool = False
    # A validation slice smaller than this is too small to judge by (a few samples decide by chance): the run
    # then trains every epoch, keeps the last and never discards for being worse (only for diverging). It is
    # still measured on the slice. 0: always judge.
    judge_min_samples: int = 0
    # Train the logits of the classes this run's samples hold only (the family's ``restricted_loss``): the shared
    # pass sets it, so a device that sees two or three classes does not teach the fleet to never predict the rest.
    restrict_classes: bool = False
    # Asked before every optimizer step: true when the agent is stopping. The run then checkpoints where it
    # stands (with checkpoint_dir) and raises Interrupted; not part of what makes a run the same run.
    should_stop: Callable[[], bool] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}: use one of {list(OPTIMIZERS)}")
        if self.metric not in ("loss", "accuracy"):
            raise ValueError("metric must be 'loss' or 'accuracy'")
        if self.micro_batch < 1 or self.accum_steps < 1 or self.epochs < 0:
            raise ValueError("micro_batch and accum_steps must be at least 1, epochs not negative")
        if not 0 <= self.replay_ratio < 1:
            raise ValueError("replay_ratio must be in [0, 1)")


@dataclass
class TrainResult:
    discarded: bool
    reason: str
    before: dict[str, float]  # local validation of the starting adapter
    after: dict[str, float]  # local validation of the trained adapter (of the best epoch)
    steps: int = 0
    epochs_run: int = 0
    best_epoch: int = 0  # 0: no epoch improved on nothing (the start)
    stopped_early: bool = False
    num_samples: int = 0  # distinct local training samples
    samples_seen: int = 0  # local samples processed, counting every epoch
    replay_samples: int = 0  # replayed samples processed
    seconds: float = 0.0
    resumed_from_step: int | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Interrupted(RuntimeError):
    """Training stopped where it is (the last checkpoint stays): raised by ``train_adapter`` when
    ``config.should_stop`` says so, or by a progress callback."""


def make_optimizer(config: TrainConfig, parameters) -> torch.optim.Optimizer:
    parameters = list(parameters)
    if config.optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if config.optimizer == "adafactor":  # factored second moments: memory-light (torch >= 2.5)
        return torch.optim.Adafactor(parameters, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)


def _fingerprint(tensors: dict[str, torch.Tensor], train: dict, config: TrainConfig) -> str:
    digest = hashlib.sha256()
    for key in sorted(tensors):
        digest.update(key.encode())
        digest.update(tensors[key].detach().float().contiguous().numpy().tobytes())
    for key in sorted(train):  # the same local data: new samples mean a new run, not a resume
        digest.update(key.encode())
        digest.update(train[key].contiguous().numpy().tobytes())
    digest.update(repr((size(train), config.micro_batch, config.accum_steps, config.optimizer, config.seed)).encode())
    return digest.hexdigest()


class _Bar:
    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, max(total, 1)

    def update(self, step: int, loss: float, epoch: int) -> None:
        if not self.enabled:
            return
        done = min(step / self.total, 1.0)
        bar = "#" * int(done * 30)
        sys.stderr.write(f"\rtraining [{bar:<30}] {done:4.0%} step {step}/{self.total} epoch {epoch} loss {loss:.4f}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _worse(after: dict, before: dict, config: TrainConfig) -> bool:
    if config.metric == "loss":
        return not after["loss"] <= before["loss"] + config.discard_tolerance
    return not after["accuracy"] >= before["accuracy"] - config.discard_tolerance


def _better(candidate: dict, best: dict | None, config: TrainConfig) -> bool:
    if best is None:
        return math.isfinite(candidate["loss"])
    if config.metric == "loss":
        return candidate["loss"] < best["loss"] - config.min_delta
    return candidate["accuracy"] > best["accuracy"] + config.min_delta


def _restricted(family, train_data, val_data, replay, notes: list[str]):
    """The loss over the classes the run's samples (and its replay buffer) hold, or None (with a note) when the
    family has no ``restricted_loss``."""
    restricted = getattr(family, "restricted_loss", None) if family is not None else restricted_classification_loss
    if restricted is None:
        notes.append("the family has no restricted loss: trained over every class")
        return None
    labels = [train_data[LABEL], val_data[LABEL]] if LABEL in val_data else [train_data[LABEL]]
    if replay is not None and len(replay) and LABEL in replay.data:
        labels.append(torch.as_tensor(replay.data[LABEL]))
    classes = torch.unique(torch.cat([torch.as_tensor(y).reshape(-1).long() for y in labels]))
    return lambda model, batch: restricted(model, batch, classes)


def train_adapter(
    model: nn.Module,
    train_data: dict[str, torch.Tensor],
    val_data: dict[str, torch.Tensor],
    *,
    config: TrainConfig,
    family: Any = None,
    replay: ReplayBuffer | None = None,
    ewc: OnlineEWC | None = None,
    penalty: Callable[[nn.Module], torch.Tensor] | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train the adapter carried by ``model`` (see ``apply_adapter``) on ``train_data``, judge it on
    ``val_data`` (dicts of tensors, labels under ``"y"``). ``family`` supplies ``loss``/``evaluate``
    (classification cross-entropy by default); ``penalty(model)``, when given, is added to every micro-batch's
    loss (Ditto's pull toward the shared adapter, ``edge_agent.personal``).
    ``progress`` gets ``{"event": "step"|"epoch", ...}`` dicts."""
    began = time.monotonic()
    loss_fn = family.loss if family is not None else classification_loss
    evaluate = family.evaluate if family is not None else classification_evaluate
    train_data = {k: torch.as_tensor(v) for k, v in train_data.items()}
    val_data = {k: torch.as_tensor(v) for k, v in val_data.items()}
    n, has_val = size(train_data), size(val_data) > 0
    notes: list[str] = []
    if config.restrict_classes:
        loss_fn = _restricted(family, train_data, val_data, replay, notes) or loss_fn
    if has_val and size(val_data) < config.judge_min_samples:
        notes.append(f"{size(val_data)} validation samples are too few to judge by: trained every epoch, kept")
        config = replace(config, patience=config.epochs + 1, min_delta=-math.inf, discard_tolerance=math.inf)
    if config.gradient_checkpointing:
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            notes.append(f"{type(model).__name__} has no gradient checkpointing; trained without it")
        else:
            enable()

    parameters = adapter_parameters(model)
    start = adapter_tensors(model)
    optimizer = make_optimizer(config, parameters.values())
    manager = CheckpointManager(config.checkpoint_dir, keep=config.checkpoint_keep) if config.checkpoint_dir else None
    fingerprint = _fingerprint(start, train_data, config)
    micro_batches = math.ceil(n / config.micro_batch) if n else 0
    steps_per_epoch = math.ceil(micro_batches / config.accum_steps) if micro_batches else 0
    total_steps = steps_per_epoch * config.epochs
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)

    state: dict[str, Any] = {
        "epoch": 0, "step_in_epoch": 0, "step": 0, "best": None, "best_epoch": 0, "bad_epochs": 0,
        "history": [], "samples_seen": 0, "replay_samples": 0, "stopped_early": False,
    }  # fmt: skip
    best_tensors: dict[str, torch.Tensor] | None = None
    resumed_from = None
    checkpoint = manager.load_latest() if manager else None
    if checkpoint is not None and checkpoint.state.get("fingerprint") == fingerprint:
        saved = checkpoint.state
        load_adapter_tensors(model, saved["adapter"])
        optimizer.load_state_dict(saved["optimizer"])
        state.update(saved["progress"])
        before = saved["before"]
        best_tensors = saved.get("best_tensors")
        resumed_from = checkpoint.step
        notes.append(f"resumed from the checkpoint at step {checkpoint.step}")
        if checkpoint.skipped:
            notes.append(f"skipped {len(checkpoint.skipped)} corrupt checkpoint(s)")
    else:
        if checkpoint is not None:
            notes.append("ignored a checkpoint from another training run")
            manager.clear()
        before = evaluate(model, val_data) if has_val else {}

    def save_checkpoint() -> None:
        if manager is None:
            return
        payload = {
            "fingerprint": fingerprint,
            "adapter": adapter_tensors(model),
            "optimizer": optimizer.state_dict(),
            "progress": state,
            "before": before,
        }
        if best_tensors is not None:
            payload["best_tensors"] = best_tensors
        manager.save(state["step"], payload)

    bar = _Bar(config.progress_bar if config.progress_bar is not None else sys.stderr.isatty(), total_steps)
    diverged = None
    model.train()
    try:
        while state["epoch"] < config.epochs and n and not state["stopped_early"]:
            epoch = state["epoch"]
            order = torch.randperm(n, generator=torch.Generator().manual_seed(config.seed * 100_003 + epoch))
            for step_in_epoch in range(state["step_in_epoch"], steps_per_epoch):
                if config.max_steps is not None and state["step"] >= config.max_steps:
                    break
                if config.should_stop is not None and config.should_stop():
                    save_checkpoint()  # where it stands, mid-epoch: the next run resumes at this step
                    raise Interrupted(f"stopped at step {state['step']} of {total_steps}")
                first = step_in_epoch * config.accum_steps
                group = range(first, min(first + config.accum_steps, micro_batches))
                rng = np.random.default_rng([config.seed, epoch, step_in_epoch])
                optimizer.zero_grad(set_to_none=True)
                step_loss = 0.0
                for index in group:
                    batch = take(train_data, order[index * config.micro_batch : (index + 1) * config.micro_batch])
                    local = size(batch)
                    extra = round(local * config.replay_ratio / (1 - config.replay_ratio)) if replay else 0
                    replayed = replay.sample(extra, generator=rng) if replay is not None and extra else {}
                    if replayed:
                        batch = concat([batch, replayed])
                    loss = loss_fn(model, batch)
                    if ewc is not None and ewc.active:
                        loss = loss + ewc.penalty(model)
                    if penalty is not None:
                        loss = loss + penalty(model)
                    if not torch.isfinite(loss):
                        diverged = f"training diverged (loss {float(loss.detach())}) at step {state['step'] + 1}"
                        break
                    (loss / len(group)).backward()
                    step_loss += float(loss.detach()) / len(group)
                    state["samples_seen"] += local
                    state["replay_samples"] += size(replayed) if replayed else 0
                if diverged:
                    break
                if config.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(list(parameters.values()), config.max_grad_norm)
                optimizer.step()
                state["step"] += 1
                state["step_in_epoch"] = step_in_epoch + 1
                bar.update(state["step"], step_loss, epoch + 1)
                if progress:
                    progress({"event": "step", "step": state["step"], "total_steps": total_steps,
                              "epoch": epoch + 1, "loss": step_loss})  # fmt: skip
                if manager and config.checkpoint_every and state["step"] % config.checkpoint_every == 0:
                    save_checkpoint()
            if diverged:
                break
            state["epoch"], state["step_in_epoch"] = epoch + 1, 0
            if has_val:
                metrics = evaluate(model, val_data)
                state["history"].append({"epoch": epoch + 1, **metrics})
                if _better(metrics, state["best"], config):
                    state["best"], state["best_epoch"], state["bad_epochs"] = metrics, epoch + 1, 0
                    best_tensors = adapter_tensors(model)
                else:
                    state["bad_epochs"] += 1
                    state["stopped_early"] = state["bad_epochs"] >= config.patience
                if progress:
                    progress({"event": "epoch", "epoch": epoch + 1, **metrics})
            if config.max_steps is not None and state["step"] >= config.max_steps:
                break
            save_checkpoint()
    finally:
        bar.close()
    model.eval()

    result = TrainResult(
        discarded=False,
        reason="",
        before=before,
        after={},
        steps=state["step"],
        epochs_run=state["epoch"],
        best_epoch=state["best_epoch"],
        stopped_early=state["stopped_early"],
        num_samples=n,
        samples_seen=state["samples_seen"],
        replay_samples=state["replay_samples"],
        resumed_from_step=resumed_from,
        history=state["history"],
        notes=notes,
    )
    if diverged:
        load_adapter_tensors(model, start)
        result.discarded, result.reason, result.after = True, diverged + "; kept the starting adapter", before
    elif not n or state["step"] == 0:
        result.discarded, result.reason, result.after = True, "nothing to train on", before
    elif not has_val:
        result.after, result.reason = {}, "trained without a local validation slice (not judged)"
    else:
        if best_tensors is None:  # no epoch finished (max_steps inside the first): judge where it stands
            best_tensors, state["best"] = adapter_tensors(model), evaluate(model, val_data)
        load_adapter_tensors(model, best_tensors)
        result.after = state["best"]
        if _worse(result.after, before, config):
            load_adapter_tensors(model, start)
            result.discarded = True
            result.reason = (
                f"local validation got worse ({config.metric} {before[config.metric]:.4f} -> "
                f"{result.after[config.metric]:.4f}); discarded the update, kept the starting adapter"
            )
        else:
            result.reason = (
                f"local validation {config.metric} {before[config.metric]:.4f} -> {result.after[config.metric]:.4f}"
                f" (accuracy {before['accuracy']:.3f} -> {result.after['accuracy']:.3f}), best epoch "
                f"{state['best_epoch']}" + (", stopped early" if state["stopped_early"] else "")
            )
    if config.refit and has_val and not result.discarded and result.best_epoch:
        load_adapter_tensors(model, start)
        once = replace(config, epochs=result.best_epoch, refit=False, checkpoint_dir=None, update_replay=False,
                       max_steps=None, patience=config.epochs + 1)  # fmt: skip
        everything, nothing = concat([train_data, val_data]), take(val_data, slice(0, 0))
        again = train_adapter(model, everything, nothing, config=once, family=family, replay=replay, penalty=penalty)
        result.steps += again.steps
        result.notes.append(f"refit on all {size(train_data) + size(val_data)} local samples for {once.epochs} epochs")
    if replay is not None and config.update_replay and n:
        replay.add(train_data)
        replay.save()
    if ewc is not None and not result.discarded:
        ewc.consolidate(model, train_data, loss_fn, batch_size=config.micro_batch)
        ewc.save()
    if manager is not None:
        manager.clear()
    result.seconds = time.monotonic() - began
    return result
