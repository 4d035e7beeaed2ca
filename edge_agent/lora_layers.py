"""LoRA wrappers on a frozen base model, without PEFT on the device, numerically equal to PEFT's.

``y = base(x) + (alpha / r) * B(A(dropout(x)))`` with the shapes of ``edge_agent.lora``: for a Linear,
``A`` is ``[r, in]`` and ``B`` is ``[out, r]``; for a Conv2d, ``A`` is ``[r, in, kh, kw]`` applied with the
base's stride and padding (as PEFT does: no dilation, no groups) and ``B`` is ``[out, r, 1, 1]``. Modules to
save are trained in full in place. Tensors go in and out keyed by PEFT names (``edge_agent.lora.PREFIX``).
An exported program's module (``edge_agent.lora.weight_target``) gets its update on the weight itself
(``LoRAWeight``, a parametrization): ``W + (alpha / r) * (B @ A).reshape(W.shape)``.
"""

from __future__ import annotations

import copy as copy_module
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from edge_agent.lora import PREFIX, initial_tensors, tensor_spec, weight_target


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    modules_to_save: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class _LoRABase(nn.Module):
    def __init__(self, base_layer: nn.Module, a_shape: tuple[int, ...], b_shape: tuple[int, ...], *, scaling, dropout):
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.Parameter(torch.zeros(a_shape))
        self.lora_B = nn.Parameter(torch.zeros(b_shape))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = float(scaling)

    def _lora(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        return result + self._lora(self.lora_dropout(x.to(self.lora_A.dtype))).to(result.dtype) * self.scaling


class LoRALinear(_LoRABase):
    """``nn.Linear`` plus a low-rank update: A ``[r, in]``, B ``[out, r]``."""

    def __init__(self, base_layer: nn.Linear, *, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__(
            base_layer,
            (rank, base_layer.in_features),
            (base_layer.out_features, rank),
            scaling=alpha / rank,
            dropout=dropout,
        )

    def _lora(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.lora_A), self.lora_B)


class LoRAConv2d(_LoRABase):
    """``nn.Conv2d`` plus a low-rank update: A ``[r, in, kh, kw]`` with the base's stride and padding, B
    ``[out, r, 1, 1]``."""

    def __init__(self, base_layer: nn.Conv2d, *, rank: int, alpha: float, dropout: float = 0.0):
        if base_layer.groups != 1:
            raise ValueError("LoRA on grouped convolutions is not supported")
        super().__init__(
            base_layer,
            (rank, base_layer.in_channels, *base_layer.kernel_size),
            (base_layer.out_channels, rank, 1, 1),
            scaling=alpha / rank,
            dropout=dropout,
        )

    def _lora(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.conv2d(x, self.lora_A, stride=self.base_layer.stride, padding=self.base_layer.padding)
        return F.conv2d(hidden, self.lora_B)


class LoRAWeight(nn.Module):
    """A parametrization of an exported program's weight ``W`` (``[out, ...]``): ``W + scaling * (B @ A)``
    reshaped to ``W``, with A ``[r, prod(W.shape[1:])]`` and B ``[out, r]``. Registered on the program's own
    module, so its graph reads the adapted weight; the module carries ``lora_A`` and ``lora_B`` as the wrappers
    do. Dropout has no input to act on here and is not applied."""

    def __init__(self, weight: torch.Tensor, *, rank: int, alpha: float):
        super().__init__()
        self.lora_A = nn.Parameter(torch.zeros((rank, weight[0].numel())))
        self.lora_B = nn.Parameter(torch.zeros((weight.shape[0], rank)))
        self.scaling = alpha / rank

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        update = (self.lora_B @ self.lora_A).reshape(weight.shape).to(weight.dtype)
        return weight + update * self.scaling

    @staticmethod
    def attach(module: nn.Module, *, rank: int, alpha: float) -> None:
        lora = LoRAWeight(module.weight, rank=rank, alpha=alpha)
        parametrize.register_parametrization(module, "weight", lora, unsafe=True)
        module.lora_A, module.lora_B = lora.lora_A, lora.lora_B


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def apply_adapter(
    base: nn.Module,
    tensors: dict[str, torch.Tensor] | None = None,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: list[str] | tuple[str, ...],
    modules_to_save: list[str] | tuple[str, ...] = (),
    seed: int = 0,
    copy: bool = False,
) -> nn.Module:
    """Wrap the target modules of ``base`` (in place, or of a deep copy with ``copy=True``) with LoRA layers,
    freeze everything but the LoRA tensors and the modules to save, and load ``tensors`` (PEFT-keyed; a fresh
    adapter from ``seed`` when None). Returns the adapted model."""
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, not {rank}")
    if getattr(base, "adapter_config", None) is not None:
        raise ValueError("this model already carries an adapter")
    model = copy_module.deepcopy(base) if copy else base
    targets, saved = tuple(target_modules), tuple(modules_to_save)
    spec = tensor_spec(model, rank=rank, target_modules=list(targets), modules_to_save=list(saved))
    if tensors is None:
        shapes = {key: s.shape for key, s in spec.items()}
        tensors = initial_tensors(model, shapes, seed=seed, target_modules=list(targets), modules_to_save=list(saved))
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    modules = dict(model.named_modules())
    for name in targets:
        layer = modules[name]
        if weight_target(layer) is not None:
            LoRAWeight.attach(layer, rank=rank, alpha=alpha)
            continue
        if isinstance(layer, nn.Linear):
            wrapped = LoRALinear(layer, rank=rank, alpha=alpha, dropout=dropout)
        else:
            wrapped = LoRAConv2d(layer, rank=rank, alpha=alpha, dropout=dropout)
        _set_submodule(model, name, wrapped)
    for name in saved:
        for parameter in model.get_submodule(name).parameters():
            parameter.requires_grad_(True)
    model.adapter_config = AdapterConfig(rank, float(alpha), float(dropout), targets, saved)
    load_adapter_tensors(model, tensors)
    return model


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The live trainable parameters of the adapter, by PEFT key, in ``tensor_spec`` order."""
    config: AdapterConfig | None = getattr(model, "adapter_config", None)
    if config is None:
        raise ValueError("this model carries no adapter: call apply_adapter first")
    parameters: dict[str, nn.Parameter] = {}
    for name in config.target_modules:
        layer = model.get_submodule(name)
        parameters[f"{PREFIX}{name}.lora_A.weight"] = layer.lora_A
        parameters[f"{PREFIX}{name}.lora_B.weight"] = layer.lora_B
    for name in config.modules_to_save:
        for parameter_name, parameter in model.get_submodule(name).named_parameters():
            parameters[f"{PREFIX}{name}.{parameter_name}"] = parameter
    return parameters


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the current adapter, PEFT-keyed, matching ``tensor_spec`` names and shapes."""
    return {key: p.detach().clone().contiguous() for key, p in adapter_parameters(model).items()}


def load_adapter_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy PEFT-keyed tensors into the adapter; ValueError (and nothing changed) on a missing, unexpected or
    misshapen tensor."""
    parameters = adapter_parameters(model)
    missing = [k for k in parameters if k not in tensors]
    unexpected = [k for k in tensors if k not in parameters]
    if missing or unexpected:
        raise ValueError(f"adapter tensors do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for key, parameter in parameters.items():
        if tuple(tensors[key].shape) != tuple(parameter.shape):
            raise ValueError(f"{key} has shape {tuple(tensors[key].shape)}, the model needs {tuple(parameter.shape)}")
    with torch.no_grad():
        for key, parameter in parameters.items():
            parameter.copy_(tensors[key].to(parameter.dtype))
