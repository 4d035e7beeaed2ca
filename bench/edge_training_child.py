"""The edge-training benchmark's child (``bench/edge_training.py`` runs it in a fresh process per measurement):
one configuration's training run, or the delta-packaging timings, printed as a ``RESULT`` line."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from edge_training_setup import ALPHA, FAMILIES, MIB, RANK, TMP


def _data(family_name: str, family, n_train: int, n_val: int):
    import torch

    spec = FAMILIES[family_name]
    if family_name == "minilm-text":
        config = {"max_length": spec["tokens"], "n_train": n_train, "n_test": n_val}
        return {}, *family.dataset(config)
    train, test = family.dataset({})

    def tile(data, n):
        index = torch.arange(n) % len(data["y"])
        return {k: v[index].contiguous() for k, v in data.items()}

    return {}, tile(train, n_train), tile(test, n_val)


def _maxrss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB  # Linux: KiB


class _Phases:
    """Peak RSS per phase (training steps vs the agent's validation passes): the kernel's high-water mark
    (the counter ``ru_maxrss`` reports) is read at each phase change and reset by writing ``5`` to
    ``/proc/self/clear_refs``. The process's peak is the maximum over all phases (what ru_maxrss would say
    without the resets). Without a writable clear_refs, everything counts as training."""

    def __init__(self) -> None:
        self.current = "before"
        self.peaks: dict[str, float] = {}
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.enabled = True
        except OSError:
            self.enabled = False

    def note(self) -> None:
        self.peaks[self.current] = max(self.peaks.get(self.current, 0.0), _maxrss_mib())

    def switch(self, phase: str) -> None:
        self.note()
        if self.enabled:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
        self.current = phase

    def close(self) -> None:
        self.note()
        self.peaks.pop("before", None)


def _warm_libraries() -> None:
    """Import everything any configuration uses and run one tiny forward/backward/optimizer step of each kind,
    so one-time library set-up (autograd engine, oneDNN, SDPA, checkpointing, optimizers) lands before the
    "after build" RSS in every configuration alike and is not counted as anyone's training memory."""
    import peft  # noqa: F401  (imports transformers)
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    import edge_agent.training  # noqa: F401

    layers = torch.nn.Sequential(
        torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(128, 8), torch.nn.LayerNorm(8)
    )
    for optimizer in (torch.optim.AdamW, torch.optim.Adafactor):
        out = checkpoint(layers, torch.randn(2, 1, 8, 8), use_reentrant=False)
        q = out.view(2, 1, 2, 4)
        (F.scaled_dot_product_attention(q, q, q).sum() + F.cross_entropy(out, torch.tensor([0, 1]))).backward()
        optimizer(layers.parameters(), lr=1e-3).step()


def run_child(spec: dict) -> dict:
    import gc
    import tempfile

    import psutil
    import torch
    import torch.nn.functional as F

    from edge_agent.families import get_family
    from edge_agent.families.common import inputs

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    _warm_libraries()
    torch.manual_seed(0)
    family_name, steps, warmup = spec["family"], spec["steps"], spec["warmup"]
    batch = spec["micro"] * spec["accum"]
    family = get_family(family_name)
    _, train, val = _data(family_name, family, steps * batch, max(1, steps * batch // 4))
    config = {"max_length": FAMILIES[family_name]["tokens"]} if FAMILIES[family_name]["tokens"] else {}
    model = family.build(config)
    targets, saved = list(family.default_targets), list(family.default_modules_to_save)
    if spec["kind"] == "agent":
        from edge_agent.lora_layers import adapter_parameters, apply_adapter

        model = apply_adapter(model, None, rank=RANK, alpha=ALPHA, target_modules=targets, modules_to_save=saved)
        trainable = list(adapter_parameters(model).values())
    elif spec["kind"] == "peft":
        import peft

        lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets,
                               modules_to_save=saved)  # fmt: skip
        model = peft.get_peft_model(model, lora)
        trainable = [p for p in model.parameters() if p.requires_grad]
    else:
        for parameter in model.parameters():
            parameter.requires_grad_(True)
        trainable = list(model.parameters())
    gc.collect()
    rss_after_build = psutil.Process().memory_info().rss / MIB
    peak_before_training = _maxrss_mib()
    phases = _Phases()
    stamps: list[tuple[float, float]] = []  # (wall, process CPU) at the end of every optimizer step
    extra: dict = {}

    def stamp() -> None:
        stamps.append((time.perf_counter(), time.process_time()))
        phases.note()

    if spec["kind"] == "agent":
        from edge_agent.training import TrainConfig, train_adapter

        class Judged:  # the family, with its validation passes put in their own memory phase
            loss = staticmethod(family.loss)

            @staticmethod
            def evaluate(model, data):
                phases.switch("validation")
                try:
                    return family.evaluate(model, data)
                finally:
                    phases.switch("training")

        with tempfile.TemporaryDirectory(dir=TMP) as folder:
            train_config = TrainConfig(
                epochs=1, micro_batch=spec["micro"], accum_steps=spec["accum"], optimizer=spec["optimizer"],
                lr=1e-3, max_grad_norm=1.0, gradient_checkpointing=spec["checkpointing"],
                checkpoint_dir=Path(folder) / "checkpoints", progress_bar=False, seed=0,
            )  # fmt: skip

            def progress(event: dict) -> None:
                if event["event"] == "step":
                    stamp()

            phases.switch("training")
            began, began_cpu = time.perf_counter(), time.process_time()
            result = train_adapter(model, train, val, config=train_config, family=Judged(), progress=progress)
            ended, ended_cpu = time.perf_counter(), time.process_time()
        samples = result.samples_seen
        extra = {"steps": result.steps, "notes": result.notes, "discarded": result.discarded}
    else:
        if spec["checkpointing"]:
            inner = model.base_model.model if spec["kind"] == "peft" else model
            inner.gradient_checkpointing_enable()
        optimizer = (
            torch.optim.AdamW(trainable, lr=1e-3) if spec["optimizer"] == "adamw"
            else torch.optim.Adafactor(trainable, lr=1e-3)
        )  # fmt: skip
        model.train()
        micro = spec["micro"]
        phases.switch("training")
        began, began_cpu = time.perf_counter(), time.process_time()
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            for index in range(spec["accum"]):
                start = (step * spec["accum"] + index) * micro
                chunk = {k: v[start : start + micro] for k, v in train.items()}
                loss = F.cross_entropy(model(**inputs(chunk)), chunk["y"])
                (loss / spec["accum"]).backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            stamp()
        ended, ended_cpu = time.perf_counter(), time.process_time()
        samples = steps * batch
    phases.close()
    steady_steps = len(stamps) - warmup
    steady = steady_cpu = None
    if steady_steps > 0 and warmup > 0:
        steady = steady_steps * batch / (stamps[-1][0] - stamps[warmup - 1][0])
        steady_cpu = steady_steps * batch / (stamps[-1][1] - stamps[warmup - 1][1])
    peak = max(_maxrss_mib(), peak_before_training, *phases.peaks.values())
    return {
        **spec,
        "samples": samples,
        "seconds": ended - began,
        "cpu_seconds": ended_cpu - began_cpu,
        "whole_call_samples_per_s": samples / (ended - began),
        "whole_call_samples_per_cpu_s": samples / (ended_cpu - began_cpu),
        "steady_samples_per_s": steady,
        "steady_samples_per_cpu_s": steady_cpu,
        "step_stamps": [round(wall - began, 4) for wall, _ in stamps],
        "rss_after_build_mib": rss_after_build,
        "peak_before_training_mib": peak_before_training,
        "peak_rss_mib": peak,
        "training_memory_mib": peak - rss_after_build,
        "phase_peaks_mib": phases.peaks,
        "phase_memory_mib": {k: v - rss_after_build for k, v in phases.peaks.items()},
        "phases_measured": phases.enabled,
        "trainable_parameters": sum(p.numel() for p in trainable),
        "threads": torch.get_num_threads(),
        **extra,
    }


def run_package_child(spec: dict) -> dict:
    """Delta sizes and packaging / outbox timings for one family (fresh process)."""
    import hashlib
    import tempfile

    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from safetensors.torch import save as save_safetensors

    from edge_agent.families import get_family
    from edge_agent.identity import atomic_write
    from edge_agent.lora_layers import adapter_tensors, apply_adapter
    from edge_agent.packaging import Outbox, package_delta

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    family_name, reps = spec["family"], spec["reps"]
    family = get_family(family_name)
    config = {"max_length": FAMILIES[family_name]["tokens"]} if FAMILIES[family_name]["tokens"] else {}
    base = family.build(config)
    state = {k: v.detach().contiguous() for k, v in base.state_dict().items()}
    parameters = sum(v.numel() for v in state.values())
    model_f32 = len(save_safetensors(state))
    model = apply_adapter(base, None, rank=RANK, alpha=ALPHA, target_modules=list(family.default_targets),
                          modules_to_save=list(family.default_modules_to_save))  # fmt: skip
    start = adapter_tensors(model)
    generator = torch.Generator().manual_seed(0)

    def trained(seed: int) -> dict:
        generator.manual_seed(seed)
        return {k: v + 1e-3 * torch.randn(v.shape, generator=generator) for k, v in start.items()}

    new = trained(0)
    key = Ed25519PrivateKey.generate()
    common = {"key": key, "device_id": "00000000-0000-0000-0000-000000000000", "adapter": "bench",
              "base_version": 1, "num_samples": 100}  # fmt: skip

    def median_ms(call, n: int) -> float:
        times = []
        for _ in range(n):
            began = time.perf_counter()
            call()
            times.append((time.perf_counter() - began) * 1000)
        return statistics.median(times)

    out: dict = {"family": family_name, "parameters": parameters, "model_bytes": {
        "f32": model_f32, "f16": parameters * 2, "int8": parameters}}  # fmt: skip
    out["adapter_parameters"] = sum(v.numel() for v in start.values())
    out["delta_bytes"], out["package_ms"] = {}, {}
    for encoding in ("f32", "f16", "int8"):
        data, _ = package_delta(new, start, counter=0, encoding=encoding, **common)
        out["delta_bytes"][encoding] = len(data)
        package_delta(new, start, counter=0, encoding=encoding, **common)  # warm
        out["package_ms"][encoding] = median_ms(
            lambda encoding=encoding: package_delta(new, start, counter=0, encoding=encoding, **common), reps
        )
    flat = {k: new[k].float().contiguous() for k in new}
    out["floor_ms"] = median_ms(lambda: hashlib.sha256(save_safetensors(flat)).hexdigest(), reps)

    data, _ = package_delta(new, start, counter=0, encoding="f32", **common)
    with tempfile.TemporaryDirectory(dir=TMP) as folder:
        outbox = Outbox(Path(folder) / "home")
        candidates = [trained(seed) for seed in range(1, spec["outbox_reps"] + 2)]
        outbox.put_delta(candidates[0], start, encoding="f32", **common)  # warm (creates the tables' pages)
        times = []
        for tensors in candidates[1:]:
            began = time.perf_counter()
            item, created = outbox.put_delta(tensors, start, encoding="f32", **common)
            times.append((time.perf_counter() - began) * 1000)
            assert created
        out["outbox_put_ms"] = statistics.median(times)
        out["outbox_counters"] = [i.counter for i in outbox.items()]
        target = Path(folder) / "plain" / "x.delta"
        out["atomic_write_ms"] = median_ms(lambda: atomic_write(target, data), spec["outbox_reps"])
    return out
