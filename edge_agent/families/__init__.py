"""Model families: how to build the frozen base model a device carries, by name or import path.

A family is an object with ``name``, ``build(config) -> torch.nn.Module`` (the base, randomly initialised
from ``config["seed"]``; real weights are loaded over it), ``default_targets`` (modules LoRA adapts) and
``default_modules_to_save`` (small modules trained in full, such as a classifier head). New families plug
in as ``package.module:attribute``.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol


class Family(Protocol):
    name: str
    default_targets: tuple[str, ...]
    default_modules_to_save: tuple[str, ...]

    def build(self, config: dict[str, Any]): ...


def _builtin() -> dict[str, Family]:
    from edge_agent.families.digits import DigitsCNN

    return {DigitsCNN.name: DigitsCNN()}


def get_family(name: str) -> Family:
    """``digits-cnn`` or ``package.module:attribute`` (a class is instantiated)."""
    builtin = _builtin()
    if name in builtin:
        return builtin[name]
    module_name, sep, attribute = name.partition(":")
    if not sep:
        raise LookupError(f"unknown model family {name!r}: use one of {sorted(builtin)} or 'package.module:attribute'")
    try:
        family = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise LookupError(f"cannot load model family {name!r}: {exc}") from None
    return family() if isinstance(family, type) else family
