"""The measured methods of ``bench/aggregation.py`` that run in one process, and what every method shares:
memory and CPU figures, the deltas' envelopes, the floor, verification as the server runs it, and the saved
results each method is compared with. ``bench/aggregation_chord.py`` holds the two-process methods and
``bench/aggregation_run.py`` runs one method in a fresh process. Aggregates are saved as
``bench/results/aggregation-tmp/<size>/<method>.safetensors`` so the Flower methods (run later) can compare
against ours.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aggregation_data import RESULTS, layout, num_samples  # noqa: E402

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


def floor_pass(paths: list[str], envelopes: list[dict], order=None) -> int:
    """sha256 of each file plus one streaming numpy pass (float32 sum of every 1 MiB chunk), read into a buffer
    that starts on a page as the product's reads do (``training.registry.blobs.page_aligned``: a ``bytearray``,
    16 bytes into a page, takes the kernel's copies twice as long). ``order``: the indices of the files to read,
    taken one at a time (any iterable: the two-process floor's shared count), default all; one buffer for all of
    them. Returns how many files it read."""
    import mmap

    import numpy as np

    if len(paths) != len(envelopes):
        raise ValueError(f"{len(paths)} files and {len(envelopes)} envelopes")
    buffer = mmap.mmap(-1, CHUNK)
    view = memoryview(buffer)
    done = 0
    for index in range(len(paths)) if order is None else order:
        path, sidecar = paths[index], envelopes[index]
        digest, total = hashlib.sha256(), 0.0
        with open(path, "rb", buffering=0) as handle:
            while count := handle.readinto(buffer):
                digest.update(view[:count])
                total += float(np.frombuffer(buffer, dtype=np.float32, count=count // 4).sum())
        if digest.hexdigest() != sidecar["envelope"]["sha256"]:
            raise RuntimeError(f"{path}: the cached file does not match its envelope")
        done += 1
    return done


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
