"""Run one method of ``bench/aggregation.py`` in this fresh process: ``python bench/aggregation_run.py '<job
json>'`` imports what the method needs, reads the deltas' envelopes (the product has them in its database),
records the RSS after the imports, runs the method once, timed, and prints ``RESULT <json>`` as its last line:
seconds, CPU seconds, RSS after imports and peak RSS (VmHWM; for the two-process methods, per process), plus a
check of the numbers where there is one. The methods are in ``bench/aggregation_methods.py`` (one process) and
``bench/aggregation_chord.py`` (two).
"""

from __future__ import annotations

import json
import sys
import time

from aggregation_chord import method_two
from aggregation_data import parse_size
from aggregation_methods import (
    cpu_seconds,
    django_for_product,
    floor_pass,
    method_flower,
    method_robust,
    method_verify_fedavg,
    rss_now,
    rss_peak,
    sidecars,
)


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
    if (kernels := sys.modules.get("training.federation.strategies.kernels")) is not None:
        out["compiled_loops"] = kernels.sum_kernel is not None
    out.update(rss_start=base, rss_peak=rss_peak())
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
