"""The rows of the personalization benchmark (``bench/personalization.py``): a registry of methods, and the
plain-torch references (no product training code), each in a ``full`` and a ``lora`` form.

A method is a function ``fn(split) -> Result`` registered with ``@register(name, ...)``: it gets one prepared
``Split`` (``bench/personalization_data.py``: per-device train/test dicts in ``split.devices`` and stacked in
``split.train`` / ``split.test``, version 1's state in ``split.base_state`` / ``split.version1()``, the settings in
``split.config``) and returns each device's accuracy on its local test slice (``[devices]``, NaN for a device
without test samples), plus optional extras (``{name: per-device array}``, e.g. the shared model's accuracy).
``table="forgetting"`` rows instead return the accuracy on the device's earliest samples after its data
drifted (``split.later``), with ``before_drift`` and ``later`` extras. ``split.cache`` holds what methods of
one split share (FedAvg's run, local fine-tuning's models), so a row never depends on which others ran.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from personalization_data import Split
from personalization_engine import (
    HEAD_KEYS,
    Form,
    accuracy,
    broadcast,
    local_train,
    make_form,
    weighted_mean,
)


@dataclass
class Result:
    accuracy: np.ndarray  # per device, on its local test slice (forgetting rows: on its earliest samples)
    extras: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    name: str
    fn: Callable[[Split], Result]
    group: str  # --methods selects by name or group
    form: str  # "full", "lora", or anything a product row calls itself ("product", ...)
    description: str
    table: str = "personalization"  # or "forgetting"


METHODS: dict[str, Method] = {}


def register(
    name: str, *, group: str | None = None, form: str = "-", description: str = "", table: str = "personalization"
):
    def decorate(fn: Callable[[Split], Result]) -> Callable[[Split], Result]:
        if name in METHODS:
            raise ValueError(f"method {name!r} registered twice")
        METHODS[name] = Method(name, fn, group or name, form, description, table)
        return fn

    return decorate


def select(names: list[str]) -> list[Method]:
    """Methods by name or group, in registry order; ValueError for a name that matches none."""
    unknown = [n for n in names if not any(n in (m.name, m.group) for m in METHODS.values())]
    if unknown:
        raise ValueError(f"unknown methods {unknown}: use {sorted(set(METHODS) | {m.group for m in METHODS.values()})}")
    return [m for m in METHODS.values() if m.name in names or m.group in names]


def _progress(split: Split, text: str) -> None:
    print(f"  [{split.scenario} seed {split.seed}] {text}", file=sys.stderr, flush=True)


def _generator(split: Split, tag: int) -> torch.Generator:
    return torch.Generator().manual_seed(split.seed * 1_000_003 + tag)


def _form(split: Split, name: str) -> Form:
    key = ("form", name)
    if key not in split.cache:
        split.cache[key] = make_form(name, split.base_state, split.config, split.seed)
    return split.cache[key]


def _acc(form: Form, params, data) -> np.ndarray:
    return accuracy(form, params, data).numpy()


def _start(split: Split, form: Form) -> dict[str, torch.Tensor]:
    return broadcast(form.start, split.config.devices)


def federated(split: Split, form_name: str, private: tuple[str, ...] = ()) -> dict:
    """FedAvg for ``config.rounds`` rounds, every device every round, weighted by training samples. Keys in
    ``private`` are not averaged: each device keeps its own (FedPer's head). Returns the devices' parameters
    as they start the next round (``models``: shared keys from the last aggregate, private keys their own) and
    the shared model at the start of every round (``shared``: ``rounds + 1`` of them)."""
    key = ("federated", form_name, private)
    if key in split.cache:
        return split.cache[key]
    form, config = _form(split, form_name), split.config
    generator = _generator(split, 11 + len(private))
    models = _start(split, form)
    shared = [dict(form.start)]
    for round_index in range(config.rounds):
        trained = local_train(form, models, split.train, config.local_epochs, config, generator)
        mean = weighted_mean(trained, split.train.n, keys=[k for k in form.keys if k not in private])
        models = {k: (trained[k] if k in private else mean[k].expand_as(trained[k]).clone()) for k in form.keys}
        shared.append(mean)
        if (round_index + 1) % 10 == 0:
            _progress(split, f"{form_name} {'fedper' if private else 'fedavg'} round {round_index + 1}/{config.rounds}")
    split.cache[key] = {"models": models, "shared": shared}
    return split.cache[key]


def local_finetune(split: Split, form_name: str) -> dict[str, torch.Tensor]:
    """Each device fine-tunes version 1 on its own training data (``finetune_epochs``)."""
    key = ("local", form_name)
    if key not in split.cache:
        form = _form(split, form_name)
        epochs = split.config.finetune_epochs
        split.cache[key] = local_train(
            form, _start(split, form), split.train, epochs, split.config, _generator(split, 3)
        )
    return split.cache[key]


def _version1(split: Split) -> Result:
    form = _form(split, "full")
    return Result(_acc(form, _start(split, form), split.test))


def _local(form_name: str) -> Callable[[Split], Result]:
    def run(split: Split) -> Result:
        return Result(_acc(_form(split, form_name), local_finetune(split, form_name), split.test))

    return run


def _fedavg(form_name: str) -> Callable[[Split], Result]:
    def run(split: Split) -> Result:
        form = _form(split, form_name)
        final = broadcast(federated(split, form_name)["shared"][-1], split.config.devices)
        return Result(_acc(form, final, split.test))

    return run


def _fedavg_ft(form_name: str) -> Callable[[Split], Result]:
    def run(split: Split) -> Result:
        form, config = _form(split, form_name), split.config
        final = broadcast(federated(split, form_name)["shared"][-1], config.devices)
        tuned = local_train(form, final, split.train, config.finetune_epochs, config, _generator(split, 5))
        return Result(_acc(form, tuned, split.test), {"shared": _acc(form, final, split.test)})

    return run


def _ditto(form_name: str) -> Callable[[Split], Result]:
    """Ditto (Li et al., ICML 2021): the shared model is FedAvg's (the same run, round by round); each device
    also keeps a personal model, trained every round for ``local_epochs`` from where it was with
    ``lambda / 2 ||p - s||^2`` toward the shared model ``s`` of that round."""

    def run(split: Split) -> Result:
        form, config = _form(split, form_name), split.config
        shared = federated(split, form_name)["shared"]
        personal = _start(split, form)
        generator = _generator(split, 7)
        for round_index in range(config.rounds):
            anchor = broadcast(shared[round_index], config.devices)
            personal = local_train(
                form,
                personal,
                split.train,
                config.local_epochs,
                config,
                generator,
                anchor=anchor,
                lam=config.ditto_lambda,
            )
            if (round_index + 1) % 10 == 0:
                _progress(split, f"{form_name} ditto round {round_index + 1}/{config.rounds}")
        final = broadcast(shared[-1], config.devices)
        return Result(_acc(form, personal, split.test), {"shared": _acc(form, final, split.test)})

    return run


def _fedper(form_name: str) -> Callable[[Split], Result]:
    """FedPer (Arivazhagan et al., 2019): the head stays on the device, the rest is averaged by FedAvg; a
    device's final model is the last shared body with its own head."""

    def run(split: Split) -> Result:
        form = _form(split, form_name)
        return Result(_acc(form, federated(split, form_name, private=HEAD_KEYS)["models"], split.test))

    return run


def _forgetting(form_name: str, replay: bool) -> Callable[[Split], Result]:
    """Local fine-tuning (from version 1, on the device's own, earliest, data: ``local_finetune``), then the
    drift: ``finetune_epochs`` more on its later data (``split.later``), with or without replayed samples from
    a reservoir of its earliest training data. Accuracy on the held-out slice of its earliest data (its local
    test slice) after the drift; extras: the same before the drift, and on a held-out slice of the later data."""

    def run(split: Split) -> Result:
        form, config = _form(split, form_name), split.config
        before = local_finetune(split, form_name)
        after = local_train(
            form, before, split.later, config.finetune_epochs, config, _generator(split, 9),
            replay=split.replay if replay else None,
        )  # fmt: skip
        extras = {"before_drift": _acc(form, before, split.test), "later": _acc(form, after, split.later_test)}
        return Result(_acc(form, after, split.test), extras)

    return run


register("version1", form="both", description="the shared version 1 alone (the factory base; no training)")(_version1)
for _name in ("full", "lora"):
    register(f"local-{_name}", group="local", form=_name, description="local fine-tuning from version 1 only")(
        _local(_name)
    )
    register(f"fedavg-{_name}", group="fedavg", form=_name, description="FedAvg, the final shared model")(
        _fedavg(_name)
    )
    register(f"fedavg_ft-{_name}", group="fedavg_ft", form=_name, description="FedAvg, then local fine-tuning")(
        _fedavg_ft(_name)
    )
    register(f"ditto-{_name}", group="ditto", form=_name, description="Ditto: personal models pulled to FedAvg's")(
        _ditto(_name)
    )
    register(f"fedper-{_name}", group="fedper", form=_name, description="FedPer: private head, FedAvg for the rest")(
        _fedper(_name)
    )
for _name in ("full", "lora"):
    for _replay in (False, True):
        register(
            f"drift{'_replay' if _replay else ''}-{_name}",
            group="forgetting",
            form=_name,
            description=f"local fine-tuning, then later data {'with' if _replay else 'without'} replay",
            table="forgetting",
        )(_forgetting(_name, _replay))
