"""What a device too small to judge shared versions on its own samples serves.

A device whose held slice is empty (it holds fewer than ``SPLIT_EVERY`` samples) cannot measure a new shared
version against the one it served before, and serves the new one where it reads every label the device holds
right (``edge_agent.personal.choose``). A version better for the fleet can be worse for the few classes one user
writes: on the fleet benchmark a label-skew device of 8 samples was served v23 (86.7 on the server's evaluation
against version 1's 79.7), which scored 86.5 on its test data against version 1's 96.2 (bench/README.md,
"fleet_learning.py").

The manifest signs each version's accuracy on every class of the server's evaluation set
(``training.class_accuracy``). Weighted by the device's own label counts it is what the server's evaluation
predicts on this device (``class_mix_accuracy``). The device keeps the shared version that scored best so far
by its labels (``<home>/personal/earlier.safetensors``, described by ``earlier`` in ``state.json``) and serves a
new one only where it scores no more than ``margin`` below that; otherwise it serves the one it kept, as its
own model, until a newer version scores as well or its held slice can judge. Versions without per-class
figures, and the ``private_modules`` method (whose own modules differ from every shared version's), are served
as before.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

import torch
from safetensors.torch import load_file, save

from edge_agent.identity import atomic_write

logger = logging.getLogger("edge_agent.small_devices")
EARLIER_FILE = "earlier.safetensors"
METHODS = ("ditto", "finetune")  # the methods whose personal adapter is a whole adapter a shared version can be


def class_mix_accuracy(class_accuracy, labels) -> float | None:
    """The per-class accuracies weighted by how many of ``labels`` are of each class: the accuracy the server's
    evaluation predicts on a device holding those labels. ``None`` without figures, without labels, or where a
    label the device holds has no figure."""
    counts = Counter(int(label) for label in labels)
    if not class_accuracy or not counts:
        return None
    weighted = 0.0
    for label, n in counts.items():
        figure = class_accuracy[label] if 0 <= label < len(class_accuracy) else None
        if figure is None:
            return None
        weighted += n * float(figure)
    return weighted / sum(counts.values())


def serve_small(store, current: dict, outcome, settings, labels, shared: dict[str, torch.Tensor]):
    """``(outcome, fields)``: the personal pass's ``outcome`` as this rule leaves it, and the fields of
    ``state.json`` it sets (``earlier``: the version kept; ``earlier_version``: the one served instead of the
    installed one, else None). ``store`` is the device's ``PersonalStore``, ``current`` the installed version
    (``adapter``, ``version``, ``sha256``, ``training``), ``labels`` every label the device holds, ``shared``
    the installed version's tensors."""
    small = outcome.serving == "shared" and not outcome.shared.get("distinct", 0)
    if settings.method not in METHODS or not small:
        return outcome, {"earlier_version": None}
    now = class_mix_accuracy((current.get("training") or {}).get("class_accuracy"), labels)
    if now is None:
        return outcome, {"earlier_version": None}
    kept, path = store.state().get("earlier") or {}, store.root / EARLIER_FILE
    usable = kept.get("adapter") == current["adapter"] and path.exists()
    if usable and kept.get("version") == current["version"]:
        return outcome, {"earlier_version": None}  # the installed version is the one kept already
    then = class_mix_accuracy(kept.get("class_accuracy"), labels) if usable else None
    if then is None or now >= then:  # the best so far by this device's labels: kept in place of the earlier one
        store.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(path, save({k: v.contiguous() for k, v in sorted(shared.items())}))
        record = {key: current.get(key) for key in ("adapter", "version", "sha256")}
        return outcome, {"earlier": {**record, "class_accuracy": current["training"]["class_accuracy"]},
                         "earlier_version": None}  # fmt: skip
    if now >= then - settings.margin:
        return outcome, {"earlier_version": None}
    note = (
        f"serving v{kept['version']}: on this device's labels the server's evaluation scores it {then:.1%}, "
        f"the installed v{current['version']} {now:.1%}"
    )
    logger.info("%s (%d samples, no held slice to judge by)", note, len(labels))
    return replace(outcome, tensors=load_file(str(path)), serving="personal", notes=[*outcome.notes, note]), {
        "earlier_version": int(kept["version"])
    }
