"""The device's own LoRA layers compute exactly what PEFT computes for the same adapter tensors."""

import copy
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import save_file

from edge_agent.families import get_family
from edge_agent.lora import initial_tensors, peft_config, tensor_spec
from edge_agent.lora_layers import (
    LoRAConv2d,
    LoRALinear,
    adapter_parameters,
    adapter_tensors,
    apply_adapter,
    load_adapter_tensors,
)

TARGETS, SAVED = ["conv2", "fc1"], ["head"]


def random_adapter(base, rank=4, seed=1):
    spec = tensor_spec(base, rank=rank, target_modules=TARGETS, modules_to_save=SAVED)
    generator = torch.Generator().manual_seed(seed)
    return {key: torch.randn(s.shape, generator=generator) * 0.3 for key, s in spec.items()}


def test_digits_adapter_output_equals_peft_loaded_from_an_exported_directory(tmp_path):
    base = get_family("digits-cnn").build({"seed": 3})
    tensors = random_adapter(base)
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    config = peft_config(rank=4, alpha=8, dropout=0.0, target_modules=TARGETS, modules_to_save=SAVED)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    reference = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()

    ours = apply_adapter(base, tensors, rank=4, alpha=8, target_modules=TARGETS, modules_to_save=SAVED, copy=True)
    assert isinstance(ours.conv2, LoRAConv2d) and isinstance(ours.fc1, LoRALinear)
    x = torch.rand(16, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got, plain = reference(x), ours(x), base(x)
    assert torch.allclose(got, expected, atol=1e-6), (got - expected).abs().max()
    assert (got - plain).abs().max() > 1.0  # the adapter really changes the output


def test_digits_adapter_equals_get_peft_model_with_the_state_dict_set_and_a_fresh_one_is_the_base():
    base = get_family("digits-cnn").build({"seed": 4})
    reference = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=2, lora_alpha=6, target_modules=TARGETS, modules_to_save=SAVED)
    )
    tensors = random_adapter(base, rank=2, seed=7)
    result = set_peft_model_state_dict(reference, tensors)
    assert not result.unexpected_keys
    ours = apply_adapter(base, tensors, rank=2, alpha=6, target_modules=TARGETS, modules_to_save=SAVED, copy=True)
    x = torch.rand(8, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(ours(x), reference.eval()(x), atol=1e-6)
        fresh = apply_adapter(base, None, rank=2, alpha=6, target_modules=TARGETS, modules_to_save=SAVED, copy=True)
        assert torch.equal(fresh(x), base(x))  # B starts at zero, the head as the base's


def test_adapter_tensors_match_the_spec_and_only_the_adapter_trains():
    base = get_family("digits-cnn").build({"seed": 5})
    frozen = {k: v.clone() for k, v in base.state_dict().items()}
    model = apply_adapter(base, None, rank=4, alpha=8, target_modules=TARGETS, modules_to_save=SAVED, seed=9)
    assert model is base  # in place unless copy=True
    spec = tensor_spec(
        get_family("digits-cnn").build({"seed": 5}), rank=4, target_modules=TARGETS, modules_to_save=SAVED
    )
    tensors = adapter_tensors(model)
    assert list(tensors) == list(spec)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {k: s.shape for k, s in spec.items()}
    shapes = {k: s.shape for k, s in spec.items()}
    expected = initial_tensors(base, shapes, seed=9, target_modules=TARGETS, modules_to_save=SAVED)
    assert all(torch.equal(tensors[k], expected[k]) for k in spec)

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        "conv2.lora_A", "conv2.lora_B", "fc1.lora_A", "fc1.lora_B", "head.weight", "head.bias"
    }  # fmt: skip
    torch.optim.SGD(adapter_parameters(model).values(), lr=0.5).zero_grad()
    model(torch.rand(4, 1, 8, 8)).sum().backward()
    assert model.conv1.weight.grad is None and model.fc1.base_layer.weight.grad is None
    assert model.conv2.lora_A.grad is not None  # B is zero, but A and B both get gradients through the head
    for name in ("conv1.weight", "conv2.weight", "fc1.weight"):
        module_name = name.rsplit(".", 1)[0]
        layer = model.get_submodule(module_name)
        weight = layer.base_layer.weight if hasattr(layer, "base_layer") else layer.weight
        assert torch.equal(weight, frozen[name])


def test_loading_wrong_tensors_is_refused_and_changes_nothing():
    model = apply_adapter(
        get_family("digits-cnn").build({"seed": 1}), None, rank=4, alpha=8, target_modules=TARGETS,
        modules_to_save=SAVED,
    )  # fmt: skip
    before = adapter_tensors(model)
    bad_shape = {**before, "base_model.model.fc1.lora_A.weight": torch.zeros(3, 128)}
    with pytest.raises(ValueError, match="shape"):
        load_adapter_tensors(model, bad_shape)
    missing = {k: v for k, v in before.items() if "head" not in k}
    with pytest.raises(ValueError, match="missing"):
        load_adapter_tensors(model, missing)
    assert all(torch.equal(before[k], v) for k, v in adapter_tensors(model).items())
    with pytest.raises(ValueError, match="already carries"):
        apply_adapter(model, None, rank=4, alpha=8, target_modules=TARGETS)
