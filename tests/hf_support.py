"""A tiny Hugging Face sequence classifier built here from a small config (no download): a 2-layer BERT over a
vocabulary of its own, saved with ``save_pretrained`` (safetensors) beside its tokenizer, zipped as a team
uploads it."""

from __future__ import annotations

import io
import tempfile
import zipfile
from pathlib import Path

import torch

WORDS = [
    "the", "a", "my", "team", "won", "lost", "match", "goal", "rain", "snow", "sun", "cold", "today", "pasta", "soup",
    "bread", "good", "bad", "new", "fast", "phone", "laptop", "crashed", "slow",
]  # fmt: skip
TEXTS = {0: ["the team won the match", "a goal today", "my team lost"], 1: ["rain today", "cold snow", "the sun"],
         2: ["my phone crashed", "the new laptop", "a slow phone"]}  # fmt: skip


def tiny_bert(folder: Path, *, num_labels: int = 3, seed: int = 0) -> Path:
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder.parent / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    config = BertConfig(vocab_size=5 + len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, num_labels=num_labels, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(seed)
    BertForSequenceClassification(config).eval().save_pretrained(folder)
    BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(folder)
    return folder


def zipped(folder: Path, *, extra: dict[str, bytes] | None = None, drop: tuple[str, ...] = ()) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for path in sorted(folder.iterdir()):
            if path.name not in drop:
                archive.write(path, f"{folder.name}/{path.name}")
        for name, data in (extra or {}).items():
            archive.writestr(name, data)
    return out.getvalue()


def tiny_bert_zip(**kwargs) -> tuple[bytes, Path]:
    folder = tiny_bert(Path(tempfile.mkdtemp()) / "intent-bert", **kwargs)
    return zipped(folder), folder
