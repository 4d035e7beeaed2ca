"""``exported-program``: a team's own PyTorch model, saved with ``torch.export.save`` (a ``.pt2``) and described by a
small JSON card, personalized without a line of code on the server or the device (issue 51).

The base model's stored file is the ``.pt2`` itself; the card is the base model's ``family_config``, which the
manifest signs with the rest of the training setting (docs/protocol/README.md, "Assignments: what a device should
run"). Neither side needs the model's class: the device runs the exported program (``ExportedProgram.module()``).

The card::

    {"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 3, 64]}],
     "task": "classification", "classes": 4, "output": 0}

- ``inputs``: the program's positional inputs in order, each a keyword of the samples (an identifier, not ``y``),
  its dtype (``float32`` or ``int64``) and its shape with the batch dimension first (``"batch"``, ``-1`` or the
  size it was exported with); the rest is the shape of one sample;
- ``task``: ``classification`` (``classes``: the prediction's width, labels ``0`` to ``classes - 1``) or
  ``regression`` (``outputs``: the prediction's width, default 1; labels are ``float32`` of that width, or
  scalars where it is 1);
- ``output``: which of the program's outputs (flattened, in order) is the prediction, default ``0``.

LoRA attaches to named weights of the exported module (``edge_agent.lora_layers.LoRAWeight``): a target is the
module path of a ``weight`` of two or more dimensions (a linear layer's, a convolution's as its 2-D view
``[out, in * kernel]``). Without targets, an adapter adapts every such weight but the last, and trains the module
of the last (the prediction layer) in full (``defaults``).

Loading an archive someone uploaded is guarded (``check_archive``): only the members ``torch.export.save`` writes,
no path outside the archive's folder, at most ``MAX_MEMBERS`` members and ``MAX_UNPACKED_BYTES`` unpacked, and
every member torch reads with ``torch.load`` (pickled weights, sample inputs) must load with ``weights_only``:
torch falls back to a full unpickling where that fails, which would run the uploader's code.
"""

from __future__ import annotations

import io
import json
import keyword
import re
import threading
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edge_agent.families.common import (
    LABEL,
    SampleField,
    batched_logits,
    classification_evaluate,
    classification_loss,
    inputs,
    restricted_classification_loss,
    size,
)
from edge_agent.lora import PREFIX

NAME = "exported-program"
TASKS = ("classification", "regression")
DTYPES = {"float32": torch.float32, "int64": torch.int64}
BATCH = ("batch", -1)
MAX_INPUTS = 16
MAX_DIMS = 8
MAX_SAMPLE_VALUES = 16 * 2**20  # one sample's values, every input together
MAX_CLASSES = 10_000
MAX_MEMBERS = 10_000
MAX_UNPACKED_BYTES = 2 * 2**30
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}", re.ASCII)
# What torch.export.save writes under the archive's one top folder (torch 2.13): the graph and its metadata as JSON,
# the weights and constants (raw bytes, or pickled where a tensor needs it), the sample inputs (pickled), versions.
_PICKLED = re.compile(r"data/sample_inputs/[^/]+\.pt|data/(weights|constants)/[^/]+")


class ProgramRejected(ValueError):
    """An archive or card that cannot be a base model; ``code`` says which check, the message what is wrong."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


# --- the card ---------------------------------------------------------------------------------------------------


def check_card(card: Any) -> dict:
    """The card in its normal form (batch dimension ``"batch"``, ``output`` and the task's width filled in), or
    ``ProgramRejected("bad_card", ...)`` naming the first thing wrong."""

    def bad(message: str):
        raise ProgramRejected("bad_card", f"the model card: {message}")

    if not isinstance(card, dict):
        bad("must be a JSON object")
    known = {"inputs", "task", "classes", "outputs", "output"}
    if unknown := sorted(set(card) - known):
        bad(f"unknown keys {unknown}; a card has {sorted(known)}")
    fields = card.get("inputs")
    if not isinstance(fields, list) or not 1 <= len(fields) <= MAX_INPUTS:
        bad(f"'inputs' must be a list of 1 to {MAX_INPUTS} inputs")
    normal, names, values = [], set(), 0
    for n, field in enumerate(fields):
        where = f"inputs[{n}]"
        if not isinstance(field, dict) or set(field) != {"name", "dtype", "shape"}:
            bad(f"{where} must be an object with exactly 'name', 'dtype' and 'shape'")
        name, dtype, shape = field["name"], field["dtype"], field["shape"]
        if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name) or keyword.iskeyword(name) or name == LABEL:
            bad(f"{where}.name must be an identifier of at most 64 characters, not 'y' (the label): {name!r}")
        if name in names:
            bad(f"{where}.name {name!r} is given twice")
        names.add(name)
        if dtype not in DTYPES:
            bad(f"{where}.dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
        if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_DIMS:
            bad(f"{where}.shape must list 1 to {MAX_DIMS} dimensions, the batch first")
        first, rest = shape[0], shape[1:]
        if not (first in BATCH or (type(first) is int and first >= 1)):
            bad(f"{where}.shape[0] is the batch dimension: 'batch', -1 or a positive size, not {first!r}")
        if not all(type(d) is int and d >= 1 for d in rest):
            bad(f"{where}.shape after the batch dimension must be positive integers, not {rest}")
        per_sample = 1
        for d in rest:
            per_sample *= d
        values += per_sample
        normal.append({"name": name, "dtype": dtype, "shape": ["batch", *rest]})
    if values > MAX_SAMPLE_VALUES:
        bad(f"one sample holds {values:,} values; at most {MAX_SAMPLE_VALUES:,}")
    task = card.get("task")
    if task not in TASKS:
        bad(f"'task' must be one of {list(TASKS)}, not {task!r}")
    out = {"inputs": normal, "task": task}
    if task == "classification":
        classes = card.get("classes")
        if type(classes) is not int or not 2 <= classes <= MAX_CLASSES:
            bad(f"'classes' must be an integer from 2 to {MAX_CLASSES} for classification, not {classes!r}")
        if "outputs" in card:
            bad("'outputs' is for regression; classification has 'classes'")
        out["classes"] = classes
    else:
        outputs = card.get("outputs", 1)
        if type(outputs) is not int or not 1 <= outputs <= MAX_CLASSES:
            bad(f"'outputs' must be an integer from 1 to {MAX_CLASSES}, not {outputs!r}")
        if "classes" in card:
            bad("'classes' is for classification; regression has 'outputs'")
        out["outputs"] = outputs
    output = card.get("output", 0)
    if type(output) is not int or not 0 <= output < 64:
        bad(f"'output' is the index of the prediction among the program's outputs (0 to 63), not {output!r}")
    out["output"] = output
    return out


def width(card: dict) -> int:
    return int(card["classes"] if card["task"] == "classification" else card["outputs"])


# --- the archive ------------------------------------------------------------------------------------------------


def _bytes(source: Path | bytes | io.BytesIO) -> bytes:
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if isinstance(source, io.BytesIO):
        return source.getvalue()
    return Path(source).read_bytes()


def open_archive(data: bytes, *, what: str) -> zipfile.ZipFile:
    """``data`` as a zip archive whose members are safe to read or unpack: at most ``MAX_MEMBERS``, none outside its
    folder (an absolute path, ``..``, a drive, a backslash) nor a symbolic link, at most ``MAX_UNPACKED_BYTES`` in
    all; ``ProgramRejected`` (``not_a_program``, ``unsafe_archive``, ``too_large``) naming the first member wrong.
    ``what`` names what the archive should be, for the message."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise ProgramRejected("not_a_program", f"not {what} (a zip archive): {exc}") from None
    if not members or len(members) > MAX_MEMBERS:
        raise ProgramRejected("not_a_program", f"the archive holds {len(members)} members; 1 to {MAX_MEMBERS}")
    unpacked = 0
    for member in members:
        name = member.filename
        parts = name.split("/")
        if name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts[:-1]) or ":" in parts[0]:
            raise ProgramRejected("unsafe_archive", f"the archive member {name!r} points outside its folder")
        if (member.external_attr >> 16) & 0o170000 == 0o120000:
            raise ProgramRejected("unsafe_archive", f"the archive member {name!r} is a symbolic link")
        unpacked += member.file_size
    if unpacked > MAX_UNPACKED_BYTES:
        raise ProgramRejected("too_large", f"the archive unpacks to {unpacked:,} bytes; at most {MAX_UNPACKED_BYTES:,}")
    return archive


def check_archive(data: bytes) -> None:
    """``ProgramRejected`` unless ``data`` is a zip archive as ``torch.export.save`` writes it, safe to load."""
    archive = open_archive(data, what="a .pt2 archive (torch.export.save writes one)")
    members = archive.infolist()
    tops = {member.filename.split("/")[0] for member in members}
    if len(tops) != 1 or not any(m.filename.split("/", 1)[-1] == "archive_format" for m in members):
        raise ProgramRejected("not_a_program", "not an archive torch.export.save wrote (one folder, 'archive_format')")
    for member in members:
        inner = member.filename.split("/", 1)[-1]
        if member.is_dir() or not _PICKLED.fullmatch(inner):
            continue
        blob = archive.read(member)
        if not blob.startswith(b"PK"):  # raw tensor bytes, read as they are; torch.save writes a zip
            continue
        try:
            torch.load(io.BytesIO(blob), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - whatever the restricted unpickler refuses is refused here
            raise ProgramRejected(
                "unsafe_archive",
                f"the archive member {member.filename!r} holds more than tensors (torch.load with weights_only "
                f"refused it: {type(exc).__name__}); re-export the model with torch.export.save",
            ) from None


# torch.export.load keeps the deserializer of the load under way in a global (torch 2.13): two threads loading at once
# (an agent's training pass and its assignment handler evaluating a new version) fail, "_CURRENT_DESERIALIZER is
# already set", 23 of 40 loads in bench/own_model.py's two-thread check. One load at a time per process.
_LOADING = threading.Lock()


def load_program(source: Path | bytes | io.BytesIO) -> torch.export.ExportedProgram:
    data = _bytes(source)
    check_archive(data)
    try:
        with _LOADING:
            return torch.export.load(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 - a program torch cannot read is the uploader's error, said as such
        raise ProgramRejected("not_a_program", f"torch.export.load could not read it: {type(exc).__name__}: {exc}")


# --- the model --------------------------------------------------------------------------------------------------


class ExportedModel(nn.Module):
    """The exported program as a module called with the card's inputs by keyword, returning the prediction.

    The program's graph was traced in one mode and keeps it (its ``train()`` is not supported): this module's
    ``train()`` and ``eval()`` set its own flag only. The program's submodules, which hold its parameters under
    their original names (``conv1.weight``), are this module's children under the same names: adapters name
    them as the team's own code did (``conv1``), and a LoRA parametrization on one is what the graph reads."""

    def __init__(self, program: torch.export.ExportedProgram, card: dict):
        super().__init__()
        self.card = card
        self.names = [field["name"] for field in card["inputs"]]
        graph = program.module()
        object.__setattr__(self, "program", graph)  # not a child: its children are this module's
        for name, child in graph.named_children():
            self.add_module(name, child)
        for parameter in graph.parameters():
            parameter.requires_grad_(False)

    def train(self, mode: bool = True):
        self.training = mode
        return self

    def forward(self, **kwargs: torch.Tensor) -> torch.Tensor:
        missing = [name for name in self.names if name not in kwargs]
        if missing:
            raise ValueError(f"the model takes {self.names}; missing {missing}")
        outputs = self.program(*(kwargs[name] for name in self.names))
        flat = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        index = self.card["output"]
        if index >= len(flat):
            raise ValueError(f"the card's output {index} does not exist: the program returns {len(flat)} output(s)")
        prediction = flat[index]
        if self.card["task"] == "regression" and prediction.dim() == 1:
            prediction = prediction[:, None]
        return prediction


def dummy_inputs(card: dict, batch: int = 2) -> dict[str, torch.Tensor]:
    return {f["name"]: torch.zeros((batch, *f["shape"][1:]), dtype=DTYPES[f["dtype"]]) for f in card["inputs"]}


def weights(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``(module path, shape)`` of every weight LoRA can adapt, in the program's order: a ``weight`` parameter of
    two or more dimensions."""
    found = []
    for name, parameter in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module and parameter.dim() >= 2:
            found.append((module, tuple(parameter.shape)))
    return found


def load_checked(source: Path | bytes | io.BytesIO, card: dict) -> ExportedModel:
    """The base model, after the archive's checks and a forward pass on zeros shaped by the card, whose
    prediction must be ``[batch, width]``; ``ProgramRejected`` otherwise."""
    model = ExportedModel(load_program(source), card)
    try:
        with torch.no_grad():
            prediction = model(**dummy_inputs(card))
    except ProgramRejected:
        raise
    except Exception as exc:  # noqa: BLE001 - the card and the program disagree: the uploader's to mend
        described = ", ".join(f"{f['name']} {f['dtype']} {f['shape']}" for f in card["inputs"])
        raise ProgramRejected(
            "card_mismatch", f"the program does not run on the card's inputs ({described}): {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None  # fmt: skip
    expected = (2, width(card))
    if not isinstance(prediction, torch.Tensor) or tuple(prediction.shape) != expected:
        got = tuple(prediction.shape) if isinstance(prediction, torch.Tensor) else type(prediction).__name__
        raise ProgramRejected(
            "card_mismatch",
            f"the program's output {card['output']} is {got} for a batch of 2; the card's {card['task']} needs "
            f"[batch, {width(card)}]",
        )
    if not weights(model):
        raise ProgramRejected("card_mismatch", "the program has no weight of two or more dimensions for LoRA to adapt")
    return model.eval()


class ExportedProgramFamily:
    """The family of every uploaded ``.pt2``: its card is the base model's ``family_config``."""

    name = NAME
    default_targets: tuple[str, ...] = ()  # per model: ``defaults``
    default_modules_to_save: tuple[str, ...] = ()
    default_rank, default_alpha = 8, 16.0
    loads_file = True  # the base's stored file is the program itself, not weights for ``build``

    def check_config(self, config: dict) -> dict:
        return check_card(config)

    def load(self, config: dict, source: Path | bytes | io.BytesIO) -> nn.Module:
        return load_checked(source, check_card(config))

    def build(self, config: dict[str, Any]) -> nn.Module:
        raise ProgramRejected("no_program", "an exported-program base is loaded from its .pt2 file, not built")

    def defaults(self, model: nn.Module) -> tuple[list[str], list[str]]:
        """Every adaptable weight but the last as LoRA targets, the last one's module (the prediction layer)
        trained in full."""
        found = [name for name, _ in weights(model)]
        return found[:-1], found[-1:]

    def classifier_of(self, model: nn.Module) -> str | None:
        found = weights(model)
        return found[-1][0] if found else None

    def sample_fields(self, config: dict[str, Any]) -> dict[str, SampleField]:
        card = check_card(config)
        fields = {f["name"]: SampleField(tuple(f["shape"][1:]), f["dtype"]) for f in card["inputs"]}
        if card["task"] == "classification":
            fields[LABEL] = SampleField((), "int64", 0, card["classes"] - 1)
        else:
            fields[LABEL] = SampleField(() if card["outputs"] == 1 else (card["outputs"],), "float32")
        return fields

    def encode_samples(self, fields: dict, config: dict[str, Any]) -> dict:
        return fields

    def evaluate(self, model: nn.Module, data: dict[str, torch.Tensor]) -> dict[str, float]:
        if model_task(model) == "classification":
            return classification_evaluate(model, data)
        total, n = 0.0, size(data)
        for batch, prediction in batched_logits(model, data):
            total += float(F.mse_loss(prediction, _targets(batch, prediction), reduction="sum")) / prediction.shape[1]
        if n == 0:
            return {"loss": float("nan"), "samples": 0}
        return {"loss": total / n, "samples": n}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if model_task(model) == "classification":
            return classification_loss(model, batch)
        prediction = model(**inputs(batch))
        return F.mse_loss(prediction, _targets(batch, prediction))

    def restricted_loss(self, model: nn.Module, batch: dict[str, torch.Tensor], classes: torch.Tensor) -> torch.Tensor:
        if model_task(model) == "classification":
            return restricted_classification_loss(model, batch, classes)
        return self.loss(model, batch)


def adapter_card(training: dict, tensors: dict[str, torch.Tensor], base_sha256: str | None) -> dict:
    """What ``edge-agent export`` writes beside an exported program's adapter (``adapter_card.json``): the base it
    applies to and how, for a team that takes it back to its own code (``merged_state_dict`` does it)."""
    rank, alpha = int(training["rank"]), float(training["alpha"])
    return {
        "format": "fleet-lora-on-weights/1",
        "base_model_sha256": base_sha256,
        "card": training.get("family_config"),
        "rank": rank,
        "alpha": alpha,
        "scaling": alpha / rank,
        "target_modules": {
            name: {
                "lora_A": f"{PREFIX}{name}.lora_A.weight",
                "lora_B": f"{PREFIX}{name}.lora_B.weight",
                "lora_A_shape": list(tensors[f"{PREFIX}{name}.lora_A.weight"].shape),
                "lora_B_shape": list(tensors[f"{PREFIX}{name}.lora_B.weight"].shape),
            }  # fmt: skip
            for name in training["target_modules"]
        },
        "modules_to_save": list(training.get("modules_to_save", [])),
        "how": "for each target module M: M.weight += scaling * (lora_B @ lora_A).reshape(M.weight.shape); for each "
        "module to save M and each of its parameters P: M.P = the tensor '" + PREFIX + "M.P'. "
        "edge_agent.families.exported.merged_state_dict(state_dict, tensors, card) does it on your model's "
        "state_dict.",
    }


def merged_state_dict(state_dict: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], card: dict) -> dict:
    """The team's own model's ``state_dict`` with the adapter merged in, as ``adapter_card`` says: load it into the
    model's class, or export it again."""
    merged = {key: value.clone() for key, value in state_dict.items()}
    for name, keys in card["target_modules"].items():
        weight = merged[f"{name}.weight"]
        update = (tensors[keys["lora_B"]] @ tensors[keys["lora_A"]]).reshape(weight.shape)
        merged[f"{name}.weight"] = weight + card["scaling"] * update.to(weight.dtype)
    for name in card["modules_to_save"]:
        for key, value in tensors.items():
            if key.startswith(f"{PREFIX}{name}."):
                merged[key[len(PREFIX) :]] = value.clone()
    return merged


def _targets(batch: dict, prediction: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(batch[LABEL], dtype=prediction.dtype).reshape(prediction.shape)


def model_task(model: nn.Module) -> str:
    """The task of an ``ExportedModel``, found under the adapter's wrappers."""
    for module in model.modules():
        if isinstance(module, ExportedModel):
            return module.card["task"]
    return "classification"


def card_json(card: dict) -> str:
    return json.dumps(check_card(card), sort_keys=True)
