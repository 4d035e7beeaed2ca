"""Learning from the samples nobody labelled: pseudo-labels for the personal pass.

On a device most samples come without a label (``edge_agent.unlabeled``). Where the adapter's personalization
setting says ``unlabeled: "pseudo_label"`` (off by default), the personal pass (``edge_agent.personal.personalize``)
trains in two stages: on the labelled samples, judged on its validation slice; then, from where that got to, on
them and the newest unlabeled samples (``train_window`` of them) that the model so trained labels at least
``confidence`` sure, of a class the device's users gave, at most ``PSEUDO_RATIO`` per labelled training sample,
the surest first (self-training with a confidence threshold, as FixMatch's unlabeled loss without its
augmentations: the families carry none yet). Pseudo-labelled samples join the training slice only: the validation
slice, which stops both stages, and the held slice, which every reported figure is measured on, stay labelled by
the device's users. A user's label always wins: a sample a user labels leaves the unlabeled store. The shared pass
does not use them: a pseudo-label carries the device's own names for its classes, which the shared head must not
learn (``release_classes``).

Why it is off by default: on the digits fleet's harsh split with 10% of each device's samples labelled, it lowered
the served model by 1.9 points on average on the held-out seeds (-5.4 on one, +1.7 on the other; own-sensor devices
gained a little, the others lost), where every label would have added 5.3 (bench/README.md, "unlabeled.py").
"""

from __future__ import annotations

import torch
from torch import nn

from edge_agent.families.common import LABEL, batched_logits

UNLABELED_METHODS = ("none", "pseudo_label")


def pseudo_labelled(
    model: nn.Module, unlabeled: dict | None, *, confidence: float, classes=None, limit: int | None = None
) -> dict:
    """The samples of ``unlabeled`` (inputs without ``y``) that ``model`` labels with a probability of at least
    ``confidence``, with those labels as ``y``; empty (``{}``) where there are none. ``classes``: only labels among
    them (the device's users' own); ``limit``: at most that many, the surest first."""
    if not unlabeled:
        return {}
    fields = {key: torch.as_tensor(value) for key, value in unlabeled.items() if key != LABEL}
    count = len(next(iter(fields.values()))) if fields else 0
    if not count:
        return {}
    data = {**fields, LABEL: torch.zeros(count, dtype=torch.int64)}  # batched_logits slices every field
    probabilities, labels = [], []
    with torch.no_grad():
        for _, logits in batched_logits(model, data):
            probability, label = torch.softmax(logits.float(), dim=-1).max(dim=-1)
            probabilities.append(probability)
            labels.append(label)
    probability, label = torch.cat(probabilities), torch.cat(labels)
    keep = probability >= confidence
    if classes is not None:
        keep &= torch.isin(label, torch.as_tensor(sorted(classes), dtype=label.dtype))
    chosen = torch.nonzero(keep).flatten()
    chosen = chosen[torch.argsort(probability[chosen], descending=True, stable=True)][:limit]
    if not len(chosen):
        return {}
    return {**{key: value[chosen] for key, value in fields.items()}, LABEL: label[chosen]}
