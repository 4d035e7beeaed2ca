"""Edge training: speed and memory of the agent's training loop, delta size, packaging and outbox time.

For each family (``digits-cnn``; ``minilm-text`` at an effective batch of 16 x 64 tokens) every training
measurement runs in a fresh process (this file with ``--child``), so its memory figures are its own:

- ``full / plain``: full fine-tuning of the whole model in a plain torch loop with AdamW (the memory baseline);
- ``peft / plain``: LoRA r=8 (MiniLM: query/value of the 6 layers; digits: ``conv2``, ``fc1``; the head as a
  module to save, like the agent) with ``peft.get_peft_model`` in a plain loop (the speed baseline), at the
  full batch, and again with the memory features (micro-batches + gradient accumulation, gradient
  checkpointing for MiniLM) written by hand;
- ``agent``: ``edge_agent.lora_layers.apply_adapter`` + ``edge_agent.training.train_adapter`` as the runtime
  calls it (a local validation slice of a quarter of the training samples, checkpoints in a folder, one
  epoch), without and with the memory features, with AdamW and with Adafactor. No replay buffer (replayed
  samples would be extra work per step that the baselines do not do).

Every loop clips the gradient norm to 1.0 (as the agent does), so all compute the same kind of update.

Speed: ``steady`` samples/s is measured from the end of step ``--warmup`` to the end of the last step (the
agent's steps timed through its ``progress`` callback, the plain loops' the same way): the same work on both
sides. ``whole call`` is training samples / wall time of the whole training call: for the agent that adds
its validation passes (before training and after the epoch), the data fingerprint, the checkpoint and
restoring the best epoch; for the plain loops it is the loop including its warm-up steps. Both are also given
per CPU second of the process (``time.process_time``), which other processes on the machine disturb less
than wall time. Every child runs torch on one thread unless ``--threads`` says otherwise (see FAMILIES).

Memory (MiB = 2^20 bytes): ``peak RSS`` is the kernel's high-water mark of the child's RSS, read with
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (no sampling); ``after build`` is psutil's RSS right after the
model is built and wrapped (the data made, the libraries warmed up by one tiny step of every kind, so one-time
library set-up counts for nobody), before training; ``training memory`` = peak RSS - after build. The peak is
also split by phase (training steps; the agent's validation passes): ru_maxrss is read at every phase change
and reset by writing ``5`` to ``/proc/self/clear_refs``, the process's peak being the maximum over the phases.
The child records ru_maxrss just before training as well: had the load peaked above the training, the table
would say so.

Delta size: ``package_delta`` bytes for each encoding of a trained-shaped adapter (r=8) against the full
model's float32 safetensors (and its parameters at 2 and 1 bytes each). Packaging: median time of
``package_delta`` (delta, encode, sha256, Ed25519 signature) against a floor (``safetensors.torch.save`` +
sha256 of the same tensors), and of ``Outbox.put_delta`` (counter allocation in SQLite, packaging, atomic
file write with fsync, insert, commit with ``synchronous=FULL``) against ``atomic_write`` of the same bytes
alone; the outbox lives on the same disk as the repository (``bench/results/edge-training-tmp``).

Each configuration runs ``--repeats`` times, interleaved (repeat-major) so drift hits all alike; tables show
medians and ratios against the baseline of the same run. Prints Markdown tables with the command line, writes
``bench/results/edge_training.json``.

    .venv/bin/python bench/edge_training.py                       # both families, 3 repeats (~5 min)
    .venv/bin/python bench/edge_training.py --repeats 1 --quick   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from edge_training_child import run_child, run_package_child
from edge_training_setup import FAMILIES, RANK, RESULTS, ROOT, TMP, configurations

# --- the driver ------------------------------------------------------------------------------------------------


def child(spec: dict, timeout: float) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"child {spec} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, digits=1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def summarize(runs: list[dict], family: str) -> dict:
    rows = {}
    for config in configurations(family):
        mine = [r for r in runs if r["family"] == family and r["id"] == config["id"]]
        if not mine:
            continue
        rows[config["id"]] = {
            **config,
            "runs": len(mine),
            "steady": med([r["steady_samples_per_s"] for r in mine]),
            "steady_all": [round(r["steady_samples_per_s"] or 0, 1) for r in mine],
            "steady_cpu": med([r["steady_samples_per_cpu_s"] for r in mine]),
            "whole": med([r["whole_call_samples_per_s"] for r in mine]),
            "whole_cpu": med([r["whole_call_samples_per_cpu_s"] for r in mine]),
            "steps_memory": med([r["phase_memory_mib"].get("training") for r in mine]),
            "validation_memory": med([r["phase_memory_mib"].get("validation") for r in mine]),
            "after_build": med([r["rss_after_build_mib"] for r in mine]),
            "peak": med([r["peak_rss_mib"] for r in mine]),
            "peak_before_training": med([r["peak_before_training_mib"] for r in mine]),
            "training_memory": med([r["training_memory_mib"] for r in mine]),
            "training_memory_all": [round(r["training_memory_mib"], 1) for r in mine],
            "trainable": mine[0]["trainable_parameters"],
        }
    for row in rows.values():
        base = rows.get(row["baseline"]) if row["baseline"] else None
        for key in ("steady", "steady_cpu", "whole", "whole_cpu"):
            ok = base and base[key] and row[key]
            row[f"{key}_ratio"] = row[key] / base[key] if ok else None
        full = rows.get("full")
        row["memory_vs_full"] = row["training_memory"] / full["training_memory"] if full else None
    return rows


def speed_table(family: str, rows: dict) -> str:
    spec = FAMILIES[family]
    shape = f"{spec['batch']} x {spec['tokens']} tokens" if spec["tokens"] else f"{spec['batch']} images 8x8"

    def ratio(value):
        return f"{value:.3f}" if value else "—"

    lines = [
        f"**{family}: training speed** (effective batch {shape}; samples/s per wall second and per CPU second of"
        " the process; medians of the runs; ratio = this row / its baseline row, named in brackets)",
        "",
        "| configuration | optimizer | micro x accum | grad. ckpt | steady /s | ratio | steady /CPU-s | ratio"
        " | whole call /s | ratio | whole call /CPU-s | ratio | runs (steady /s) |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows.values():
        baseline = f" (vs {row['baseline']})" if row["baseline"] else " **(baseline)**" if row["id"] == "peft" else ""
        lines.append(
            f"| {row['id']}: {row['label']}{baseline} | {row['optimizer']} | {row['micro']} x {row['accum']}"
            f" | {'yes' if row['checkpointing'] else 'no'} | {fmt(row['steady'])} | {ratio(row['steady_ratio'])}"
            f" | {fmt(row['steady_cpu'])} | {ratio(row['steady_cpu_ratio'])} | {fmt(row['whole'])}"
            f" | {ratio(row['whole_ratio'])} | {fmt(row['whole_cpu'])} | {ratio(row['whole_cpu_ratio'])}"
            f" | {row['steady_all']} |"
        )
    return "\n".join(lines)


def memory_table(family: str, rows: dict) -> str:
    lines = [
        f"**{family}: memory** (MiB; peak RSS = the child's ru_maxrss high-water mark over its whole life; training"
        " memory = peak RSS − RSS right after the model is built; split by phase: the training steps, and the"
        " agent's validation passes; % = of full fine-tuning's training memory, the baseline)",
        "",
        "| configuration | optimizer | micro x accum | grad. ckpt | trainable params | RSS after build | peak RSS"
        " | training memory | % of full FT | of it: steps | of it: validation | runs (training memory) |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows.values():
        note = ""
        if row["peak_before_training"] and row["peak_before_training"] > row["after_build"] + 5:
            note = f" (load peaked at {fmt(row['peak_before_training'])})"
        lines.append(
            f"| {row['id']}: {row['label']}{' **(baseline)**' if row['id'] == 'full' else ''} | {row['optimizer']}"
            f" | {row['micro']} x {row['accum']} | {'yes' if row['checkpointing'] else 'no'} | {row['trainable']:,}"
            f" | {fmt(row['after_build'])} | {fmt(row['peak'])}{note} | {fmt(row['training_memory'])}"
            f" | {fmt(100 * row['memory_vs_full'], 1) + '%' if row['memory_vs_full'] else '—'}"
            f" | {fmt(row['steps_memory'])} | {fmt(row['validation_memory']) if row['validation_memory'] else '—'}"
            f" | {row['training_memory_all']} |"
        )
    return "\n".join(lines)


def delta_tables(packages: list[dict]) -> str:
    lines = [
        f"**Delta size** (LoRA r={RANK}, default targets + head as a module to save; `package_delta` bytes vs the"
        " full model: its float32 safetensors file, and its parameters at 2 / 1 bytes each)",
        "",
        "| family | model params | adapter params | model f32 bytes | delta f32 | % of model f32 | delta f16"
        " | % of model f16 | delta int8 | % of model int8 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in packages:
        d, m = p["delta_bytes"], p["model_bytes"]
        lines.append(
            f"| {p['family']} | {p['parameters']:,} | {p['adapter_parameters']:,} | {m['f32']:,} | {d['f32']:,}"
            f" | {100 * d['f32'] / m['f32']:.3f}% | {d['f16']:,} | {100 * d['f16'] / m['f16']:.3f}% | {d['int8']:,}"
            f" | {100 * d['int8'] / m['int8']:.3f}% |"
        )
    lines += [
        "",
        "**Packaging and outbox** (median ms; floor = `safetensors.torch.save` + sha256 of the same f32 tensors;"
        " outbox baseline = `atomic_write` of the same delta bytes alone, write + fsync + rename + folder fsync)",
        "",
        "| family | floor | package_delta f32 | f16 | int8 | package f32 / floor | atomic_write | Outbox.put_delta f32"
        " | put / atomic_write |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in packages:
        k = p["package_ms"]
        lines.append(
            f"| {p['family']} | {p['floor_ms']:.2f} | {k['f32']:.2f} | {k['f16']:.2f} | {k['int8']:.2f}"
            f" | {k['f32'] / p['floor_ms']:.2f} | {p['atomic_write_ms']:.2f} | {p['outbox_put_ms']:.2f}"
            f" | {p['outbox_put_ms'] / p['atomic_write_ms']:.2f} |"
        )
    return "\n".join(lines)


def targets(summaries: dict, packages: list[dict]) -> str:
    lines = ["**Targets**", ""]
    for family, rows in summaries.items():
        for rid in ("agent", "agent_mem", "agent_mem_adafactor"):
            row = rows.get(rid)
            if row and row["steady_cpu_ratio"]:
                cost, cost_wall = 1 - row["steady_cpu_ratio"], 1 - (row["steady_ratio"] or 0)
                lines.append(
                    f"- {family} {rid} vs {row['baseline']}: the agent's steps cost {100 * cost:+.1f}% per CPU second"
                    f" (target < 10%: {'met' if cost < 0.10 else 'NOT met'}), {100 * cost_wall:+.1f}% per wall second"
                    f" (wall time drifts with the machine's load); the whole call"
                    f" {100 * (1 - (row['whole_cpu_ratio'] or 0)):+.1f}% per CPU second (it adds the validation"
                    " passes, the fingerprint and the checkpoint)"
                )
    rows = summaries.get("minilm-text", {})
    for rid in ("agent_mem", "agent_mem_adafactor", "agent", "peft"):
        row = rows.get(rid)
        if row and row["memory_vs_full"]:
            steps = row["steps_memory"]
            split = (
                f"; the training steps alone {fmt(steps)} MiB, the validation pass {fmt(row['validation_memory'])} MiB"
                if row["validation_memory"] and steps
                else ""
            )
            lines.append(
                f"- minilm-text {rid}: training memory {fmt(row['training_memory'])} MiB ="
                f" {100 * row['memory_vs_full']:.1f}% of full fine-tuning's {fmt(rows['full']['training_memory'])} MiB"
                f" (target <= 40%: {'met' if row['memory_vs_full'] <= 0.40 else 'NOT met'}){split}"
            )
    for p in packages:
        if p["family"] == "minilm-text":
            share = p["delta_bytes"]["f32"] / p["model_bytes"]["f32"]
            lines.append(f"- minilm-text delta f32 = {100 * share:.3f}% of the model (target < 2%: "
                         f"{'met' if share < 0.02 else 'NOT met'})")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--families", default="digits-cnn,minilm-text")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every configuration (median reported)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default per family)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the steady rate")
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in every child (0: default)")
    parser.add_argument("--package-reps", type=int, default=20)
    parser.add_argument("--outbox-reps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--from-json", type=Path, help="only print the tables again from a results file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.from_json:
        return rerender(args.from_json)
    TMP.mkdir(parents=True, exist_ok=True)
    if args.child:
        spec = json.loads(args.child)
        result = run_package_child(spec) if spec.get("kind") == "package" else run_child(spec)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    command = ".venv/bin/python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    began = time.time()
    load_before = os.getloadavg()
    runs: list[dict] = []
    for repeat in range(args.repeats):
        for family in families:
            spec_family = FAMILIES[family]
            steps = args.steps or (spec_family["quick_steps"] if args.quick else spec_family["steps"])
            for config in configurations(family):
                threads = spec_family["threads"] if args.threads is None else args.threads
                spec = {**config, "family": family, "steps": steps, "warmup": args.warmup, "repeat": repeat,
                        "threads": threads}  # fmt: skip
                result = child(spec, args.timeout)
                runs.append(result)
                print(
                    f"[{time.time() - began:6.1f}s] {family} {config['id']} run {repeat + 1}/{args.repeats}:"
                    f" steady {fmt(result['steady_samples_per_s'])} samples/s, whole"
                    f" {fmt(result['whole_call_samples_per_s'])}, training memory"
                    f" {fmt(result['training_memory_mib'])} MiB (peak {fmt(result['peak_rss_mib'])})",
                    file=sys.stderr,
                    flush=True,
                )
    packages = []
    for family in families:
        threads = FAMILIES[family]["threads"] if args.threads is None else args.threads
        packages.append(child({"kind": "package", "family": family, "reps": args.package_reps,
                               "outbox_reps": args.outbox_reps, "threads": threads}, args.timeout))  # fmt: skip
    shutil.rmtree(TMP, ignore_errors=True)
    load_after = os.getloadavg()
    import torch  # only for the version line (the driver itself trains nothing)

    threads_used = ", ".join(f"{f} {sorted({r['threads'] for r in runs if r['family'] == f})}" for f in families)
    header = (
        f"Command: `{command}`  \n"
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch"
        f" {torch.__version__}; torch threads per child: {threads_used}; load average {load_before[0]:.2f} before,"
        f" {load_after[0]:.2f} after; {args.repeats} run(s) per configuration, each in a fresh process;"
        f" {time.time() - began:.0f} s in all."
    )
    write(header, command, [load_before, load_after], families, runs, packages)
    return 0


def render(header: str, families: list[str], runs: list[dict], packages: list[dict]) -> tuple[str, dict]:
    summaries = {family: summarize(runs, family) for family in families}
    parts = [header]
    for family in families:
        parts += [speed_table(family, summaries[family]), memory_table(family, summaries[family])]
    parts += [delta_tables(packages), targets(summaries, packages)]
    return "\n\n".join(parts), summaries


def write(header: str, command: str, load: list, families: list[str], runs: list[dict], packages: list[dict]) -> None:
    report, summaries = render(header, families, runs, packages)
    print(report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "edge_training.json").write_text(
        json.dumps(
            {
                "command": command,
                "header": header,
                "load_average": load,
                "runs": runs,
                "summaries": summaries,
                "packages": packages,
                "report": report,
            },
            indent=2,
            default=str,
        )
    )


def rerender(path: Path) -> int:
    """The tables again from a results file (e.g. after a change to how they are laid out or judged)."""
    data = json.loads(path.read_text())
    header = data.get("header") or data["report"].split("\n\n", 1)[0]
    if "Re-rendered" not in header:
        header += f"  \nRe-rendered from {os.path.relpath(path, ROOT)} (the measurements of the run above)."
    families = list(dict.fromkeys(r["family"] for r in data["runs"]))
    write(header, data["command"], data.get("load_average"), families, data["runs"], data["packages"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
