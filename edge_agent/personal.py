"""The device's own model: a personal adapter trained on its own data, kept beside the shared version.

The shared version (what the server rolled out) carries what the fleet learned together; the personal model
carries what this device learned from its user, and never leaves it (only its accuracy does, in heartbeats).
How it is made is the adapter's ``personalization`` setting, signed into the manifest's ``training`` object
(README "Personalization"):

- ``none``: no personal model; the device serves the shared version (the behaviour before personalization).
- ``finetune``: the shared version fine-tuned on local data; re-derived from each new shared version.
- ``ditto``: a personal adapter that lives across versions, trained with a pull ``lambda/2 ||p - s||^2`` toward the
  installed shared adapter ``s``. With ``release_classes`` (the default) the pull is lifted from the classifier's
  rows of the classes the device's own labels contradict: where the shared version calls more than half of the
  device's samples of a class something else, and is sure of it (mean top-class probability 0.9 or more), that
  class's row and the rows of what it was called train free. A user who names two digits the other way round
  gets a head of their own for those classes, while every class the device agrees on (or has no samples of)
  stays pulled toward the shared head and is not forgotten. The released
  rows are the device's own in the shared pass too: it starts from the shared version with its own rows in their
  place and uploads no change of them (``own_rows``, ``hide_rows``), so the shared head is not pulled toward one
  user's names. Only a relabeling is released: where the shared version reads two of the device's labels as one
  class, or misreads them unsure, its inputs differ from the fleet's, and every row stays pulled (bench/README.md,
  "The default adapter's shape"). A device with released rows trains its personal pass for a quarter of ``epochs``
  (``RELEASED_EPOCHS_SHARE``): its free rows fit a handful of samples, which the full length overfits.
- ``private_modules``: the named modules (the classifier head, say) stay on the device: the shared pass trains
  with the device's own copy of them and uploads no change to them; the personal model is the shared version
  with the device's modules in place, which are then trained alone on local data (FedPer / FedRep).

Whatever the method, the uploaded delta keeps its meaning (the change to the shared adapter). After each pass
the device measures the shared version and its personal model on its held slice (``device_split``: every 10th
sample, which no pass of either model trains on) and serves the personal one only where it is better by
``margin`` on at least ``min_val_samples`` samples.

On disk (``<home>/personal/``): ``state.json`` (the method, which shared version the model derives from, the
last measurement, what is served) and the adapter file it names (``adapter-<n>.safetensors``). A new model is
written under a new name first, then ``state.json`` is swapped in one rename, so a power cut leaves the old
pair or the new one, never a mix. Training checkpoints live in ``checkpoints/`` and resume after a kill.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch import nn

from edge_agent.families.common import LABEL, batched_logits, size
from edge_agent.identity import atomic_write
from edge_agent.lora_layers import PREFIX, adapter_parameters, load_adapter_tensors
from edge_agent.protocol import PERSONALIZATION_DEFAULTS, PERSONALIZATION_METHODS
from edge_agent.training import TrainConfig, TrainResult, train_adapter

logger = logging.getLogger("edge_agent.personal")
METHODS = PERSONALIZATION_METHODS
CLASSIFIER = "head"  # the module whose rows are the classes (a family may name another: ``classifier``)
CONTRADICTED_SHARE = 0.5  # of a class's samples the shared version must call something else (more than this)
SURE = 0.9  # the shared version's mean top-class probability on those samples, at least (contradicted_classes)
# ditto: the share of ``epochs`` a device with released rows trains its personal model for. Its free rows fit a
# handful of samples of its own names, and longer runs overfit them: on the tuning seed, concept devices fell
# from 0.855 (5 epochs) to 0.829 (10) and 0.786 (20), while feature and label devices gained from 20 (bench/README.md,
# "The personal pass's length").
RELEASED_EPOCHS_SHARE = 0.25
PERSONAL_DIR = "personal"
STATE_FILE = "state.json"


@dataclass(frozen=True)
class PersonalSettings:
    """The adapter's ``personalization`` setting as the manifest carries it (absent: ``none``); a setting the
    object leaves out takes the server's default (``PERSONALIZATION_DEFAULTS``)."""

    method: str = "none"  # no personalization object in the manifest: no personal model
    lam: float = PERSONALIZATION_DEFAULTS["lambda"]  # "lambda" in the manifest
    private_modules: tuple[str, ...] = tuple(PERSONALIZATION_DEFAULTS["private_modules"])
    epochs: int = PERSONALIZATION_DEFAULTS["epochs"]
    lr: float = PERSONALIZATION_DEFAULTS["lr"]
    margin: float = PERSONALIZATION_DEFAULTS["margin"]
    min_val_samples: int = PERSONALIZATION_DEFAULTS["min_val_samples"]
    # ditto: no pull on the classifier rows the device's labels contradict
    release_classes: bool = PERSONALIZATION_DEFAULTS["release_classes"]

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown personalization method {self.method!r}: use one of {list(METHODS)}")
        if not (math.isfinite(self.lam) and self.lam >= 0 and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError("personalization lambda must be >= 0 and lr > 0, both finite")
        if not isinstance(self.release_classes, bool):
            raise ValueError("personalization release_classes must be true or false")

    @classmethod
    def from_training(cls, training: dict | None) -> PersonalSettings:
        values = dict((training or {}).get("personalization") or {})
        if "lambda" in values:
            values["lam"] = values.pop("lambda")
        known = {k: v for k, v in values.items() if k in cls.__dataclass_fields__}
        if "private_modules" in known:
            known["private_modules"] = tuple(known["private_modules"])
        return cls(**known)

    def as_dict(self) -> dict:
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        values["lambda"] = values.pop("lam")
        return {**values, "private_modules": list(self.private_modules)}


def private_keys(keys, modules) -> set[str]:
    """The adapter tensors (PEFT keys) that belong to the private ``modules``."""
    prefixes = tuple(f"{PREFIX}{m}." for m in modules)
    return {key for key in keys if key.startswith(prefixes)}


def derive(shared: dict, personal: dict | None, settings: PersonalSettings) -> dict:
    """The personal model's starting tensors given the installed shared ones: for ``private_modules`` the shared
    version with the device's own modules in place, otherwise the personal adapter as it stands (or, before
    there is one or where a tensor's shape changed, the shared one)."""
    if settings.method == "none" or not personal:
        return dict(shared)
    keys = private_keys(shared, settings.private_modules) if settings.method == "private_modules" else set(shared)
    return {
        key: personal[key] if key in keys and key in personal and personal[key].shape == value.shape else value
        for key, value in shared.items()
    }


def classifier_keys(keys, family=None) -> list[str]:
    """The adapter's tensors of the family's classifier module (trained in full as a module to save), whose
    first dimension is the classes."""
    prefix = f"{PREFIX}{getattr(family, 'classifier', CLASSIFIER)}."
    return [key for key in keys if key.startswith(prefix) and ".lora_" not in key]


def contradicted_classes(
    model: nn.Module, data: dict, *, share: float = CONTRADICTED_SHARE, sure: float = SURE
) -> list[int]:
    """The classes whose meaning on this device differs from the shared version's (``model``): for each label
    the device has, if the model predicts another class for more than ``share`` of its samples (so one misread
    sample of two is not a contradiction), and is sure of it (its mean top-class probability over those samples
    at least ``sure``), that label and the classes it predicted instead. Sorted; empty when the device agrees
    with the shared version.

    A user who names a digit their own way hands the shared version clean samples of another digit, which it
    reads with confidence; a sensor unlike the fleet's (rotated, scaled) gives samples it misreads unsure. Those
    are the body's to learn under the pull, not a free head's fitted to a few samples (bench/README.md, "The
    default adapter's shape": the shared version's mean confidence on a released label's misread samples was
    0.89 to 1.0 on concept devices, 0.45 to 0.85 on all but one feature device). And only a relabeling counts:
    each of the device's labels is read as one class (the model's most frequent prediction for its samples), and
    no two labels may be read as the same class; where two are, nothing is released."""
    if not data or not size(data):
        return []
    probabilities = torch.cat([logits.softmax(-1) for _, logits in batched_logits(model, data)])
    confidence, predicted = probabilities.max(-1)
    labels = torch.as_tensor(data[LABEL])
    released: set[int] = set()
    read_as: dict[int, int] = {}
    for label in labels.unique().tolist():
        mine = labels == label
        called = predicted[mine]
        read_as[int(label)] = int(torch.mode(called).values)
        wrong = called != label
        if int(wrong.sum()) > share * len(called) and float(confidence[mine][wrong].mean()) >= sure:
            released.update({int(label), *(int(c) for c in called[wrong].unique())})
    if len(set(read_as.values())) < len(read_as):
        return []
    return sorted(released)


def released_rows(
    shared_model: nn.Module, train: dict, settings: PersonalSettings, family=None
) -> dict[str, list[int]]:
    """Under ``ditto`` with ``release_classes``: the classifier rows (adapter key -> class indices) of the
    classes the device's labels contradict (``contradicted_classes`` of the shared version ``shared_model``);
    empty otherwise. They train free of the pull in the personal pass, and are the device's own in the shared
    pass (``own_start``, ``hide_rows``)."""
    if settings.method != "ditto" or not settings.release_classes or not train:
        return {}
    released = contradicted_classes(shared_model, train)
    return dict.fromkeys(classifier_keys(adapter_parameters(shared_model), family), released) if released else {}


def own_rows(shared: dict, personal: dict | None, rows: dict[str, list[int]]) -> dict:
    """The shared tensors with the device's own rows (its personal model's) in place of the released ones: where
    a ditto device's shared pass starts, so the shared head's rows of those classes are not pulled toward this
    user's names for them and the body learns beside the device's own head (as FedPer's does)."""
    out = dict(shared)
    for key, indices in rows.items():
        if personal and key in personal and personal[key].shape == shared[key].shape:
            out[key] = shared[key].clone()
            out[key][indices] = personal[key][indices]
    return out


def own_start(
    model: nn.Module, shared: dict, personal: dict | None, train: dict, settings: PersonalSettings, family=None
) -> dict[str, list[int]]:
    """Where a ditto device's shared pass starts: ``model`` carries the installed shared adapter ``shared``;
    the rows of the classes its labels rename (``released_rows``) are replaced by its own (``own_rows``).
    Returns those rows, for ``hide_rows`` and for the personal pass (``personalize(released=...)``)."""
    rows = released_rows(model, train, settings, family)
    if rows:
        load_adapter_tensors(model, own_rows(shared, personal, rows))
    return rows


def hide_rows(upload: dict, started: dict, rows: dict[str, list[int]]) -> dict:
    """``upload`` (the trained shared adapter) with the released rows put back as installed (``started``), so no
    change of the device's own rows leaves it: the delta is zero there."""
    for key, indices in rows.items():
        upload[key] = upload[key].clone()
        upload[key][indices] = started[key][indices]
    return upload


def proximal_penalty(
    model: nn.Module, anchor: dict[str, torch.Tensor], lam: float, *, free_rows: dict[str, list[int]] | None = None
) -> Callable[[nn.Module], torch.Tensor]:
    """Ditto's ``lambda/2 * ||p - s||^2`` over the adapter's trainable tensors, ``s`` = ``anchor``; the rows
    named in ``free_rows`` (key -> row indices along the first dimension) are left out of it."""
    anchors = {key: anchor[key].detach().clone() for key in adapter_parameters(model)}
    weights = {}
    for key, rows in (free_rows or {}).items():
        weight = torch.ones(anchors[key].shape[0], dtype=anchors[key].dtype)
        weight[list(rows)] = 0.0
        weights[key] = weight.view(-1, *([1] * (anchors[key].dim() - 1)))

    def penalty(live: nn.Module) -> torch.Tensor:
        parameters = adapter_parameters(live)
        total = 0.0
        for key, value in anchors.items():
            squared = (parameters[key] - value) ** 2
            total = total + (squared * weights[key] if key in weights else squared).sum()
        return 0.5 * lam * total

    return penalty


@dataclass
class PersonalOutcome:
    tensors: dict[str, torch.Tensor] | None  # the personal adapter (None with method "none")
    shared: dict[str, float]  # the shared version on the device's held slice
    personal: dict[str, float]  # the personal model (as kept, after its refit) on it
    serving: str  # "personal" or "shared"
    result: TrainResult | None = None
    notes: list[str] = field(default_factory=list)


def choose(shared: dict, personal: dict, settings: PersonalSettings) -> str:
    """Which model the device serves. The personal one, unless the held slice says it does not help: on at
    least ``min_val_samples`` samples it is not better than the shared version by ``margin``. A device with
    fewer held samples than that cannot tell the two apart and keeps its personal model, which every
    method keeps near the shared version or trains from it (bench/README.md, "personalization.py"). When both
    are right on exactly the same share of the held slice (a few samples, or samples the application handed over
    more than once, where both score 100%), the held slice's loss decides: the model more sure of the right
    answers (bench/README.md, "fleet_learning.py")."""
    if settings.method == "none" or not personal or not shared:
        return "shared"
    if int(personal.get("samples", 0)) < max(settings.min_val_samples, 1):
        return "personal"
    mine, theirs = personal.get("accuracy", float("nan")), shared.get("accuracy", float("nan"))
    if mine >= theirs + settings.margin:
        return "personal"
    tied = abs(mine - theirs) < 1e-9 and personal.get("loss", float("inf")) < shared.get("loss", float("nan"))
    return "personal" if tied else "shared"


def personalize(
    *,
    build: Callable[[dict], nn.Module],
    shared: dict[str, torch.Tensor],
    personal: dict[str, torch.Tensor] | None,
    train: dict,
    val: dict,
    held: dict,
    settings: PersonalSettings,
    family,
    config: TrainConfig,
    replay=None,
    train_personal: bool = True,
    released: dict[str, list[int]] | None = None,
) -> PersonalOutcome:
    """One personal pass on the device's data: start from ``derive(shared, personal)``, train on ``train`` as the
    method says, judged on ``val`` and then refit on both (unless ``train_personal`` is false: then only
    measure), measure both models on ``held`` and choose. ``held`` is what neither this pass nor any earlier one
    of either model trained on (``device_split``), so the two figures and the gain between them are held out.
    ``released``: the rows ``own_start`` found for the same shared version and data (else found here).
    ``build(tensors)`` gives the base model carrying those adapter tensors. Used by the runtime and, on the
    same code path, by ``bench/personalization.py``."""
    shared_model = build(shared).eval()
    shared_metrics = family.evaluate(shared_model, held)
    if settings.method == "none":
        return PersonalOutcome(None, shared_metrics, {}, "shared")
    model = build(derive(shared, personal, settings))
    result, penalty, notes, epochs = None, None, [], settings.epochs
    if settings.method == "ditto":
        rows = {}
        if train_personal:
            rows = released if released is not None else released_rows(shared_model, train, settings, family)
        penalty = proximal_penalty(model, shared, settings.lam, free_rows=rows)
        if rows:
            released = next(iter(rows.values()))
            epochs = max(1, math.ceil(settings.epochs * RELEASED_EPOCHS_SHARE))
            notes.append(f"classes {released} train free of the pull: the device's labels contradict the shared one "
                         f"({epochs} of {settings.epochs} epochs)")  # fmt: skip
    if settings.method == "private_modules":
        private = private_keys(adapter_parameters(model), settings.private_modules)
        for key, parameter in adapter_parameters(model).items():
            parameter.requires_grad_(key in private)
    if train_personal:
        # A fixed budget of epochs, kept whole (the last epoch, not the best of a tiny validation slice by loss),
        # undone only if held-out accuracy got worse, then refit on all local data (TrainConfig.refit).
        run = replace(config, epochs=epochs, lr=settings.lr, update_replay=False, metric="accuracy",
                      min_delta=-1.0, patience=epochs + 1, refit=True, restrict_classes=False,
                      judge_min_samples=settings.min_val_samples)  # fmt: skip
        result = train_adapter(model, train, val, config=run, family=family, replay=replay, penalty=penalty)
        result.notes[:0] = notes
    tensors = {k: p.detach().clone().contiguous() for k, p in adapter_parameters(model).items()}
    personal_metrics = family.evaluate(model.eval(), held)  # the model kept: refit, trained or undone
    return PersonalOutcome(
        tensors, shared_metrics, personal_metrics, choose(shared_metrics, personal_metrics, settings), result
    )


class PersonalStore:
    """``<home>/personal/``: the personal adapter and what the device knows of it (module docstring)."""

    def __init__(self, home: Path):
        self.root = Path(home) / PERSONAL_DIR
        self.state_path = self.root / STATE_FILE

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def start_path(self) -> Path:
        """The tensors a pending pass started from where they are nowhere else (``private_modules``: the shared
        pass's own modules), so a pass cut short resumes from them, and so from its checkpoint."""
        return self.root / "pending-start.safetensors"

    def keep_start(self, tensors: dict[str, torch.Tensor]) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(self.start_path, save({k: v.contiguous() for k, v in sorted(tensors.items())}))

    def state(self) -> dict:
        try:
            return json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        except ValueError:  # written atomically: only a hand edit gets here
            logger.warning("%s is not JSON; starting the personal model afresh", self.state_path)
            return {}

    def tensors(self) -> dict[str, torch.Tensor] | None:
        name = self.state().get("file")
        path = self.root / name if name else None
        return load_file(str(path)) if path and path.exists() else None

    def save(self, tensors: dict[str, torch.Tensor] | None, **fields) -> dict:
        """Write a new personal adapter (if given) and the state naming it, in that order; returns the state."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        state = self.state()
        old = state.get("file")
        if tensors is not None:
            number = int(state.get("saved", 0)) + 1
            name = f"adapter-{number}.safetensors"
            atomic_write(self.root / name, save({k: v.contiguous() for k, v in sorted(tensors.items())}))
            state.update(file=name, saved=number)
        state.update(fields, updated_at=round(time.time(), 3))
        atomic_write(self.state_path, json.dumps(state, indent=2).encode(), mode=0o600)
        if tensors is not None and old and old != state["file"]:
            (self.root / old).unlink(missing_ok=True)
        return state

    def report(self) -> dict | None:
        """The heartbeat's ``personal`` object (docs/protocol/README.md, "Heartbeats"), or None before the first
        measurement."""
        state = self.state()
        measured = (state.get("shared_accuracy"), state.get("personal_accuracy"))
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in measured):
            return None  # not measured yet, or nothing to measure on (no validation samples)
        fields = ("adapter", "version", "method", "serving", "shared_accuracy", "personal_accuracy", "val_samples",
                  "trained_samples", "updated_at")  # fmt: skip
        return {key: state.get(key) for key in fields}
