"""The two-process methods of ``bench/aggregation.py``: two spawned processes stand in for two Celery workers of
the product's chord (``floor_2proc``, ``verify_fedavg_2w``, ``verify_fedavg_2w_shards``; bench/README.md,
"aggregation.py"). Run by ``bench/aggregation_run.py``; the shared helpers are ``bench/aggregation_methods.py``'s.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

from aggregation_data import num_samples, parse_size
from aggregation_methods import (
    TMP,
    compare,
    cpu_seconds,
    django_for_product,
    floor_pass,
    load_result,
    rss_now,
    rss_peak,
    save_result,
    sidecars,
    spec_of,
    verify_streaming,
)


def partials_root(size) -> Path:
    """Where the stand-in workers store their partials (the product's blob folder for them). Emptied before each
    run: the product stores a round's partials as new blobs, never over an earlier run's file."""
    return TMP / size.label / "partials"


def _free_indices(taken, total: int):
    """The indices of ``total`` files or deltas nobody has taken yet, one at a time (``taken``: a count shared by
    the workers), until none are left: each goes to whichever worker is free, as the product verifies each upload
    on whichever worker drains it (training.federation.verify_queue), so a worker slowed by something else on the
    host takes fewer (halves fixed in advance left the other waiting up to 0.6 s at 300 x 10M; batches of 16, the
    drain's query, left 52 + 48 of 100 deltas, a tenth of the two-worker time at 100 x 1M)."""
    while True:
        with taken.get_lock():
            index = taken.value
            taken.value = min(total, index + 1)
        if index >= total:
            return
        yield index


def _worker(job: dict, part, ready, go, results, closed, stopped, taken) -> None:
    """One stand-in Celery worker: imports, says ready, waits for the start, does its part, reports. The files
    (the floor) or the deltas to verify are taken one at a time from the count all workers share (``_free_indices``);
    ``part``: then nothing (the floor), its coordinate span (``verify_fedavg_2w``), or the shards of deltas it
    sums (``verify_fedavg_2w_shards``), once every delta is verified (``closed``, a barrier: the round closes when
    its deltas are verified)."""
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
    done = 0
    if job["method"].startswith("floor"):
        done = floor_pass(paths, envelopes, _free_indices(taken, size.n))  # one buffer for every file it takes
    else:
        from training.federation.aggregation_settings import AGGREGATION_DEFAULTS
        from training.federation.strategies import DeltaInput, get_strategy

        # In the function, as every product import here: the training package needs Django set up first
        # (django_for_product above); loaded already, by verification's import, so nothing is timed.
        from training.registry.blobs import blob_path, blob_put_tensors

        spec = spec_of(size)
        strategy = get_strategy("fedavg")
        out["store_seconds"] = 0.0

        def store(tensors) -> str:
            storing = time.perf_counter()
            blob = blob_put_tensors(tensors)  # as the product's tasks: a new blob, named by its hash
            out["store_seconds"] += time.perf_counter() - storing
            return str(blob_path(blob.sha256))

        verifying = time.perf_counter()
        for i in _free_indices(taken, size.n):
            verify_streaming(i, paths[i], envelopes[i], spec, AGGREGATION_DEFAULTS["max_norm"])
            done += 1
        out["verify_seconds"] = time.perf_counter() - verifying
        waiting = time.perf_counter()
        closed.wait()
        out["wait_seconds"] = time.perf_counter() - waiting
        summing = time.perf_counter()
        # Without clip_norm (and without DP) no norm is read: the server's, stored by verification, goes unused.
        if job["method"] == "verify_fedavg_2w":  # as training.federation.aggregation.span_values
            inputs = [DeltaInput(paths[i], num_samples(i), 0) for i in range(size.n)]
            values = strategy.span_partial(inputs, spec=spec, params=job["params"], span=part)
            out["partials"].append((part[0], store({"part": values}), None))
        else:  # as training.federation.aggregation.shard_partial (the mean family with DP)
            for shard_index, members in part:
                inputs = [DeltaInput(paths[i], num_samples(i), 0) for i in members]
                sums, weight = strategy.partial(inputs, spec=spec, base=None, params=job["params"])
                out["partials"].append((shard_index, store(sums), weight))
        out["partial_seconds"] = time.perf_counter() - summing - out["store_seconds"]
    out.update(
        seconds=time.perf_counter() - start,
        cpu_seconds=cpu_seconds() - cpu,
        rss_start=base,
        rss_peak=rss_peak(),
        count=done,
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
    """Two spawned processes share the work, as two Celery workers of the product: the floor, the files, each
    to whichever is free (``_free_indices``); ``verify_fedavg_2w`` (the mean family without DP), the
    verification of the deltas, taken the same way, then, once all are verified, the fedavg of half the
    coordinates of every delta each (the chord's spans), the spans' values joined by this process
    (``assemble``, each part read as ``training.federation.aggregation._part`` does); ``verify_fedavg_2w_shards``
    (the mean family with DP, without the noise), the verification the same way, then the ``partial`` of half
    the shards of deltas each, ``combine``d here in shard order, each partial mapped as
    ``training.federation.aggregation.partial_sums`` does. Timed from the start signal (both workers already
    imported, like running Celery workers) to the combined result."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    n = size.n
    if job["method"] == "floor_2proc":
        parts = [None, None]
    else:
        # In the function, as every product import here (the floor's processes never load torch or the product);
        # before the clock, with the chord callback's imports: a running Celery worker has them loaded.
        from safetensors import safe_open

        from training.federation.strategies import DeltaInput, get_strategy, shards

        job = {**job, "params": {}}  # the defaults: shard_size 64, two workers
        if job["method"] == "verify_fedavg_2w":
            parts = get_strategy("fedavg").spans(None, spec=spec_of(size), params=job["params"])
        else:
            layout_ = list(enumerate(shards(list(range(n)), 64, 2)))
            half = math.ceil(len(layout_) / 2)
            parts = [layout_[:half], layout_[half:]]
    shutil.rmtree(partials_root(size), ignore_errors=True)
    ready, results, go, stopped = context.Queue(), context.Queue(), context.Event(), context.Event()
    closed, taken = context.Barrier(len(parts)), context.Value("i", 0)
    # daemons: should this process fail before ``stopped``, its exit ends them rather than waiting for them
    args = [(job, part, ready, go, results, closed, stopped, taken) for part in parts]
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
    out["deltas_per_worker"] = [o["count"] for o in outs]
    out["workers"] = [{k: o[k] for k in WORKER_FIGURES if k in o} for o in outs]
    for worker in workers:  # after the clock (``stopped``)
        worker.join()
    return out
