"""What the device's own model costs: per family and method, the personal pass against the shared pass it
runs beside (the baseline, measured in the same run): trainable parameters, time per optimizer step, the
process's peak memory growth over the pass, and what the personal model keeps on disk.

    .venv/bin/python bench/personalization_cost.py [--family digits-cnn|minilm-text] [--steps 40]

Each pass runs ``train_adapter`` as the agent does (micro-batch 16, AdamW, refit off so the steps are the ones
timed) on the family's demo data; ``ditto`` adds its proximal term, ``private_modules`` trains only the head.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from edge_agent.families import default_shape, get_family
from edge_agent.lora_layers import adapter_parameters, adapter_tensors, apply_adapter, load_adapter_tensors
from edge_agent.personal import PersonalSettings, PersonalStore, private_keys, proximal_penalty
from edge_agent.training import TrainConfig, train_adapter


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _pass(model, data, config, family, penalty=None) -> tuple[float, int, int]:
    """(seconds per step, peak memory growth in KiB, steps) of one training pass."""
    before = _peak_kib()
    began = time.perf_counter()
    result = train_adapter(model, data, {k: v[:0] for k, v in data.items()}, config=config, family=family,
                           penalty=penalty)  # fmt: skip
    return (time.perf_counter() - began) / max(result.steps, 1), _peak_kib() - before, result.steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--family", default="digits-cnn", choices=["digits-cnn", "minilm-text"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3, help="passes per row; the fastest is reported")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    family = get_family(args.family)
    base = family.build({"seed": 0})
    train, _ = family.dataset({})
    rank, alpha = default_shape(family)  # the adapter an operator gets without choosing a shape

    def adapted(tensors=None):
        return apply_adapter(copy.deepcopy(base), tensors, rank=rank, alpha=alpha,
                             target_modules=list(family.default_targets),
                             modules_to_save=list(family.default_modules_to_save))  # fmt: skip

    shared = adapter_tensors(adapted())
    config = TrainConfig(epochs=1000, micro_batch=16, max_steps=args.steps, patience=10**6, progress_bar=False)
    warm = adapted()
    _pass(warm, train, replace(config, max_steps=5), family)  # first calls allocate torch's pools: not counted
    rows = []
    print(f"{args.family}: {sum(p.numel() for p in base.parameters()):,} base parameters; LoRA rank {rank} on "
          f"{', '.join(family.default_targets)}; {args.steps} steps a pass, micro-batch 16, "
          f"{torch.get_num_threads()} thread(s)", file=sys.stderr)  # fmt: skip
    for method in ("shared pass (baseline)", "finetune", "ditto", "private_modules"):
        model = adapted({k: v.clone() for k, v in shared.items()})
        penalty, trainable = None, adapter_parameters(model)
        if method == "ditto":
            penalty = proximal_penalty(model, shared, PersonalSettings(method="ditto").lam)
        if method == "private_modules":
            private = private_keys(trainable, family.default_modules_to_save)
            for key, parameter in trainable.items():
                parameter.requires_grad_(key in private)
            trainable = {k: v for k, v in trainable.items() if k in private}
        start = adapter_tensors(model)
        runs = []
        for _ in range(args.repeat):  # the fastest of several passes from the same start: the machine is shared
            load_adapter_tensors(model, start)
            runs.append(_pass(model, train, replace(config), family, penalty))
        seconds, grown, steps = min(r[0] for r in runs), max(r[1] for r in runs), runs[0][2]
        with tempfile.TemporaryDirectory() as home:
            store = PersonalStore(Path(home))
            store.save(adapter_tensors(model), method=method)
            on_disk = sum(p.stat().st_size for p in store.root.iterdir() if p.is_file())
        count = sum(p.numel() for p in trainable.values())
        rows.append((method, count, seconds * 1000, grown / 1024, on_disk / 1024, steps))
    print(f"\n| {args.family} | trainable parameters | ms per step | peak memory growth (MiB) | personal state on disk "
          "(KiB) | steps |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for method, count, ms, grown, disk, steps in rows:
        shown_disk = "-" if method.startswith("shared") else f"{disk:.1f}"
        print(f"| {method} | {count:,} | {ms:.2f} | {grown:.1f} | {shown_disk} | {steps} |")
    baseline = rows[0][2]
    print("\nTime per step against the shared pass: "
          + ", ".join(f"{m} {ms / baseline:.2f}x" for m, _, ms, *_ in rows[1:]))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
