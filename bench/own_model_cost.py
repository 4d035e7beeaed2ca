"""``own_model.py``'s first part: what training a team's own exported model costs an agent on this CPU, LoRA as
the product trains it against full fine-tuning of the same model.

Two models of the same kind, each exported with ``torch.export`` as a team would (``demo.sensor_model``):
``sensor``, the demo's own ``SensorCNN`` (trained by ``trained_model(0)``), and ``sensor-wide``, the same layers,
input and card with ``WIDE`` channels (initialised, not trained: a pass costs the same whatever the weights). Each
configuration runs in a fresh process (this file with ``--child``), ``repeats`` times interleaved, medians:

- ``lora``: the base loaded by ``ExportedProgramFamily().load(card, bytes)``, ``apply_adapter`` with the family's
  ``defaults`` (LoRA on every adaptable weight but the last, the prediction layer trained in full) at the shape an
  adapter gets without one (``default_shape``);
- ``full``: the same exported module with every parameter trainable (``apply_adapter`` with no target and every
  module to save: the exported graph trains all its parameters, so no eager ``nn.Module`` is needed).

Both train with ``edge_agent.training.train_adapter`` as the agent's shared pass does (AdamW, lr 0.01, micro-batch 16,
gradient norm clipped to 1, restricted classes, a checkpoint at every epoch's end) for ``EPOCHS`` epochs on one
device's windows, without replay or refit (the refit repeats the same steps) and without early stopping, so both do
the same steps. Figures: peak RSS over the pass (the kernel's ``VmHWM``, reset through ``/proc/self/clear_refs``
once the model is loaded and adapted) minus the RSS then (the idle process with the model); samples per second of
the whole call (validation passes and checkpoints included) and of the steps alone (micro-batch / median step
time); the update's size as the agent would send it uncompressed (the adapter's tensors as float32 safetensors)
against the ``.pt2`` and the parameters at 4 bytes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

BENCH = Path(__file__).resolve().parent
for folder in (BENCH.parent, BENCH):  # the repository (bench.*, demo, edge_agent) and bench/ (edge_training_child)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from demo.sensor_model import CARD, CHANNELS, STEPS, SensorCNN, export_bytes, trained_model, windows  # noqa: E402

EPOCHS, MICRO_BATCH, TRAIN, VAL = 3, 16, 480, 60
WIDE = {"width": 384, "hidden": 1536}
DEVICE = {"offset": 0.8, "gain": 1.7, "noise": 0.3}  # demo.sensor_model.SENSORS[1]: a wearer the base misreads


class WideSensorCNN(SensorCNN):
    """``SensorCNN`` with ``width`` channels in both convolutions and a ``hidden``-wide layer before the head: the
    same forward, input and card."""

    def __init__(self, width: int, hidden: int):
        nn.Module.__init__(self)
        self.conv1 = nn.Conv1d(CHANNELS, width, 5, padding=2)
        self.conv2 = nn.Conv1d(width, width, 5, padding=2)
        self.fc = nn.Linear(width * (STEPS // 4), hidden)
        self.head = nn.Linear(hidden, CARD["classes"])


def write_models(folder: Path) -> dict[str, Path]:
    """The two models' ``.pt2`` files in ``folder``, by name."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    models = {"sensor": trained_model(0), "sensor-wide": WideSensorCNN(**WIDE).eval()}
    paths = {}
    for name, model in models.items():
        paths[name] = folder / f"{name}.pt2"
        paths[name].write_bytes(export_bytes(model))
    return paths


def _warm_up() -> None:
    """One tiny step of every kind the pass uses, so one-time library set-up counts for neither configuration."""
    layer = nn.Sequential(nn.Conv1d(CHANNELS, 2, 5, padding=2), nn.Flatten(), nn.Linear(2 * STEPS, 4))
    nn.functional.cross_entropy(layer(torch.randn(2, CHANNELS, STEPS)), torch.tensor([0, 1])).backward()
    torch.optim.AdamW(layer.parameters(), lr=1e-3).step()


def _status_mib(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` (the peak since the last reset) of this process, in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """The peak back to the RSS now: ``ru_maxrss`` cannot be reset (an exiting thread folds the peak of loading the
    model back into it), the kernel's ``VmHWM`` can."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def run_child(spec: dict) -> dict:
    # Imported here, in the child: what they cost is part of the idle process each configuration starts from.
    import gc
    import tempfile
    import time

    from safetensors.torch import save

    from edge_agent.families import default_shape
    from edge_agent.families.exported import ExportedProgramFamily
    from edge_agent.lora_layers import adapter_tensors, apply_adapter
    from edge_agent.training import TrainConfig, train_adapter

    torch.set_num_threads(1)
    _warm_up()
    family = ExportedProgramFamily()
    data = Path(spec["path"]).read_bytes()
    base = family.load(CARD, data)
    parameters = sum(p.numel() for p in base.parameters())
    if spec["method"] == "lora":
        targets, saved = family.defaults(base)
    else:
        targets, saved = [], [name for name, child in base.named_children() if any(True for _ in child.parameters())]
    rank, alpha = default_shape(family)
    model = apply_adapter(base, None, rank=rank, alpha=alpha, target_modules=targets, modules_to_save=saved)
    train = {k: torch.as_tensor(v) for k, v in windows(TRAIN, seed=7, **DEVICE).items()}
    val = {k: torch.as_tensor(v) for k, v in windows(VAL, seed=8, **DEVICE).items()}
    gc.collect()
    idle = _status_mib("VmRSS")
    stamps: list[float] = []

    def progress(event: dict) -> None:
        if event["event"] == "step":
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as folder:
        config = TrainConfig(
            epochs=EPOCHS, micro_batch=MICRO_BATCH, lr=0.01, patience=EPOCHS + 1, restrict_classes=True,
            checkpoint_dir=Path(folder) / "checkpoints", progress_bar=False, seed=0,
        )  # fmt: skip
        _reset_peak()
        began = time.perf_counter()
        result = train_adapter(model, train, val, config=config, family=family, progress=progress)
        seconds = time.perf_counter() - began
        peak = _status_mib("VmHWM")
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    tensors = adapter_tensors(model)
    return {
        **spec,
        "targets": targets,
        "modules_to_save": saved,
        "rank": rank,
        "parameters": parameters,
        "trainable": sum(t.numel() for t in tensors.values()),
        "pt2_bytes": len(data),
        "delta_bytes": len(save({k: v.float().contiguous() for k, v in tensors.items()})),
        "idle_rss_mib": idle,
        "peak_rss_mib": peak,
        "training_memory_mib": peak - idle,
        "samples_seen": result.samples_seen,
        "seconds": seconds,
        "samples_per_s": result.samples_seen / seconds,
        "step_samples_per_s": MICRO_BATCH / statistics.median(steps) if steps else None,
        "after": result.after,
        "discarded": result.discarded,
    }


def child(spec: dict) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    done = subprocess.run(argv, cwd=BENCH.parent, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True,
                          text=True, timeout=1800)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"child {spec} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def measure(paths: dict[str, Path], repeats: int, say) -> list[dict]:
    """Every configuration ``repeats`` times, interleaved; one row each with the medians and every run."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(repeats):
        for name, path in paths.items():
            for method in ("lora", "full"):
                run = child({"model": name, "method": method, "path": str(path)})
                runs.setdefault((name, method), []).append(run)
                say(f"cost {repeat + 1}/{repeats} {name} {method}: {run['training_memory_mib']:.1f} MiB over idle, "
                    f"{run['samples_per_s']:.0f} samples/s")  # fmt: skip
    return [{**done[0], **{k: statistics.median(r[k] for r in done) for k in MEDIANS}, "runs": done}
            for done in runs.values()]  # fmt: skip


MEDIANS = ("idle_rss_mib", "peak_rss_mib", "training_memory_mib", "samples_per_s", "step_samples_per_s", "seconds")


def cost_table(rows: list[dict]) -> str:
    """One line per model and method; the ratios are LoRA's against full fine-tuning's of the same model."""
    by = {(r["model"], r["method"]): r for r in rows}
    lines = [
        "| model | parameters (.pt2) | method | trainable | idle RSS MiB | peak RSS MiB | training memory MiB | "
        "samples/s (pass) | samples/s (steps) | delta (f32 safetensors) | delta / .pt2 | delta / parameters x 4 B |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        full = by[(r["model"], "full")]

        def against(key: str, r=r, full=full) -> str:
            return "" if r is full else f" ({r[key] / full[key]:.2f}x)"

        lines.append(
            f"| {r['model']} | {r['parameters']:,} ({r['pt2_bytes'] / 1024:,.0f} KiB) | {r['method']} | "
            f"{r['trainable']:,} | {r['idle_rss_mib']:.0f} | {r['peak_rss_mib']:.0f} | "
            f"{r['training_memory_mib']:.1f}{against('training_memory_mib')} | "
            f"{r['samples_per_s']:,.0f}{against('samples_per_s')} | "
            f"{r['step_samples_per_s']:,.0f}{against('step_samples_per_s')} | {r['delta_bytes'] / 1024:,.1f} KiB | "
            f"{100 * r['delta_bytes'] / r['pt2_bytes']:.1f}% | {100 * r['delta_bytes'] / (4 * r['parameters']):.1f}% |"
        )
    return "\n".join(lines)


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    print("RESULT " + json.dumps(run_child(json.loads(sys.argv[2]))), flush=True)
