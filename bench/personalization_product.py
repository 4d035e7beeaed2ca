"""The product's rows of the personalization benchmark: each personalization method through the agent's own
training code (``edge_agent.training.train_adapter`` for the shared pass, ``edge_agent.personal.personalize``
for the personal one, the same calls ``DeviceRuntime.train_once`` makes), on the same split as the references.

A round: every device starts from the installed shared version (with its own private modules under
``private_modules``), trains as the agent does on its local train slice (``device_split``: of every ten
samples the 5th is its validation slice, the 10th held), and, unless the agent would discard the update (local
validation got worse), uploads the change; the server's FedAvg (weighted by samples) makes the next version.
After its shared pass each device runs its personal pass. A row reports the model the device serves
(``personalize``'s choice between personal and shared on its held slice), with the personal model, the shared
version and what the device itself reported of both in the last round (``reported_personal``,
``reported_shared``, on its held slice, nan with none) as extras; ``product shared`` is the shared version the
product reaches. Rows of one split share the federated runs (``split.cache``).
"""

from __future__ import annotations

import copy
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from personalization_data import Split
from personalization_methods import Result, register

from edge_agent import personal as device_pass  # own_start, hide_rows: as train_once calls them
from edge_agent.families.digits import DigitsCNN, DigitsNet
from edge_agent.lora_layers import adapter_tensors, apply_adapter
from edge_agent.personal import PersonalSettings, derive, personalize, private_keys
from edge_agent.runtime import JUDGE_MIN_SAMPLES
from edge_agent.samples import ReplayBuffer, device_split, local_split
from edge_agent.training import TrainConfig, train_adapter
from training.registry.personalization_settings import PERSONALIZATION_DEFAULTS  # plain Python: no Django needed

FAMILY = DigitsCNN()
TARGETS, SAVED = FAMILY.default_targets, FAMILY.default_modules_to_save
# Config.product_adapter "full": no LoRA, every layer trained and shared (a small model fine-tuned in full).
FULL_SAVED = ("conv1", "conv2", "fc1", "head")
ADAPTERS = ("lora", "full")


def shape(config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The product rows' shared adapter: (LoRA target modules, modules to save). Read from the module globals
    at call time: ``bench/personalization_minilm.py`` sets ``TARGETS`` and ``SAVED`` to MiniLM's for its run."""
    if config.product_adapter not in ADAPTERS:
        raise ValueError(f"product_adapter must be one of {list(ADAPTERS)}, not {config.product_adapter!r}")
    return ((), FULL_SAVED) if config.product_adapter == "full" else (TARGETS, SAVED)


METHOD_NAMES = ("ditto", "ditto_pull_all", "finetune", "private_modules")
# Rows that are a method with one setting changed: ditto as it was before release_classes (every class pulled).
VARIANTS = {"ditto_pull_all": ("ditto", {"release_classes": False})}
DEFAULT = PERSONALIZATION_DEFAULTS["method"]


def settings(split: Split, method: str) -> PersonalSettings:
    """The server's default personalization setting (what the product ships) with ``method`` (or a variant's
    method and its changes); ``--set`` overrides of the benchmark's ``product_*`` settings apply on top."""
    method, changes = VARIANTS.get(method, (method, {}))
    values = {**PERSONALIZATION_DEFAULTS, "method": method, **changes, **split.config.product_overrides()}
    return PersonalSettings.from_training({"personalization": values})


def _train_config(split: Split, tag: int, epochs: int, **extra) -> TrainConfig:
    config = split.config
    lr = config.lr_full if config.product_adapter == "full" else config.lr_lora
    return TrainConfig(epochs=epochs, lr=lr, micro_batch=config.batch, max_grad_norm=config.clip,
                       seed=split.seed * 1_000_003 + tag, refit=True, judge_min_samples=JUDGE_MIN_SAMPLES,
                       **extra)  # fmt: skip


class Devices:
    """The fleet of one split as the agent sees it: version 1, the base to build models on, each device's local
    train, validation and held slices (of its training data) and its test slice."""

    def __init__(self, split: Split):
        self.split = split
        self.base = DigitsNet(width=16)
        self.base.load_state_dict(split.base_state)
        self.version1 = adapter_tensors(self.build(None, seed=split.seed))
        self.local = [device_split(d["train"]) for d in split.devices]
        self.tests = [d["test"] for d in split.devices]

    def build(self, tensors, *, seed: int = 0):
        config = self.split.config
        targets, saved = shape(config)
        return apply_adapter(copy.deepcopy(self.base), tensors, rank=config.rank, alpha=config.alpha,
                             target_modules=targets, modules_to_save=saved, seed=seed)  # fmt: skip

    def accuracy(self, tensors_per_device) -> np.ndarray:
        out = []
        for tensors, test in zip(tensors_per_device, self.tests, strict=True):
            out.append(FAMILY.evaluate(self.build(tensors).eval(), test)["accuracy"] if len(test["y"]) else np.nan)
        return np.asarray(out)


def _devices(split: Split) -> Devices:
    if "product-devices" not in split.cache:
        split.cache["product-devices"] = Devices(split)
    return split.cache["product-devices"]


def federated(split: Split, row: str = "ditto") -> dict:
    """The product's federated run for one row (``ditto``, ``ditto_pull_all`` or ``private_modules``): every
    round each device runs its shared pass as ``DeviceRuntime.train_once`` does (from the installed shared
    version with the device's own private modules, or, under ditto with ``release_classes``, its own classifier
    rows of the classes its labels contradict, none of which it uploads a change of), the server's FedAvg makes
    the next version, and each device runs its personal pass. Returns ``{"shared", "personal": [per device],
    "served": [per device], "reported": [(personal, shared) per device], "released": [per device: rows released
    in the last round]}``."""
    key = ("product-federated", row)
    if key in split.cache:
        return split.cache[key]
    fleet, config = _devices(split), split.config
    private = row == "private_modules"
    personal_settings = settings(split, row)
    shared = dict(fleet.version1)
    hidden = private_keys(shared, SAVED) if private else set()
    personal: list[dict | None] = [None] * config.devices
    served = ["shared"] * config.devices
    reported = [(np.nan, np.nan)] * config.devices
    released = [False] * config.devices  # in the last round: rows of classes its labels rename trained free
    discarded = 0
    for round_index in range(config.rounds):
        deltas, weights, personal_next = [], [], []
        for d, (train, val, held) in enumerate(fleet.local):
            model = fleet.build(derive(shared, personal[d], personal_settings) if private else shared)
            rows = device_pass.own_start(model, shared, personal[d], train, personal_settings, FAMILY)
            released[d] = bool(rows)
            run = _train_config(split, round_index * 1000 + d, config.local_epochs)
            result = train_adapter(model, train, val, config=run, family=FAMILY)
            trained = adapter_tensors(model)
            if result.discarded:
                discarded += 1
            else:
                upload = device_pass.hide_rows(dict(trained), shared, rows)
                deltas.append({k: (upload[k] - shared[k]) if k not in hidden else torch.zeros_like(v)
                               for k, v in shared.items()})  # fmt: skip
                weights.append(max(result.num_samples, 1))
            outcome = personalize(
                build=fleet.build, shared=shared, personal=trained if private else personal[d], train=train,
                val=val, held=held, settings=personal_settings, family=FAMILY,
                config=_train_config(split, round_index * 1000 + d + 500, 1), released=rows,
            )  # fmt: skip
            personal_next.append(outcome.tensors)
            served[d] = outcome.serving
            reported[d] = (outcome.personal.get("accuracy", np.nan), outcome.shared.get("accuracy", np.nan))
        personal = personal_next
        if deltas:
            total = float(sum(weights))
            shared = {k: v + sum(w * delta[k] for w, delta in zip(weights, deltas, strict=True)) / total
                      for k, v in shared.items()}  # fmt: skip
        if (round_index + 1) % 10 == 0:
            print(f"  [{split.scenario} seed {split.seed}] product {row} round {round_index + 1}/{config.rounds} "
                  f"({discarded} updates discarded so far)", file=sys.stderr, flush=True)  # fmt: skip
    split.cache[key] = {"shared": shared, "personal": personal, "served": served, "reported": reported,
                        "released": released}  # fmt: skip
    return split.cache[key]


def finetuned(split: Split) -> dict:
    """``finetune``: each device's personal model re-derived from the last shared version by its personal pass."""
    key = "product-finetune"
    if key not in split.cache:
        fleet, shared = _devices(split), federated(split)["shared"]
        personal, served, reported = [], [], []
        for d, (train, val, held) in enumerate(fleet.local):
            outcome = personalize(build=fleet.build, shared=shared, personal=None, train=train, val=val, held=held,
                                  settings=settings(split, "finetune"), family=FAMILY,
                                  config=_train_config(split, 900_000 + d, 1))  # fmt: skip
            personal.append(outcome.tensors)
            served.append(outcome.serving)
            reported.append((outcome.personal.get("accuracy", np.nan), outcome.shared.get("accuracy", np.nan)))
        split.cache[key] = {"shared": shared, "personal": personal, "served": served, "reported": reported}
    return split.cache[key]


def _outcome(split: Split, method: str) -> dict:
    """``{"shared", "personal", "served"}`` of one row (per-device lists)."""
    if method == "finetune":
        return finetuned(split)
    return federated(split, method)


def _row(method: str):
    def run(split: Split) -> Result:
        fleet, outcome = _devices(split), _outcome(split, method)
        shared = outcome["shared"]
        personal = [derive(shared, p, settings(split, method)) for p in outcome["personal"]]
        served = [p if s == "personal" else shared for p, s in zip(personal, outcome["served"], strict=True)]
        return Result(
            fleet.accuracy(served),
            {"personal": fleet.accuracy(personal), "shared": fleet.accuracy([shared] * len(personal)),
             "serving_personal": np.asarray([s == "personal" for s in outcome["served"]], dtype=float),
             "reported_personal": np.asarray([p for p, _ in outcome["reported"]], dtype=float),
             "reported_shared": np.asarray([s for _, s in outcome["reported"]], dtype=float),
             "released": np.asarray(outcome.get("released", [False] * len(personal)), dtype=float)},
        )  # fmt: skip

    return run


def _shared(split: Split) -> Result:
    fleet = _devices(split)
    return Result(fleet.accuracy([federated(split)["shared"]] * split.config.devices))


def _drift(replay: bool):
    """The agent's local training on the device's earliest data, then on its later data, with or without its
    reservoir replay buffer (``ReplayBuffer``, capacity as the references'); accuracy on its earliest data."""

    def run(split: Split) -> Result:
        fleet, config = _devices(split), split.config
        after, before = [], []
        with tempfile.TemporaryDirectory() as folder:
            for d, device in enumerate(split.devices):
                model = fleet.build(fleet.version1)
                buffer = ReplayBuffer(Path(folder) / f"replay-{d}.npz", capacity=config.replay_capacity, seed=d)
                early_train, early_val = local_split(device["train"], val_fraction=0.2)  # no personal pass here
                first = _train_config(split, 700_000 + d, config.finetune_epochs)
                train_adapter(model, early_train, early_val, config=first, family=FAMILY, replay=buffer)
                before.append(adapter_tensors(model))
                later_train, later_val = local_split(device["later"], val_fraction=0.2)
                share = config.replay_share if replay else 0.0
                second = replace(first, seed=first.seed + 1, replay_ratio=share)
                train_adapter(model, later_train, later_val, config=second, family=FAMILY,
                              replay=buffer if replay else None)  # fmt: skip
                after.append(adapter_tensors(model))
        later = []
        for tensors, device in zip(after, split.devices, strict=True):
            test = device["later_test"]
            later.append(FAMILY.evaluate(fleet.build(tensors).eval(), test)["accuracy"] if len(test["y"]) else np.nan)
        return Result(fleet.accuracy(after), {"before_drift": fleet.accuracy(before), "later": np.asarray(later)})

    return run


for _method in METHOD_NAMES:
    register(f"product-{_method}", group="product", form="product",
             description=f"the product's {_method} (the served model: personal or shared, as the device chose)"
                         + (f"; {VARIANTS[_method]}" if _method in VARIANTS else ""))(
        _row(_method))  # fmt: skip
register("product-default", group="product", form="product",
         description=f"the product as it ships: its default method ({DEFAULT}), served as the device chooses")(
    _row(DEFAULT))  # fmt: skip
register("product-shared", group="product", form="product", description="the shared version the product reaches")(
    _shared
)
for _replay in (False, True):
    register(f"product-drift{'_replay' if _replay else ''}", group="product-forgetting", form="product",
             description=f"the agent's training, then later data {'with' if _replay else 'without'} its replay buffer",
             table="forgetting")(_drift(_replay))  # fmt: skip
