"""Online elastic weight consolidation (EWC) on the adapter's parameters, persisted between trainings.

After a training, ``consolidate`` estimates the diagonal Fisher information of the adapter parameters on the
data just learned (mean squared gradient of the loss over mini-batches, an empirical approximation) and
folds it into the running estimate, ``F = gamma * F_old + F_new``, anchored at the current parameters. The
next training adds ``lambda / 2 * sum(F * (theta - anchor) ** 2)`` to its loss. Fisher and anchors live in
one safetensors file keyed ``fisher/<PEFT key>`` and ``anchor/<PEFT key>``, written atomically.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from edge_agent.families.common import size, take
from edge_agent.identity import atomic_write
from edge_agent.lora_layers import adapter_parameters


class OnlineEWC:
    def __init__(self, path: Path | str | None = None, *, lam: float = 100.0, gamma: float = 0.9):
        self.path = Path(path) if path is not None else None
        self.lam, self.gamma = float(lam), float(gamma)
        self.fisher: dict[str, torch.Tensor] = {}
        self.anchor: dict[str, torch.Tensor] = {}
        self.tasks = 0
        if self.path is not None and self.path.exists():
            self._load(self.path.read_bytes())

    def _load(self, data: bytes) -> None:
        tensors = load_safetensors(data)
        self.fisher = {k.removeprefix("fisher/"): v for k, v in tensors.items() if k.startswith("fisher/")}
        self.anchor = {k.removeprefix("anchor/"): v for k, v in tensors.items() if k.startswith("anchor/")}
        header_length = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header_length]).get("__metadata__", {})
        self.tasks = int(metadata.get("tasks", 0))

    @property
    def active(self) -> bool:
        return bool(self.fisher) and self.lam > 0

    def penalty(self, model: nn.Module) -> torch.Tensor:
        """``lambda / 2 * sum F (theta - anchor)^2`` over the adapter parameters (0 before any consolidation)."""
        total = torch.zeros(())
        if not self.active:
            return total
        for key, parameter in adapter_parameters(model).items():
            if key in self.fisher:
                total = total + (self.fisher[key] * (parameter - self.anchor[key]) ** 2).sum()
        return 0.5 * self.lam * total

    def consolidate(
        self,
        model: nn.Module,
        data: dict[str, torch.Tensor],
        loss_fn: Callable[[nn.Module, dict], torch.Tensor],
        *,
        batch_size: int = 16,
        max_batches: int = 32,
    ) -> None:
        """Fold the Fisher estimated on ``data`` into the running one and re-anchor at the current parameters."""
        parameters = adapter_parameters(model)
        fresh = {key: torch.zeros_like(p) for key, p in parameters.items()}
        was_training = model.training
        model.eval()
        batches = 0
        try:
            for start in range(0, size(data), batch_size):
                if batches >= max_batches:
                    break
                model.zero_grad(set_to_none=True)
                loss_fn(model, take(data, slice(start, start + batch_size))).backward()
                for key, parameter in parameters.items():
                    if parameter.grad is not None:
                        fresh[key] += parameter.grad.detach() ** 2
                batches += 1
        finally:
            model.zero_grad(set_to_none=True)
            model.train(was_training)
        if batches == 0:
            return
        for key, value in fresh.items():
            value /= batches
            self.fisher[key] = self.gamma * self.fisher[key] + value if key in self.fisher else value
            self.anchor[key] = parameters[key].detach().clone()
        self.tasks += 1

    def save(self) -> None:
        if self.path is None:
            return
        tensors = {f"fisher/{k}": v.contiguous() for k, v in self.fisher.items()}
        tensors.update({f"anchor/{k}": v.contiguous() for k, v in self.anchor.items()})
        atomic_write(
            self.path, save_safetensors(tensors, metadata={"tasks": str(self.tasks), "gamma": str(self.gamma)})
        )
