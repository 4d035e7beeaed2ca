"""``hf-text-classifier``: a team's own Hugging Face sequence classifier (a DistilBERT intent model, a BERT of their
own), uploaded as its model folder in a zip, personalized without code (issue 51).

The base model's stored file is the zip: ``config.json``, ``model.safetensors`` (or its shards and their
``model.safetensors.index.json``) and the tokenizer's files (``tokenizer.json``, or ``vocab.txt`` / ``vocab.json``
and ``merges.txt``, with ``tokenizer_config.json`` and ``special_tokens_map.json``), at the archive's root or in one
folder. The model is built with ``transformers`` from the stored config, never from a hub, and never with remote
code: a config with ``auto_map``, a ``.py`` file, and pickled weights (``.bin``, ``.pt``, ``.pth``, ``.ckpt``,
``.pkl``) are refused (``check_folder``), as are weights that do not match the config (missing, unexpected or
misshapen tensors). The ``family_config`` (made at upload, signed in manifests) says the task, the labels and
``max_length``, the tokens a text is cut or padded to.

The module names adapters use are the model's own (``bert.encoder.layer.0.attention.self.query``), so the versions
and personal adapters export as PEFT directories that ``PeftModel.from_pretrained`` loads on the same folder's model.
Without targets an adapter adapts every attention query and value projection and trains the classifier in full
(``defaults``). A device unpacks the zip once, beside the stored file (``<file>.d``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_agent.families.common import Classifier, SampleField
from edge_agent.families.exported import ProgramRejected, open_archive

NAME = "hf-text-classifier"
TASK = "sequence-classification"
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
ALLOWED = {
    "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "vocab.txt", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
    "README.md", ".gitattributes", "sentencepiece.bpe.model", "spiece.model",
}  # fmt: skip
TOKENIZER_SETS = (("tokenizer.json",), ("vocab.txt",), ("vocab.json", "merges.txt"), ("spiece.model",),
                  ("sentencepiece.bpe.model",))  # fmt: skip
QUERY_VALUE = ("query", "value", "q_proj", "v_proj", "q_lin", "v_lin")
HEADS = ("classifier", "score")
MAX_LENGTH = 64
_UNPACKING = threading.Lock()


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _files(archive) -> dict[str, str]:
    """The archive's files by their name in the model folder (its root, or its one top folder)."""
    names = [m.filename for m in archive.infolist() if not m.is_dir()]
    tops = {n.split("/")[0] for n in names}
    strip = len(tops) == 1 and all("/" in n for n in names)
    return {(n.split("/", 1)[1] if strip else n): n for n in names}


def check_folder(data: bytes) -> dict:
    """The model folder's ``config.json`` after the archive's checks: only a model folder's files, no code, no
    pickle, safetensors weights, a tokenizer, a known sequence-classification architecture; ``ProgramRejected``
    naming what is wrong."""
    archive = open_archive(data, what="a Hugging Face model folder in a zip")
    files = _files(archive)
    for name in files:
        lowered = name.lower()
        if lowered.endswith(PICKLES):
            raise ProgramRejected("pickle_weights", f"{name} is a pickle; upload the weights as safetensors "
                                  "(model.save_pretrained(folder, safe_serialization=True))")  # fmt: skip
        if lowered.endswith(".py"):
            raise ProgramRejected("remote_code", f"{name} is code; models that need their own code are not accepted")
        inner = name.split("/")[-1]
        if "/" in name or not (inner in ALLOWED or (inner.startswith("model-") and inner.endswith(".safetensors"))):
            raise ProgramRejected("unknown_file", f"{name} is not a file of a model folder (config, safetensors "
                                  "weights, tokenizer)")  # fmt: skip
    if "config.json" not in files:
        raise ProgramRejected("no_config", "the folder has no config.json")
    try:
        config = json.loads(archive.read(files["config.json"]))
    except ValueError as exc:
        raise ProgramRejected("bad_config", f"config.json is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ProgramRejected("bad_config", "config.json must be a JSON object")
    if "auto_map" in config or config.get("trust_remote_code"):
        raise ProgramRejected("remote_code", "config.json names code of its own (auto_map): not accepted")
    architectures = config.get("architectures") or []
    if not (isinstance(architectures, list) and architectures and str(architectures[0]).endswith(
            "ForSequenceClassification")):  # fmt: skip
        raise ProgramRejected("unknown_architecture", f"the architecture {architectures[:1]} is not a sequence "
                              "classifier (…ForSequenceClassification)")  # fmt: skip
    if "model.safetensors" not in files and "model.safetensors.index.json" not in files:
        raise ProgramRejected("no_weights", "the folder has no model.safetensors (nor its shards' index)")
    if not any(all(f in files for f in group) for group in TOKENIZER_SETS):
        raise ProgramRejected("no_tokenizer", "the folder has no tokenizer files (tokenizer.json, or vocab.txt, or "
                              "vocab.json and merges.txt)")  # fmt: skip
    return config


def _read(source: Path | bytes) -> bytes:
    return bytes(source) if isinstance(source, bytes | bytearray) else Path(source).read_bytes()


def _folder(source: Path | bytes, data: bytes | None = None) -> Path:
    """The model folder unpacked: beside the stored file (``<file>.d``) on a device, else in a temporary folder
    named by the archive's sha256; unpacked once (a partial unpack is replaced). A device's base file is named by
    its sha256, checked when it was downloaded, and never rewritten: a complete folder beside it is its own, found
    without reading the file again (``predict`` and ``add_samples`` look for the tokenizer each time)."""
    if not isinstance(source, bytes | bytearray) and (Path(str(source) + ".d") / ".complete").exists():
        return Path(str(source) + ".d")
    data = _read(source) if data is None else data
    digest = hashlib.sha256(data).hexdigest()
    target = (Path(str(source) + ".d") if not isinstance(source, bytes | bytearray)
              else Path(tempfile.gettempdir()) / "fleet-hf" / digest)  # fmt: skip
    with _UNPACKING:
        done = target / ".complete"
        if done.exists() and done.read_text() == digest:
            return target
        # Unpacked beside it and renamed into place: another process unpacking the same archive at once finds
        # either nothing or the whole folder.
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        staging = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=target.parent))
        archive = open_archive(data, what="a Hugging Face model folder in a zip")
        for name, member in _files(archive).items():
            (staging / name).write_bytes(archive.read(member))
        (staging / ".complete").write_text(digest)
        if done.exists() and done.read_text() == digest:  # another process finished first
            shutil.rmtree(staging, ignore_errors=True)
            return target
        shutil.rmtree(target, ignore_errors=True)  # a partial or other unpack
        try:
            staging.rename(target)
        except OSError:  # another process put it there first
            shutil.rmtree(staging, ignore_errors=True)
    return target


def family_config(config_json: dict, *, max_length: int = MAX_LENGTH) -> dict:
    """What the manifest signs for such a base: the task, the labels (``id2label`` of config.json) and the tokens
    a text is cut or padded to."""
    labels = config_json.get("id2label") or {str(i): f"LABEL_{i}" for i in range(int(config_json.get("num_labels", 2)))}
    ordered = [str(labels[k]) for k in sorted(labels, key=int)]
    return {"task": TASK, "labels": ordered, "max_length": int(max_length)}


class HFClassifier(nn.Module):
    """A ``…ForSequenceClassification`` model called with ``input_ids`` and ``attention_mask``, returning logits. Its
    children are this module's under the same names, so adapters and PEFT name its modules alike."""

    def __init__(self, model: nn.Module):
        super().__init__()
        object.__setattr__(self, "model", model)
        for name, child in model.named_children():
            self.add_module(name, child)

    def train(self, mode: bool = True):
        super().train(mode)
        self.model.training = mode
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def load_model(source: Path | bytes) -> HFClassifier:
    """The model from its folder, after ``check_folder``; weights that do not match its config are refused."""
    _offline()
    data = _read(source)
    check_folder(data)
    folder = _folder(source, data)
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    _check_shapes(folder)
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False, use_safetensors=True,
            output_loading_info=True,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - a folder transformers cannot read is the uploader's to mend
        raise ProgramRejected("bad_weights", f"transformers could not load it: {type(exc).__name__}: {exc}") from None
    wrong = {k: sorted(v)[:3] for k, v in info.items() if k != "error_msgs" and v}
    if wrong or info.get("error_msgs"):
        raise ProgramRejected("bad_weights", f"the weights do not match config.json: {wrong or info['error_msgs'][:1]}")
    classifier = HFClassifier(model.eval()).eval()
    classifier.folder = folder  # where its tokenizer is (HFTextClassifier.load)
    return classifier


def _check_shapes(folder: Path) -> None:
    """``ProgramRejected`` naming the first tensor of the safetensors files whose shape is not the one the model
    built from config.json has (transformers' own refusal says only that sizes differ)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForSequenceClassification

    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
        with torch.device("meta"):
            expected = {
                k: tuple(v.shape)
                for k, v in AutoModelForSequenceClassification.from_config(config).state_dict().items()
            }
        for path in sorted(folder.glob("model*.safetensors")):
            with safe_open(str(path), "pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                    shape = tuple(handle.get_slice(key).get_shape())
                    if key in expected and expected[key] != shape:
                        raise ProgramRejected("bad_weights", f"the weights do not match config.json: {key} is "
                                              f"{list(shape)}, the config builds {list(expected[key])}")  # fmt: skip
    except ProgramRejected:
        raise
    except Exception as exc:  # noqa: BLE001 - a config or file transformers cannot read is the uploader's to mend
        raise ProgramRejected("bad_weights", f"transformers could not read it: {type(exc).__name__}: {exc}") from None


@lru_cache(maxsize=8)
def _tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)


class HFTextClassifier(Classifier):
    """The family of every uploaded Hugging Face sequence classifier."""

    name = NAME
    default_targets: tuple[str, ...] = ()
    default_modules_to_save: tuple[str, ...] = ()
    default_rank, default_alpha = 8, 16.0
    eval_batch_size = 64
    loads_file = True
    exports_peft = True  # its adapters load with PeftModel.from_pretrained on the same folder's model
    classifier = "classifier"

    def check_config(self, config: dict) -> dict:
        if not isinstance(config, dict) or config.get("task", TASK) != TASK:
            raise ProgramRejected("bad_card", f"family_config is made at upload ({{'task': {TASK!r}, ...}})")
        return config

    def load(self, config: dict, source: Path | bytes) -> nn.Module:
        model = load_model(source)
        self._folder = model.folder
        return model

    def attach(self, base_file: Path) -> None:
        """The device's stored base file, whose folder holds the tokenizer ``encode_samples`` uses."""
        self._folder = _folder(base_file)

    def config_for(self, data: bytes, given: dict) -> dict:
        """The ``family_config`` an upload gets: from its config.json, ``max_length`` as given (default 64)."""
        max_length = given.get("max_length", MAX_LENGTH)
        if type(max_length) is not int or not 1 <= max_length <= 4096:
            raise ProgramRejected("bad_card", f"max_length must be an integer from 1 to 4096, not {max_length!r}")
        unknown = sorted(set(given) - {"max_length", "task"})
        if unknown:
            raise ProgramRejected("bad_card", f"unknown family_config keys {unknown}; it takes 'max_length'")
        return family_config(check_folder(data), max_length=max_length)

    def defaults(self, model: nn.Module) -> tuple[list[str], list[str]]:
        targets = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.split(".")[-1] in QUERY_VALUE]
        heads = [n for n, _ in model.named_children() if n in HEADS]
        return targets, heads[:1]

    def sample_fields(self, config: dict[str, Any]) -> dict[str, SampleField]:
        return {"text": SampleField((), "text"), "y": SampleField((), "int64", 0, len(config["labels"]) - 1)}

    def encode_samples(self, fields: dict, config: dict[str, Any]) -> dict:
        """Texts as token ids and mask of ``max_length`` tokens, with the model's own tokenizer (``attach`` or
        ``load`` first: the tokenizer lives in the base's folder)."""
        tokenizer = _tokenizer(str(self._folder))
        encoded = tokenizer([str(t) for t in fields["text"]], padding="max_length", truncation=True,
                            max_length=int(config.get("max_length", MAX_LENGTH)), return_tensors="np")  # fmt: skip
        out = {"input_ids": encoded["input_ids"].astype(np.int64),
               "attention_mask": encoded["attention_mask"].astype(np.int64)}  # fmt: skip
        return out | ({"y": np.asarray(fields["y"])} if "y" in fields else {})
