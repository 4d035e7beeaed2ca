"""LoRA adapter tensors with Hugging Face PEFT key names, without needing PEFT on the device.

For a target ``nn.Linear(in, out)``: ``lora_A`` is ``[r, in]`` and ``lora_B`` is ``[out, r]``; for a
``nn.Conv2d(in, out, k)``: ``lora_A`` is ``[r, in, kh, kw]`` and ``lora_B`` is ``[out, r, 1, 1]``. Modules to
save are stored whole under their own parameter names. Keys look like
``base_model.model.<module>.lora_A.weight`` so that an export loads with ``peft.PeftModel.from_pretrained``.

A module that only holds a ``weight`` of two or more dimensions (an exported program's submodules,
``edge_agent.families.exported``) is adapted on that weight's 2-D view ``[out, rest]``: ``lora_A`` is
``[r, rest]`` and ``lora_B`` ``[out, r]``, the update ``B @ A`` reshaped to the weight (``weight_target``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

PREFIX = "base_model.model."


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str = "F32"

    def as_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}


def tensor_spec(
    base: nn.Module, *, rank: int, target_modules: list[str], modules_to_save: list[str]
) -> dict[str, TensorSpec]:
    """Every tensor an adapter with this configuration holds, by PEFT key name."""
    modules = dict(base.named_modules())
    spec: dict[str, TensorSpec] = {}
    for name in target_modules:
        module = modules.get(name)
        if isinstance(module, nn.Linear):
            spec[f"{PREFIX}{name}.lora_A.weight"] = TensorSpec((rank, module.in_features))
            spec[f"{PREFIX}{name}.lora_B.weight"] = TensorSpec((module.out_features, rank))
        elif isinstance(module, nn.Conv2d):
            spec[f"{PREFIX}{name}.lora_A.weight"] = TensorSpec((rank, module.in_channels, *module.kernel_size))
            spec[f"{PREFIX}{name}.lora_B.weight"] = TensorSpec((module.out_channels, rank, 1, 1))
        elif (weight := weight_target(module)) is not None:
            spec[f"{PREFIX}{name}.lora_A.weight"] = TensorSpec((rank, math.prod(weight.shape[1:])))
            spec[f"{PREFIX}{name}.lora_B.weight"] = TensorSpec((weight.shape[0], rank))
        else:
            kind = type(module).__name__ if module is not None else "nothing"
            raise ValueError(
                f"target module {name!r} is {kind}; LoRA targets must be Linear or Conv2d layers, or an exported "
                f"program's modules holding a weight of two or more dimensions"
            )
    for name in modules_to_save:
        module = modules.get(name)
        if module is None:
            raise ValueError(f"module to save {name!r} does not exist in the base model")
        for parameter_name, parameter in module.named_parameters():
            spec[f"{PREFIX}{name}.{parameter_name}"] = TensorSpec(tuple(parameter.shape))
    return spec


def weight_target(module) -> torch.Tensor | None:
    """The weight LoRA adapts on a module of an exported program (a plain ``nn.Module`` holding a ``weight`` of
    two or more dimensions, as ``ExportedProgram.module()`` rebuilds the original layers), else None."""
    if type(module) is not nn.Module:
        return None
    weight = module._parameters.get("weight")
    return weight if weight is not None and weight.dim() >= 2 else None


def initial_tensors(
    base: nn.Module,
    shapes: dict[str, tuple[int, ...]],
    *,
    seed: int,
    target_modules: list[str],
    modules_to_save: list[str],
) -> dict[str, torch.Tensor]:
    """A fresh adapter, deterministic from ``seed``: A as PEFT initialises it (Kaiming uniform), B zero, so
    the adapted model starts equal to the base; modules to save start as copies of the base's."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name in target_modules:
        a_key, b_key = f"{PREFIX}{name}.lora_A.weight", f"{PREFIX}{name}.lora_B.weight"
        a = torch.empty(tuple(shapes[a_key]))
        fan_in = math.prod(a.shape[1:])
        bound = 1 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) gives exactly this bound
        tensors[a_key] = a.uniform_(-bound, bound, generator=generator)
        tensors[b_key] = torch.zeros(tuple(shapes[b_key]))
    modules = dict(base.named_modules())
    for name in modules_to_save:
        for parameter_name, parameter in modules[name].named_parameters():
            tensors[f"{PREFIX}{name}.{parameter_name}"] = parameter.detach().clone().contiguous()
    return tensors


def peft_config(
    *, rank: int, alpha: float, dropout: float, target_modules: list[str], modules_to_save: list[str]
) -> dict:
    """The ``adapter_config.json`` PEFT reads next to ``adapter_model.safetensors``."""
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": None,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": list(target_modules),
        "modules_to_save": list(modules_to_save) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
    }
