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
  class, or misreads them unsure, its inputs differ from the fleet's, and every row stays pulled
  (bench/README.md as of 9a8d7eb, "The default adapter's shape").
- ``private_modules``: the named modules (the classifier head, say) stay on the device: the shared pass trains
  with the device's own copy of them and uploads no change to them; the personal model is the shared version
  with the device's modules in place, which are then trained alone on local data (FedPer / FedRep).

Whatever the method, the uploaded delta keeps its meaning (the change to the shared adapter). After each pass
the device measures the shared version and its personal model on its held slice (``device_split``: every 10th
sample, which no pass of either model trains on) and serves the personal one unless the held slice says the
shared version is better by ``margin`` and beyond chance on at least ``min_val_samples`` distinct samples
(``choose``). A device that holds fewer samples than a shared pass needs runs the personal pass alone, each time
what it holds has doubled (``DeviceRuntime._personal_on_few_samples``).

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

from edge_agent.families.common import LABEL, batched_logits, concat, size
from edge_agent.identity import atomic_write
from edge_agent.lora_layers import PREFIX, adapter_parameters, load_adapter_tensors
from edge_agent.protocol import PERSONALIZATION_DEFAULTS, PERSONALIZATION_METHODS
from edge_agent.pseudo_labels import UNLABELED_METHODS, pseudo_labelled
from edge_agent.training import TrainConfig, TrainResult, train_adapter

logger = logging.getLogger("edge_agent.personal")
METHODS = PERSONALIZATION_METHODS
CLASSIFIER = "head"  # the module whose rows are the classes (a family may name another: ``classifier``)
CONTRADICTED_SHARE = 0.5  # of a class's samples the shared version must call something else (more than this)
SURE = 0.9  # the shared version's mean top-class probability on those samples, at least (contradicted_classes)
# The personal pass stops after this many epochs without a lower validation loss, and keeps its best epoch: a fixed
# 20 epochs (5 where rows were released) left devices whose sensor or names differ 2 to 10 points below a plain
# local fine-tune that stops so (bench/README.md, "fleet_learning.py").
PATIENCE = 5
PSEUDO_RATIO = 1  # pseudo-labelled samples a personal pass adds at most, per labelled training sample
CHANCE = 0.05  # choose: the sign test's level below which the held slice says the shared version is better
REPEAT = 0.1  # held samples whose inputs differ by less than this share of their size count once (repeats)
MAX_GROUPED = 2000  # repeats: above this many held samples, each counts (a distance matrix of 16 MB)
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
    unlabeled: str = PERSONALIZATION_DEFAULTS["unlabeled"]  # the personal pass's unlabeled samples (pseudo_labels)
    confidence: float = PERSONALIZATION_DEFAULTS["confidence"]

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown personalization method {self.method!r}: use one of {list(METHODS)}")
        if not (math.isfinite(self.lam) and self.lam >= 0 and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError("personalization lambda must be >= 0 and lr > 0, both finite")
        if not isinstance(self.release_classes, bool):
            raise ValueError("personalization release_classes must be true or false")
        if self.unlabeled not in UNLABELED_METHODS or not 0 < self.confidence <= 1:
            raise ValueError(
                f"personalization unlabeled must be one of {list(UNLABELED_METHODS)}, confidence in (0, 1]"
            )

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
    are the body's to learn under the pull, not a free head's fitted to a few samples (bench/README.md as of
    9a8d7eb, "The default adapter's shape": the shared version's mean confidence on a released label's misread
    samples was 0.89 to 1.0 on concept devices, 0.45 to 0.85 on all but one feature device). And only a
    relabeling counts: each of the device's labels is read as one class (the model's most frequent prediction for
    its samples), and no two labels may be read as the same class; where two are, nothing is released."""
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


def sign_test(ahead: int, behind: int) -> float:
    """The one-sided exact sign test (McNemar's, exact) of paired judgements: the chance of at least ``ahead``
    wins in ``ahead + behind`` fair coin tosses, i.e. that one model is right where the other is wrong on
    ``ahead`` held samples, and the reverse on ``behind``, by chance alone."""
    n = ahead + behind
    if ahead <= 0:
        return 1.0
    return sum(math.comb(n, k) for k in range(ahead, n + 1)) / 2**n


def choose(shared: dict, personal: dict, settings: PersonalSettings) -> str:
    """Which model the device serves: its own, unless its held slice says the shared version is better, by
    ``margin`` in accuracy and beyond chance: on at least ``min_val_samples`` distinct held samples
    (``distinct``: a sample the application handed over again counts once), the shared version right where the
    personal model is wrong (``only_right``) on enough more of them than the reverse that the exact sign test
    puts the difference below ``CHANCE`` (5 to 0 at least). The personal model is trained on the rest of the
    device's data from (or pulled toward) the shared version, and a held slice of a few samples misleads by a
    sample or two: on the fleet benchmark the rule it replaces (serve the personal model only where it is better
    by ``margin``) kept devices on a shared version 8 to 43 points below their own model on their test data
    (bench/README.md, "fleet_learning.py"). With fewer distinct held samples the device cannot tell the two
    apart and keeps its own, except where it holds nothing (fewer than ``SPLIT_EVERY`` samples) and the shared
    version reads every label it holds right more often than not (no ``misread_labels``): a few samples of
    classes the fleet already knows teach a model to forget the rest (a label-skew device of 6 samples: 72.6% on
    its test data against the shared version's 84.5%), where a user who names a digit or sees digits their own
    way needs a model of their own however little they hand over (7 samples, 2 of a digit named otherwise: 90.4%
    against 39.7%).
    Without the paired counts the accuracy difference stands for them."""
    if settings.method == "none" or not personal or not shared:
        return "shared"
    n = int(personal.get("distinct", personal.get("samples", 0)))
    if n < max(settings.min_val_samples, 1):
        agrees = n == 0 and shared.get("misread_labels") == 0
        return "shared" if agrees else "personal"
    mine, theirs = personal.get("accuracy", float("nan")), shared.get("accuracy", float("nan"))
    if not theirs >= mine + settings.margin:
        return "personal"
    ahead, behind = shared.get("only_right"), personal.get("only_right")
    if ahead is None or behind is None:
        ahead, behind = round(n * (theirs - mine)), 0
    return "shared" if sign_test(int(ahead), int(behind)) <= CHANCE else "personal"


def misread_labels(model: nn.Module, data: dict, *, share: float = CONTRADICTED_SHARE) -> list[int]:
    """The labels of ``data`` whose samples ``model`` calls something else more than ``share`` of the time."""
    if not data or not size(data) or LABEL not in data:
        return []
    with torch.no_grad():
        predicted = torch.cat([logits.argmax(-1) for _, logits in batched_logits(model, data)])
    labels = torch.as_tensor(data[LABEL])
    return [int(c) for c in labels.unique() if float((predicted[labels == c] != c).float().mean()) > share]


def repeats(data: dict) -> torch.Tensor:
    """For each sample, the index of the first sample of ``data`` it repeats (itself if none): the same label
    and inputs within ``REPEAT`` of their size (an application that hands a sample over again, a user who
    writes the same digit again). Above ``MAX_GROUPED`` samples every one counts as distinct."""
    n = size(data)
    group = torch.arange(n)
    if n > MAX_GROUPED or n < 2:
        return group
    x = torch.cat([torch.as_tensor(v).reshape(n, -1).float() for k, v in data.items() if k != LABEL], 1)
    labels = torch.as_tensor(data[LABEL]).reshape(n, -1)
    norms = x.norm(dim=1)
    same = torch.cdist(x, x) <= REPEAT * torch.maximum(norms[:, None], norms[None, :])
    same &= (labels[:, None, :] == labels[None, :, :]).all(-1)
    for i in range(1, n):
        earlier = torch.nonzero(same[i, :i]).flatten()
        if len(earlier):
            group[i] = group[earlier[0]]
    return group


def paired(shared_model: nn.Module, model: nn.Module, held: dict) -> dict[str, int]:
    """On the held slice, counting a repeated sample once (``repeats``, by the majority of its copies): the
    distinct samples, those only the shared model gets right, and those only ``model`` gets right."""
    if not held or not size(held) or LABEL not in held:
        return {"distinct": 0, "shared": 0, "personal": 0}
    right = []
    for m in (shared_model, model):
        with torch.no_grad():
            predicted = torch.cat([logits.argmax(-1) for _, logits in batched_logits(m, held)])
        right.append((predicted == torch.as_tensor(held[LABEL])).float())
    group = repeats(held)
    firsts = group.unique()
    counts = torch.zeros(len(group)).index_add_(0, group, torch.ones(len(group)))[firsts]
    shared_right, mine = (torch.zeros(len(group)).index_add_(0, group, r)[firsts] / counts > 0.5 for r in right)
    only_shared, only_mine = int((shared_right & ~mine).sum()), int((mine & ~shared_right).sum())
    return {"distinct": len(firsts), "shared": only_shared, "personal": only_mine}


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
    unlabeled: dict | None = None,
) -> PersonalOutcome:
    """One personal pass on the device's data: start from ``derive(shared, personal)``, train on ``train`` as the
    method says, judged on ``val`` and then refit on both (unless ``train_personal`` is false: then only
    measure), measure both models on ``held`` and choose. ``held`` is what neither this pass nor any earlier one
    of either model trained on (``device_split``), so the two figures and the gain between them are held out.
    ``released``: the rows ``own_start`` found for the same shared version and data (else found here).
    ``unlabeled``: the newest samples without a label, which join ``train`` pseudo-labelled where the setting
    says so (``edge_agent.pseudo_labels``), never ``val`` or ``held``.
    ``build(tensors)`` gives the base model carrying those adapter tensors. Used by the runtime and, on the
    same code path, by ``bench/personalization.py``."""
    shared_model = build(shared).eval()
    shared_metrics = family.evaluate(shared_model, held)
    if settings.method == "none":
        return PersonalOutcome(None, shared_metrics, {}, "shared")
    model = build(derive(shared, personal, settings))
    result, penalty, notes, epochs, free = None, None, [], settings.epochs, []
    if settings.method == "ditto":
        rows = {}
        if train_personal:
            rows = released if released is not None else released_rows(shared_model, train, settings, family)
        penalty = proximal_penalty(model, shared, settings.lam, free_rows=rows)
        if rows:
            free = next(iter(rows.values()))
            notes.append(f"classes {free} train free of the pull: the device's labels contradict the shared one")
    if settings.method == "private_modules":
        private = private_keys(adapter_parameters(model), settings.private_modules)
        for key, parameter in adapter_parameters(model).items():
            parameter.requires_grad_(key in private)
    if train_personal:
        # Up to ``epochs``, stopped after PATIENCE without a lower validation loss, the best epoch kept (undone if
        # none beats the start), then refit on all local data for that many (TrainConfig.refit). A validation slice
        # under ``min_val_samples`` judges nothing: every epoch is trained and the last kept.
        run = replace(config, epochs=epochs, lr=settings.lr, update_replay=False, metric="loss", min_delta=0.0,
                      patience=PATIENCE, refit=True, restrict_classes=False,
                      judge_min_samples=settings.min_val_samples)  # fmt: skip
        guessing = settings.unlabeled == "pseudo_label" and bool(unlabeled) and size(train) > 0
        if guessing:  # first on the labelled samples alone (no refit: the validation slice judges both stages)
            first = train_adapter(model, train, val, config=replace(run, refit=False, checkpoint_dir=None),
                                  family=family, replay=replay, penalty=penalty)  # fmt: skip
            mine = set(concat([train, val])[LABEL].tolist())  # the labels the device's users gave
            guessed = pseudo_labelled(model, unlabeled, confidence=settings.confidence, classes=mine,
                                      limit=PSEUDO_RATIO * size(train))  # fmt: skip
            if guessed:  # then on them and what the model so trained is sure of, from where it got to
                train = concat([train, guessed])
                notes += [*first.notes, f"{size(guessed)} unlabeled samples pseudo-labelled by the model trained on "
                          f"the labelled ones (at least {settings.confidence:.0%} sure)"]  # fmt: skip
        result = train_adapter(model, train, val, config=run, family=family, replay=replay, penalty=penalty)
        result.notes[:0] = notes
    tensors = {k: p.detach().clone().contiguous() for k, p in adapter_parameters(model).items()}
    personal_metrics = family.evaluate(model.eval(), held)  # the model kept: refit, trained or undone
    counts = paired(shared_model, model, held)
    shared_metrics["only_right"], personal_metrics["only_right"] = counts["shared"], counts["personal"]
    shared_metrics["distinct"] = personal_metrics["distinct"] = counts["distinct"]
    if not counts["distinct"] and train_personal and size(train):  # nothing held: the shared version on the rest
        shared_metrics["misread_labels"] = len(misread_labels(shared_model, concat([train, val])))
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
        report = {key: state.get(key) for key in fields}
        for key in ("shared_only_right", "personal_only_right"):  # the paired counts ``choose`` judged by
            if isinstance(state.get(key), int):
                report[key] = state[key]
        return report
