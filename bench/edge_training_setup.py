"""What the edge-training benchmark (``bench/edge_training.py``) measures: paths, the LoRA rank, and per model
family the batch, memory features and steps, with the configurations each run compares."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TMP = RESULTS / "edge-training-tmp"
RANK, ALPHA = 8, 16.0
MIB = 2**20

# family -> effective batch, micro-batch with the memory features, tokens, gradient checkpointing, optimizer steps
# per run, torch intra-op threads. One thread by default (--threads 0: torch's default, 2 here): on this shared
# 2-core machine, with another process holding a core, two OpenMP threads stall on every barrier; measured here,
# MiniLM's plain peft loop ran at 5-11 samples/s on 2 threads and 17-24 on 1.
FAMILIES = {
    "minilm-text": {
        "batch": 16,
        "micro": 8,
        "tokens": 64,
        "checkpointing": True,
        "steps": 10,
        "quick_steps": 5,
        "threads": 1,
    },
    "digits-cnn": {
        "batch": 32,
        "micro": 16,
        "tokens": None,
        "checkpointing": False,
        "steps": 200,
        "quick_steps": 60,
        "threads": 1,
    },
}


def configurations(family: str) -> list[dict]:
    """What runs, in order; ``baseline`` names the row speed ratios are taken against."""
    spec = FAMILIES[family]
    batch, micro, ckpt = spec["batch"], spec["micro"], spec["checkpointing"]
    accum = batch // micro
    return [
        {"id": "full", "kind": "full", "label": "full fine-tuning / plain loop", "optimizer": "adamw",
         "micro": batch, "accum": 1, "checkpointing": False, "baseline": None},
        {"id": "peft", "kind": "peft", "label": "peft LoRA / plain loop", "optimizer": "adamw",
         "micro": batch, "accum": 1, "checkpointing": False, "baseline": None},
        {"id": "agent", "kind": "agent", "label": "agent (train_adapter)", "optimizer": "adamw",
         "micro": batch, "accum": 1, "checkpointing": False, "baseline": "peft"},
        {"id": "peft_mem", "kind": "peft", "label": "peft LoRA / plain loop, memory features", "optimizer": "adamw",
         "micro": micro, "accum": accum, "checkpointing": ckpt, "baseline": "peft"},
        {"id": "agent_mem", "kind": "agent", "label": "agent (train_adapter), memory features", "optimizer": "adamw",
         "micro": micro, "accum": accum, "checkpointing": ckpt, "baseline": "peft_mem"},
        {"id": "agent_mem_adafactor", "kind": "agent", "label": "agent (train_adapter), memory features",
         "optimizer": "adafactor", "micro": micro, "accum": accum, "checkpointing": ckpt, "baseline": "peft_mem"},
    ]  # fmt: skip
