"""An adapter's personalization setting with its defaults, read in one place.

Each device keeps a model of its own, trained on its own data and never uploaded; the setting says how it
is made, and is signed into every manifest (``training.rollouts.manifests.training_config``) so a device trains only
what the server signed. ``Adapter.personalization`` holds only what an operator set; everything reads it
through ``personalization_settings``, with the defaults of ``edge_agent.protocol.PERSONALIZATION_DEFAULTS`` (the one
place they live, which the agent reads too: README, "Adapters and rollouts"; docs/protocol/README.md,
"Assignments").

Methods: ``none`` (the device serves the shared version), ``finetune`` (a copy of the shared version fine-tuned
locally), ``ditto`` (a personal model kept near the shared one by a proximal term of weight ``lambda``, lifted from
the classifier rows of the classes a device's labels rename, which are then the device's own and never uploaded,
unless ``release_classes`` is false), ``private_modules`` (the modules named in ``private_modules`` stay on the
device and are never uploaded). ``epochs`` and ``lr`` are the personal model's training; the device serves it only
when it beats the shared version by ``margin`` on at least ``min_val_samples`` held-out local samples. ``unlabeled``
says what the personal model learns from the samples nobody labelled: ``pseudo_label`` (what the model trained on
the labelled ones is at least ``confidence`` sure of; edge_agent.pseudo_labels) or ``none``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from edge_agent.protocol import PERSONALIZATION_DEFAULTS, PERSONALIZATION_METHODS
from edge_agent.pseudo_labels import UNLABELED_METHODS

METHODS = PERSONALIZATION_METHODS
MAX_PRIVATE_MODULES = 64
# The settings each method reads on the device (edge_agent.personal: ``derive``, ``released_rows``,
# ``personalize``, ``choose``): every method that makes a model of its own trains it (epochs, lr) and judges
# it (margin, min_val_samples); only ditto pulls it (lambda) and releases classes; only private_modules names
# modules. Under "none" nothing is made, so no setting applies.
_OWN_MODEL = ("epochs", "lr", "margin", "min_val_samples", "unlabeled", "confidence")
SETTINGS_BY_METHOD: dict[str, tuple[str, ...]] = {
    "none": (),
    "finetune": _OWN_MODEL,
    "ditto": ("lambda", "release_classes", *_OWN_MODEL),
    "private_modules": ("private_modules", *_OWN_MODEL),
}

PERSONALIZATION_HELP = (
    "Only the settings that differ from the defaults ("
    + ", ".join(f"{name}={value!r}" for name, value in PERSONALIZATION_DEFAULTS.items())
    + f"). method is one of {', '.join(METHODS)}; private_modules must be among the adapter's target_modules or "
    "modules_to_save (checked when given, and always for the private_modules method)."
)

# The setting as the OpenAPI schema documents it (rules across fields, such as private_modules being the
# adapter's own, are checked by validate_personalization).
PERSONALIZATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "method": {"type": "string", "enum": list(METHODS)},
        "lambda": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
        "private_modules": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 200},
            "maxItems": MAX_PRIVATE_MODULES,
            "uniqueItems": True,
        },
        "epochs": {"type": "integer", "minimum": 1, "maximum": 100},
        "lr": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
        "margin": {"type": "number", "minimum": 0, "maximum": 1},
        "min_val_samples": {"type": "integer", "minimum": 0, "maximum": 10000},
        "release_classes": {"type": "boolean"},
        "unlabeled": {"type": "string", "enum": list(UNLABELED_METHODS)},
        "confidence": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1},
    },
}


def personalization_settings(adapter) -> dict[str, Any]:
    """Every setting, with the defaults for those the adapter does not set (a fresh dict: safe to change)."""
    merged = {**PERSONALIZATION_DEFAULTS, **(adapter.personalization or {})}
    return {**merged, "private_modules": list(merged["private_modules"])}


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_personalization(values: Any, *, modules: Iterable[str] | None) -> dict[str, Any]:
    """Check an operator's personalization setting; ValueError naming the first bad field.

    ``modules`` are the adapter's target_modules and modules_to_save, which private_modules must be among;
    None skips that one check (the adapter's modules are not known yet). Returns what to store.
    """
    if not isinstance(values, dict):
        raise ValueError("personalization must be a JSON object")
    unknown = set(values) - set(PERSONALIZATION_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown personalization settings: {sorted(unknown)}")
    merged = {**PERSONALIZATION_DEFAULTS, **values}
    if merged["method"] not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, not {merged['method']!r}")
    if not _number(merged["lambda"]) or merged["lambda"] <= 0:
        raise ValueError("lambda must be a finite number above 0")
    _check_private_modules(merged, given="private_modules" in values, modules=modules)
    if not _whole(merged["epochs"]) or not 1 <= merged["epochs"] <= 100:
        raise ValueError("epochs must be a whole number from 1 to 100")
    if not _number(merged["lr"]) or merged["lr"] <= 0:
        raise ValueError("lr must be a finite number above 0")
    if not _number(merged["margin"]) or not 0 <= merged["margin"] <= 1:
        raise ValueError("margin must be a number from 0 to 1")
    if not _whole(merged["min_val_samples"]) or not 0 <= merged["min_val_samples"] <= 10000:
        raise ValueError("min_val_samples must be a whole number from 0 to 10000")
    if not isinstance(merged["release_classes"], bool):
        raise ValueError("release_classes must be true or false")
    if merged["unlabeled"] not in UNLABELED_METHODS:
        raise ValueError(f"unlabeled must be one of {', '.join(UNLABELED_METHODS)}, not {merged['unlabeled']!r}")
    if not _number(merged["confidence"]) or not 0 < merged["confidence"] <= 1:
        raise ValueError("confidence must be a number above 0 and at most 1")
    return dict(values)


def _check_private_modules(merged: dict, *, given: bool, modules: Iterable[str] | None) -> None:
    names = merged["private_modules"]
    if (
        not isinstance(names, list)
        or len(names) > MAX_PRIVATE_MODULES
        or not all(isinstance(name, str) and name and len(name) <= 200 for name in names)
    ):
        raise ValueError(f"private_modules must be a list of at most {MAX_PRIVATE_MODULES} module names")
    if len(set(names)) != len(names):
        raise ValueError("private_modules names a module twice")
    if merged["method"] == "private_modules" and not names:
        raise ValueError("the private_modules method needs at least one module in private_modules")
    # The default list is checked only where it is used: an adapter without a "head" may run ditto.
    if modules is not None and (given or merged["method"] == "private_modules"):
        known = set(modules)
        foreign = [name for name in names if name not in known]
        if foreign:
            raise ValueError(
                f"private_modules {foreign} are not among the adapter's target_modules or modules_to_save "
                f"({', '.join(sorted(known)) or 'none'})"
            )
