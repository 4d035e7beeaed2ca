"""Model families: how to build the frozen base model a device carries, by name or import path.

A family is an object with:

- ``name``, ``default_targets`` (modules LoRA adapts, as named in ``named_modules()`` of the base) and
  ``default_modules_to_save`` (small modules trained in full, such as a classifier head);
- optionally ``default_rank`` and ``default_alpha``: the LoRA rank and alpha of an adapter created without
  them (default ``DEFAULT_RANK`` and ``DEFAULT_ALPHA``);
- ``build(config) -> torch.nn.Module``: the base, randomly initialised from ``config["seed"]`` (real weights
  are loaded over it; a pretrained family such as ``minilm-text`` loads its own);
- ``dataset(config) -> (train, test)``: its demo data, each a dict of tensors with a common first dimension
  (the model's keyword inputs and the labels under ``"y"``); ``test`` is the server's evaluation set;
- ``evaluate(model, data) -> {"accuracy": ..., "loss": ..., "samples": ...}`` on such a dict;
- ``loss(model, batch) -> scalar tensor`` (what training minimises);
- optionally ``classifier``: the module whose output rows are the classes (default ``head``), whose rows
  ditto's ``release_classes`` frees class by class (``edge_agent.personal``).

A family whose base is a file of its own rather than weights for ``build`` (``loads_file = True``:
``exported-program``, a ``.pt2`` saved with ``torch.export.save``) has instead:

- ``check_config(config) -> config``: the config in its normal form, ``ValueError`` (with a ``code``) if wrong;
- ``load(config, source) -> torch.nn.Module``: the base from its stored file (a path or its bytes), checked;
- ``defaults(base) -> (targets, modules_to_save)``: an adapter's modules where its creator names none;
- optionally ``config_for(file_bytes, given) -> config``: the config an upload gets, read from the file itself, and
  ``attach(base_file)``: the device's stored file, where the family finds what ``encode_samples`` needs.

Built in: ``digits-cnn``, ``minilm-text``, ``exported-program`` and ``hf-text-classifier`` (imported only when
asked for, so the digits family works without ``transformers``). New families plug in as ``package.module:attribute``.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Protocol

_BUILTIN = {
    "digits-cnn": "edge_agent.families.digits:DigitsCNN",
    "minilm-text": "edge_agent.families.minilm:MiniLMText",
    "exported-program": "edge_agent.families.exported:ExportedProgramFamily",
    "hf-text-classifier": "edge_agent.families.huggingface:HFTextClassifier",
}


DEFAULT_RANK, DEFAULT_ALPHA = 4, 8.0


def default_shape(family) -> tuple[int, float]:
    """The LoRA rank and alpha an adapter of ``family`` gets where its creator names none."""
    return int(getattr(family, "default_rank", DEFAULT_RANK)), float(getattr(family, "default_alpha", DEFAULT_ALPHA))


class Family(Protocol):
    name: str
    default_targets: tuple[str, ...]
    default_modules_to_save: tuple[str, ...]

    def build(self, config: dict[str, Any]): ...

    def dataset(self, config: dict[str, Any]) -> tuple[dict, dict]: ...

    def evaluate(self, model, data: dict) -> dict[str, float]: ...

    def loss(self, model, batch: dict): ...


def loads_file(family) -> bool:
    """Whether ``family``'s base is its stored file itself (``load``), not weights loaded into ``build``."""
    return bool(getattr(family, "loads_file", False))


def builtin_names() -> list[str]:
    return sorted(_BUILTIN)


# ``package.module:attribute``: dotted identifiers, then one identifier. Anything else (an empty or relative module,
# no attribute) is not a family's path, refused before importlib is asked (which raised ValueError or TypeError).
_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*", re.ASCII)


def _load(path: str, name: str) -> Family:
    if not _PATH.fullmatch(path):
        raise LookupError(f"model family {name!r} is not a 'package.module:attribute' path")
    module_name, _, attribute = path.partition(":")
    try:
        family = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise LookupError(f"cannot load model family {name!r}: {exc}") from None
    return family() if isinstance(family, type) else family


def get_family(name: str) -> Family:
    """``digits-cnn``, ``minilm-text`` or ``package.module:attribute`` (a class is instantiated)."""
    if name in _BUILTIN:
        return _load(_BUILTIN[name], name)
    _, sep, _ = name.partition(":")
    if not sep:
        raise LookupError(f"unknown model family {name!r}: use one of {builtin_names()} or 'package.module:attribute'")
    return _load(name, name)
