"""The measured methods of ``bench/aggregation.py``, each run in a fresh process of its own.

``python bench/aggregation_methods.py '<job json>'`` imports what the method needs, reads the deltas'
envelopes (the product has them in its database), records the RSS after the imports, runs the method once,
timed, and prints ``RESULT <json>`` as its last line: seconds, CPU seconds, RSS after imports and peak
RSS (VmHWM; for the two-process methods, per process), plus a check of the numbers where there is
one. Aggregates are saved as ``bench/results/aggregation-tmp/<size>/<method>.safetensors`` so the Flower
methods (run later) can compare against ours.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aggregation_data import RESULTS, layout, num_samples, parse_size  # noqa: E402

CHUNK = 1 << 20  # what training.registry.blobs streams with
TMP = RESULTS / "aggregation-tmp"


def rss_now() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    """Peak RSS of this process (VmHWM). Not ``ru_maxrss``: after fork + exec that also holds the RSS the
    parent had at the fork (Linux keeps the larger of the two), which would hide a small child's peak."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def sidecars(size) -> list[dict]:
    return [json.loads(path.read_text()) for path in size.sidecars()]


# --- the floor ----------------------------------------------------------------------------------------


def floor_pass(paths: list[str], envelopes: list[dict]) -> None:
    """sha256 of each file plus one streaming numpy pass (float32 sum of every 1 MiB chunk), read into a buffer
    that starts on a page as the product's reads do (``training.registry.blobs.page_aligned``: a ``bytearray``,
    16 bytes into a page, takes the kernel's copies twice as long)."""
    import mmap

    import numpy as np

    buffer = mmap.mmap(-1, CHUNK)
    view = memoryview(buffer)
    for path, sidecar in zip(paths, envelopes, strict=True):
        digest, total = hashlib.sha256(), 0.0
        with open(path, "rb", buffering=0) as handle:
            while count := handle.readinto(buffer):
                digest.update(view[:count])
                total += float(np.frombuffer(buffer, dtype=np.float32, count=count // 4).sum())
        if digest.hexdigest() != sidecar["envelope"]["sha256"]:
            raise RuntimeError(f"{path}: the cached file does not match its envelope")


# --- verification -------------------------------------------------------------------------------------


def check_envelope(sidecar: dict) -> dict:
    from edge_agent.delta import parse_envelope
    from edge_agent.protocol import public_key_from_b64, verify

    envelope = parse_envelope(sidecar["envelope"])
    if not verify(public_key_from_b64(sidecar["public_key"]), envelope, sidecar["signature"]):
        raise RuntimeError("bad signature")
    return envelope


def streaming_sha256(path: str) -> tuple[str, int]:
    """As ``training.registry.blobs.blob_put_file`` hashes an upload: 1 MiB reads."""
    digest, size = hashlib.sha256(), 0
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
            size += count
    return digest.hexdigest(), size


def verify_streaming(index: int, path: str, sidecar: dict, spec: dict, max_norm: float) -> float:
    """The server's checks as verification runs them: the envelope's signature, then the product's
    ``training.federation.delta_contents.contents_check`` (one streaming pass: sha256 and size, header, spec,
    finite values, the norm), then the norm bound. Returns the norm."""
    from types import SimpleNamespace

    norm = verify_product(path, sidecar, SimpleNamespace(tensor_spec=spec, aggregation={}, dp={}))
    if norm > max_norm:
        raise RuntimeError(f"{path}: norm_too_large")
    return norm


def verify_product(path: str, sidecar: dict, adapter) -> float:
    """What ``training.federation.verification`` does for the contents: ``contents_check``, one streaming pass
    over the file (sha256 and size, header, spec, the library's header check, finite values, norm)."""
    from training.federation.delta_contents import contents_check

    envelope = check_envelope(sidecar)
    with open(path, "rb") as handle:
        _, norm = contents_check(handle, size=envelope["size"], sha256=envelope["sha256"], adapter=adapter, path=path)
    return norm


def django_for_product() -> None:
    """``training.federation.verification`` imports Django models: configure Django with unreachable services (no
    connection is made; ``contents_check`` touches no database)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleet.settings")
    os.environ.setdefault("DATABASE_URL", "postgresql://bench@127.0.0.1:9/unused")
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:9/0")
    os.environ.setdefault("FLEET_DATA_DIR", str(TMP / "fleet-data"))
    import django

    django.setup()


# --- ours ---------------------------------------------------------------------------------------------


def spec_of(size) -> dict:
    return {name: {"shape": shape} for name, shape in layout(size.params).items()}


def save_result(label: str, method: str, tensors: dict) -> str:
    from safetensors.torch import save_file

    folder = TMP / label
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{method}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return str(path)


def load_result(label: str, method: str):
    from safetensors.numpy import load_file

    path = TMP / label / f"{method}.safetensors"
    return load_file(str(path)) if path.exists() else None


def compare(ours: dict | None, theirs: dict, *, exact: bool = False, against: str = "") -> dict:
    """Max abs difference over every key, relative to the largest |value|; ok within 1e-4 relative."""
    import numpy as np

    if ours is None:
        return {"check": f"no {against} result to compare", "ok": None}
    worst, peak = 0.0, 0.0
    for key, value in ours.items():
        other = np.asarray(theirs[key], dtype=np.float32).reshape(value.shape)
        worst = max(worst, float(np.max(np.abs(value.astype(np.float64) - other.astype(np.float64)))))
        peak = max(peak, float(np.max(np.abs(value))))
    rel = worst / peak if peak else worst
    ok = worst == 0.0 if exact else rel <= 1e-4
    text = "identical" if worst == 0.0 else f"max|Δ| {worst:.1e} (rel {rel:.1e})"
    return {"check": f"{text} vs {against}: {'ok' if ok else 'MISMATCH'}", "ok": ok, "max_abs_diff": worst}


def method_verify_fedavg(job, size, envelopes, *, product: bool = False) -> dict:
    from training.federation.aggregation_settings import AGGREGATION_DEFAULTS
    from training.federation.strategies import DeltaInput, get_strategy

    spec = spec_of(size)
    paths = [str(p) for p in size.paths()]
    if product:
        from types import SimpleNamespace

        adapter = SimpleNamespace(tensor_spec=spec, aggregation={}, dp={})
    start, cpu = time.perf_counter(), cpu_seconds()
    norms = []
    for index, (path, sidecar) in enumerate(zip(paths, envelopes, strict=True)):
        if product:
            norms.append(verify_product(path, sidecar, adapter))
        else:
            norms.append(verify_streaming(index, path, sidecar, spec, AGGREGATION_DEFAULTS["max_norm"]))
    verified = time.perf_counter()
    inputs = [
        DeltaInput(path, num_samples(i), 0, norm) for i, (path, norm) in enumerate(zip(paths, norms, strict=True))
    ]
    result = get_strategy("fedavg").aggregate(inputs, spec=spec, base=None, params={})
    seconds = time.perf_counter() - start
    out = {"seconds": seconds, "cpu_seconds": cpu_seconds() - cpu, "verify_seconds": verified - start}
    name = "verify_fedavg_product" if product else "verify_fedavg"
    save_result(size.label, name, result)
    if product:
        reference = load_result(size.label, "verify_fedavg")
        if reference is not None:
            out.update(compare(reference, {k: v.numpy() for k, v in result.items()}, exact=True, against="streaming"))
        out["norms"] = norms[:3]
    else:
        out["norms"] = norms[:3]
    return out


def method_robust(job, size, envelopes, name: str) -> dict:
    from training.federation.strategies import DeltaInput, get_strategy

    spec = spec_of(size)
    inputs = [DeltaInput(str(path), num_samples(i)) for i, path in enumerate(size.paths())]
    params = {"trim_ratio": 0.1} if name == "trimmed_mean" else {"mixing": "nnm"} if name == "krum_nnm" else {}
    start, cpu = time.perf_counter(), cpu_seconds()
    result = get_strategy(name.removesuffix("_nnm")).aggregate(inputs, spec=spec, base=None, params=params)
    out = {"seconds": time.perf_counter() - start, "cpu_seconds": cpu_seconds() - cpu}
    save_result(size.label, name, result)
    return out


# --- two processes (two Celery workers) ---------------------------------------------------------------


def partials_root(size) -> Path:
    """Where the stand-in workers store their partials (the product's blob folder for them). Emptied before each
    run: the product stores a round's partials as new blobs, never over an earlier run's file."""
    return TMP / size.label / "partials"


def _worker(job: dict, part, ready, go, results, closed, stopped) -> None:
    """One stand-in Celery worker: imports, says ready, waits for the start, does its part, reports. ``part``:
    the floor's files; the shards it verifies and sums (``verify_fedavg_2w_shards``); or the deltas it verifies
    and its coordinate span (``verify_fedavg_2w``), summed once every delta is verified (``closed``, a barrier:
    the round closes when its deltas are verified)."""
    size = parse_size(job["size"])
    envelopes = sidecars(size)
    if job["method"].startswith("floor"):
        import numpy  # noqa: F401
    else:
        import torch

        if job.get("torch_threads"):
            torch.set_num_threads(job["torch_threads"])
        from training.federation.strategies import get_strategy  # noqa: F401

        os.environ["BLOB_ROOT"] = str(partials_root(size))  # emptied by method_two before the workers start
        django_for_product()  # before the start: verification imports the models
        import training.federation.verification  # noqa: F401
    base = rss_now()
    ready.put(os.getpid())
    go.wait()
    start, cpu = time.perf_counter(), cpu_seconds()
    out = {"partials": []}
    paths = [str(p) for p in size.paths()]
    if job["method"].startswith("floor"):
        floor_pass([paths[i] for i in part], [envelopes[i] for i in part])
    else:
        from training.federation.aggregation_settings import AGGREGATION_DEFAULTS
        from training.federation.strategies import DeltaInput, get_strategy

        # In the function, as every product import here: the training package needs Django set up first
        # (django_for_product above); loaded already, by verification's import, so nothing is timed.
        from training.registry.blobs import blob_path, blob_put_tensors

        spec = spec_of(size)
        strategy = get_strategy("fedavg")
        out["verify_seconds"] = out["partial_seconds"] = out["store_seconds"] = out["wait_seconds"] = 0.0
        norms = {}

        def verify(members) -> None:
            verifying = time.perf_counter()
            for i in members:
                norms[i] = verify_streaming(i, paths[i], envelopes[i], spec, AGGREGATION_DEFAULTS["max_norm"])
            out["verify_seconds"] += time.perf_counter() - verifying

        def store(tensors) -> str:
            storing = time.perf_counter()
            blob = blob_put_tensors(tensors)  # as the product's tasks: a new blob, named by its hash
            out["store_seconds"] += time.perf_counter() - storing
            return str(blob_path(blob.sha256))

        if job["method"] == "verify_fedavg_2w":  # as training.federation.aggregation.span_values
            members, span = part
            verify(members)
            waiting = time.perf_counter()
            closed.wait()
            out["wait_seconds"] = time.perf_counter() - waiting
            summing = time.perf_counter()
            # every delta's norm is the server's (verification stored it); with no clip_norm none is read
            inputs = [DeltaInput(paths[i], num_samples(i), 0, norms.get(i)) for i in range(size.n)]
            values = strategy.span_partial(inputs, spec=spec, params=job["params"], span=span)
            out["partial_seconds"] = time.perf_counter() - summing
            out["partials"].append((span[0], store({"part": values}), None))
        else:  # as training.federation.aggregation.shard_partial (the mean family with DP)
            for shard_index, members in part:
                verify(members)
                summing = time.perf_counter()
                inputs = [DeltaInput(paths[i], num_samples(i), 0, norms[i]) for i in members]
                sums, weight = strategy.partial(inputs, spec=spec, base=None, params=job["params"])
                out["partial_seconds"] += time.perf_counter() - summing
                out["partials"].append((shard_index, store(sums), weight))
    out.update(
        seconds=time.perf_counter() - start,
        cpu_seconds=cpu_seconds() - cpu,
        rss_start=base,
        rss_peak=rss_peak(),
        count=len(part),
    )
    results.put(out)
    stopped.wait()  # until the clock has stopped, as a Celery worker stays up: its exit is no part of the chord


# What each stand-in worker reports: its wall and CPU time, memory, shards, and (ours) its verification and sum.
WORKER_FIGURES = (
    "seconds",
    "cpu_seconds",
    "rss_start",
    "rss_peak",
    "count",
    "verify_seconds",
    "wait_seconds",
    "partial_seconds",
    "store_seconds",
)


def method_two(job, size, envelopes) -> dict:
    """Two spawned processes each take half the work, as two Celery workers of the product's chord: the floor,
    half the files; ``verify_fedavg_2w`` (the mean family without DP), the verification of half the deltas,
    then, once all are verified, the fedavg of half the coordinates of every delta, the spans' values joined by
    this process (``assemble``, reading each part as ``training.federation.aggregation._part`` does);
    ``verify_fedavg_2w_shards`` (the mean family with DP, without the noise), the verification and ``partial``
    of one shard of deltas each, ``combine``d here in shard order, each partial mapped as
    ``training.federation.aggregation.partial_sums`` does. Timed from the start signal (both workers already
    imported, like running Celery workers) to the combined result."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    n = size.n
    if job["method"] == "floor_2proc":
        parts = [list(range(0, n // 2)), list(range(n // 2, n))]
    else:
        # In the function, as every product import here (the floor's processes never load torch or the product);
        # before the clock, with the chord callback's imports: a running Celery worker has them loaded.
        from safetensors import safe_open

        from training.federation.strategies import DeltaInput, get_strategy, shards

        job = {**job, "params": {}}  # the defaults: shard_size 64, two workers
        halves = [list(range(0, n // 2)), list(range(n // 2, n))]
        if job["method"] == "verify_fedavg_2w":
            spans = get_strategy("fedavg").spans(None, spec=spec_of(size), params=job["params"])
            parts = list(zip(halves, spans, strict=True))
        else:
            layout_ = list(enumerate(shards(list(range(n)), 64, 2)))
            half = math.ceil(len(layout_) / 2)
            parts = [layout_[:half], layout_[half:]]
    shutil.rmtree(partials_root(size), ignore_errors=True)
    ready, results, go, stopped = context.Queue(), context.Queue(), context.Event(), context.Event()
    closed = context.Barrier(len(parts))
    # daemons: should this process fail before ``stopped``, its exit ends them rather than waiting for them
    args = [(job, part, ready, go, results, closed, stopped) for part in parts]
    workers = [context.Process(target=_worker, args=a, daemon=True) for a in args]
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.get(timeout=300)
    start, cpu = time.perf_counter(), cpu_seconds()
    go.set()
    outs = [results.get(timeout=3600) for _ in workers]
    out: dict = {}
    result = None
    if job["method"] != "floor_2proc":
        combined_start = time.perf_counter()
        partials = sorted(p for o in outs for p in o["partials"])
        strategy = get_strategy("fedavg")
        if job["method"] == "verify_fedavg_2w":
            first = str(size.paths()[0])  # the coordinate order is the first delta's

            def part(path: str):  # as _part: the file mapped
                with safe_open(path, framework="pt") as handle:
                    return handle.get_tensor("part")

            values = (part(path) for _, path, _ in partials)
            inputs = [DeltaInput(first, 1)]
            result = strategy.assemble(values, spec=spec_of(size), inputs=inputs)
        else:

            def mapped(path: str) -> dict:  # as partial_sums: the file mapped
                with safe_open(path, framework="pt") as handle:
                    return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118

            loaded = ((mapped(path), float(weight)) for _, path, weight in partials)
            result = strategy.combine(loaded, spec=spec_of(size), base=None, params=job["params"])
        out["combine_seconds"] = time.perf_counter() - combined_start
    # the clock stops at the combined result (saving it and comparing it with 1 worker's are the bench's)
    out.update(
        seconds=time.perf_counter() - start, cpu_seconds=cpu_seconds() - cpu + sum(o["cpu_seconds"] for o in outs)
    )
    stopped.set()
    if result is not None:
        save_result(size.label, job["method"], result)
        reference = load_result(size.label, "verify_fedavg")
        if reference is not None:
            exact = job["method"] == "verify_fedavg_2w"  # shards add in another order than one pass
            out.update(compare(reference, {k: v.numpy() for k, v in result.items()}, exact=exact, against="1 worker"))
        by_span = job["method"] == "verify_fedavg_2w"
        out["deltas_per_worker"] = [len(part[0]) if by_span else sum(len(m) for _, m in part) for part in parts]
    out["workers"] = [{k: o[k] for k in WORKER_FIGURES if k in o} for o in outs]
    for worker in workers:  # after the clock (``stopped``)
        worker.join()
    return out


# --- Flower -------------------------------------------------------------------------------------------


FLOWER_COUNTERPART = {
    "flower_fedavg": "verify_fedavg",
    "flower_median": "median",
    "flower_trimmed_mean": "trimmed_mean",
    "flower_krum": "krum",
    "flower_multi_krum": "multi_krum",
}


def method_flower(job, size, envelopes) -> dict:
    """Flower's functions on the same deltas, loaded (all at once, as they need) as lists of numpy
    arrays in the spec's order. Loading is timed and included; the aggregate is compared with ours."""
    from flwr.server.strategy import aggregate as fl
    from safetensors.numpy import load_file

    from training.federation.strategies.robust import byzantine_count

    name = job["method"]
    keys = list(layout(size.params))
    start, cpu = time.perf_counter(), cpu_seconds()
    results = []
    for i, path in enumerate(size.paths()):
        tensors = load_file(str(path))
        results.append(([tensors[key] for key in keys], num_samples(i)))
        del tensors
    loaded = time.perf_counter()
    f = byzantine_count(None, size.n)  # the f ours uses by default: floor((N - 3) / 2)
    if name == "flower_fedavg":
        agg = fl.aggregate(results)
    elif name == "flower_median":
        agg = fl.aggregate_median(results)
    elif name == "flower_trimmed_mean":
        agg = fl.aggregate_trimmed_avg(results, 0.1)  # int(0.1 * N) cut from each end, as ours
    elif name == "flower_krum":
        agg = fl.aggregate_krum(results, f, 0)
    elif name == "flower_multi_krum":
        agg = fl.aggregate_krum(results, f, size.n - f)  # ours: multi_k = N - f, sample-weighted
    else:
        raise ValueError(name)
    seconds = time.perf_counter() - start
    out = {"seconds": seconds, "cpu_seconds": cpu_seconds() - cpu, "load_seconds": loaded - start, "byzantine": f}
    counterpart = FLOWER_COUNTERPART[name]
    out.update(
        compare(
            load_result(size.label, counterpart),
            dict(zip(keys, agg, strict=True)),
            exact=name == "flower_krum",
            against=f"ours ({counterpart})",
        )
    )
    return out


# --- entry --------------------------------------------------------------------------------------------


def main() -> None:
    job = json.loads(sys.argv[1])
    method = job["method"]
    size = parse_size(job["size"])
    envelopes = sidecars(size)
    if method.startswith("flower"):
        import numpy  # noqa: F401
        from flwr.server.strategy import aggregate  # noqa: F401
    elif method.startswith("floor"):
        import numpy  # noqa: F401
    else:
        import torch

        if job.get("torch_threads"):
            torch.set_num_threads(job["torch_threads"])
        from training.federation.strategies import get_strategy  # noqa: F401

        if method.startswith("verify_fedavg"):
            django_for_product()
            import training.federation.verification  # noqa: F401
    base = rss_now()
    if method == "floor":
        start, cpu = time.perf_counter(), cpu_seconds()
        floor_pass([str(p) for p in size.paths()], envelopes)
        out = {"seconds": time.perf_counter() - start, "cpu_seconds": cpu_seconds() - cpu}
    elif method in ("floor_2proc", "verify_fedavg_2w", "verify_fedavg_2w_shards"):
        out = method_two(job, size, envelopes)
    elif method in ("verify_fedavg", "verify_fedavg_product"):
        out = method_verify_fedavg(job, size, envelopes, product=method == "verify_fedavg_product")
    elif method in ("median", "trimmed_mean", "krum", "krum_nnm", "multi_krum"):
        out = method_robust(job, size, envelopes, method)
    elif method.startswith("flower_"):
        out = method_flower(job, size, envelopes)
    else:
        raise SystemExit(f"unknown method {method}")
    if "torch" in sys.modules:
        out["torch_threads"] = sys.modules["torch"].get_num_threads()
    out.update(rss_start=base, rss_peak=rss_peak())
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
