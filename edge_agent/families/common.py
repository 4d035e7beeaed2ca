"""What the classification families share: batches as dicts of tensors, loss, evaluation, non-IID shards.

A data set (or a batch) is a dict of tensors with the same first dimension: the model's inputs by keyword
(``x`` for the digits CNN, ``input_ids`` / ``attention_mask`` for MiniLM) and the labels under ``y``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

LABEL = "y"


@dataclass(frozen=True)
class SampleField:
    """One field of the samples a family takes from a device's application (``sample_fields``): its shape per
    sample, its dtype (``float32``, ``int64`` or ``text``) and, for numbers, the inclusive range it must lie in."""

    shape: tuple[int, ...]
    dtype: str
    low: float | None = None
    high: float | None = None

    def describe(self) -> str:
        bounds = f" in [{self.low:g}, {self.high:g}]" if self.low is not None and self.high is not None else ""
        return f"{self.dtype} {list(self.shape)}{bounds}"


def size(data: dict[str, torch.Tensor]) -> int:
    return len(data[LABEL])


def take(data: dict, index) -> dict:
    """Rows ``index`` (a slice, index array or tensor) of every field."""
    return {key: value[index] for key, value in data.items()}


def concat(parts: list[dict]) -> dict:
    parts = [p for p in parts if p and size(p)]
    if not parts:
        raise ValueError("nothing to concatenate")
    return {key: torch.cat([torch.as_tensor(p[key]) for p in parts]) for key in parts[0]}


def inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in batch.items() if key != LABEL}


def classification_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the model's logits on the batch."""
    return F.cross_entropy(model(**inputs(batch)), batch[LABEL])


def restricted_classification_loss(model: nn.Module, batch: dict[str, torch.Tensor], classes: torch.Tensor):
    """Cross-entropy over ``classes`` only (the others' logits masked out): a device whose users show it two or
    three classes trains what it knows of them and says nothing of the rest. With the full softmax every local
    step also pushes the absent classes' logits down, and a few such updates averaged together make a shared
    model that no longer predicts them (README.md, "The release gate"; FedRS, Li and Zhan 2021, restricts the
    softmax the same way)."""
    logits = model(**inputs(batch))
    mask = torch.full((logits.shape[-1],), float("-inf"), dtype=logits.dtype)
    mask[classes] = 0.0
    return F.cross_entropy(logits + mask, batch[LABEL])


@torch.no_grad()
def batched_logits(model: nn.Module, data: dict[str, torch.Tensor], *, batch_size: int = 256):
    """``(batch, logits)`` for ``data`` in slices of ``batch_size``, with the model in eval mode and no gradients
    meanwhile (its mode is restored when the iteration ends)."""
    was_training = model.training
    model.eval()
    try:
        for start in range(0, size(data), batch_size):
            batch = take(data, slice(start, start + batch_size))
            yield batch, model(**inputs(batch))
    finally:
        model.train(was_training)


def classification_evaluate(model: nn.Module, data: dict[str, torch.Tensor], *, batch_size: int = 256) -> dict:
    """``{"accuracy", "loss", "samples"}`` of the model on ``data``, in eval mode (its mode is restored)."""
    total_loss, correct, n = 0.0, 0, size(data)
    for batch, logits in batched_logits(model, data, batch_size=batch_size):
        total_loss += float(F.cross_entropy(logits, batch[LABEL], reduction="sum"))
        correct += int((logits.argmax(-1) == batch[LABEL]).sum())
    if n == 0:
        return {"accuracy": float("nan"), "loss": float("nan"), "samples": 0}
    return {"accuracy": correct / n, "loss": total_loss / n, "samples": n}


def class_accuracy(model: nn.Module, data: dict[str, torch.Tensor], *, batch_size: int = 256) -> list[float | None]:
    """The model's accuracy on each class of ``data`` (index: the label), ``None`` for a label below the highest
    that has no sample: what a device weighs by its own labels to judge a version it cannot measure itself
    (``edge_agent.personal.class_mix_accuracy``)."""
    if not size(data) or LABEL not in data:
        return []
    classes = int(torch.as_tensor(data[LABEL]).max()) + 1
    right, seen = torch.zeros(classes), torch.zeros(classes)
    for batch, logits in batched_logits(model, data, batch_size=batch_size):
        labels = batch[LABEL]
        seen += torch.bincount(labels, minlength=classes)[:classes].float()
        right += torch.bincount(labels[logits.argmax(-1) == labels], minlength=classes)[:classes].float()
    return [round(float(r / n), 6) if n else None for r, n in zip(right.tolist(), seen.tolist(), strict=True)]


class Classifier:
    """What a family whose model gives class logits shares: ``evaluate`` (in slices of ``eval_batch_size``),
    ``loss`` and ``restricted_loss``."""

    eval_batch_size = 256

    def evaluate(self, model: nn.Module, data: dict[str, torch.Tensor]) -> dict[str, float]:
        return classification_evaluate(model, data, batch_size=self.eval_batch_size)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return classification_loss(model, batch)

    def restricted_loss(self, model: nn.Module, batch: dict[str, torch.Tensor], classes: torch.Tensor) -> torch.Tensor:
        return restricted_classification_loss(model, batch, classes)


def dirichlet_shards(labels, num_devices: int, alpha: float, seed: int = 0) -> list[np.ndarray]:
    """Split sample indices into ``num_devices`` non-IID shards: for every class, the share each device gets
    is drawn from Dirichlet(alpha) (small alpha: few classes per device). Every index lands in exactly one
    shard; shards are sorted index arrays, deterministic from ``seed``."""
    if num_devices <= 0 or alpha <= 0:
        raise ValueError("num_devices and alpha must be positive")
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    shards: list[list[int]] = [[] for _ in range(num_devices)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        shares = rng.dirichlet(np.full(num_devices, alpha))
        cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
        for device, part in enumerate(np.split(members, cuts)):
            shards[device].extend(part.tolist())
    return [np.sort(np.asarray(s, dtype=np.int64)) for s in shards]


def pretrain(
    model: nn.Module, data: dict, *, loss=classification_loss, epochs: int = 40, lr: float = 3e-3,
    batch_size: int = 32, seed: int = 0,
) -> nn.Module:  # fmt: skip
    """Train every parameter of ``model`` on ``data`` centrally (Adam), as a maker trains a base model at the
    factory before it ships; returns the model in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(size(data), generator=generator)
        for start in range(0, len(order), batch_size):
            optimizer.zero_grad(set_to_none=True)
            loss(model, take(data, order[start : start + batch_size])).backward()
            optimizer.step()
    return model.eval()
