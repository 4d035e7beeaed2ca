"""Evaluating an adapter version on the server's evaluation set, where its model family provides one.

A family that can (``dataset(config)`` returning ``(train, test)`` and ``evaluate(model, data)``) is
evaluated on its held-out test split; the metrics are stored on the version, so the dashboard can chart
them over versions. A family without an evaluation set gives no metrics, never an error. A classifier's
metrics end with ``eval_class_accuracy``, its accuracy on each class (index: the label), which the manifest
signs for devices to weigh by their own labels (docs/protocol/README.md, "Assignments: what a device should run").
"""

from __future__ import annotations

import logging

import torch

from edge_agent.families import get_family
from edge_agent.families.common import LABEL, class_accuracy
from edge_agent.lora_layers import apply_adapter

logger = logging.getLogger(__name__)
_DATASETS: dict[tuple[str, str], object] = {}


def evaluate_tensors(adapter, tensors: dict[str, torch.Tensor]) -> dict:
    base_model = adapter.base_model
    family = get_family(base_model.family)
    if not (hasattr(family, "dataset") and hasattr(family, "evaluate")):
        return {}
    try:
        from training.registry.services import build_base

        cache_key = (base_model.family, repr(sorted(base_model.family_config.items())))
        if cache_key not in _DATASETS:
            _DATASETS[cache_key] = family.dataset(base_model.family_config)[1]
        model = apply_adapter(
            build_base(base_model),
            tensors,
            rank=adapter.rank,
            alpha=adapter.alpha,
            dropout=adapter.dropout,
            target_modules=adapter.target_modules,
            modules_to_save=adapter.modules_to_save,
        )
        data = _DATASETS[cache_key]
        with torch.no_grad():
            metrics = family.evaluate(model.eval(), data)
            per_class = class_accuracy(model, data) if isinstance(data, dict) and LABEL in data else []
        named = {f"eval_{name}": round(float(value), 6) for name, value in metrics.items()}
        return named | ({"eval_class_accuracy": per_class} if per_class else {})
    except Exception:  # evaluation is informative; a failure must not lose the round's version
        logger.exception("evaluating %s failed", adapter.name)
        return {}
