"""Verification plus aggregation: throughput and peak memory, against a floor and against Flower.

For each size (N deltas of P float32 parameters, safetensors files on local disk, made once and cached by
``bench/aggregation_data.py``) every method runs in a fresh process (``bench/aggregation_run.py``), so
its peak RSS (VmHWM, the kernel's high-water mark) is its own, with the files in the page cache (each
method starts after one untimed read of all of them): the figures are CPU and memory, not disk. Methods:

- ``floor``: sha256 of each file plus one streaming numpy pass over it (1 MiB reads), one process;
  ``floor_2proc``: the same in 2 processes, each file to whichever is free (what the 2 cores allow).
- ``verify_fedavg``: per delta the server's verification (envelope signature, streamed sha256, header via
  ``training.registry.artifacts.read_header`` on an mmap so only the header is read, ``check_spec``, finite values
  and L2 norm via the streaming ``training.federation.strategies.base.delta_norm``; the product's
  ``training/federation/verification.py`` instead reads the whole file and ``load_safetensors`` it), then
  ``get_strategy("fedavg").aggregate``. ``verify_fedavg_product`` runs the product's own
  ``_check_contents`` on the whole file instead (Django configured with unreachable services; no query).
- ``verify_fedavg_2w``: 2 spawned processes (standing in for 2 Celery workers of the product): they verify
  the deltas, each to whichever is free (as the product verifies each upload on whichever worker drains it),
  then (once all are: the round closes when its deltas are verified) each computes the fedavg of its
  coordinate span of every delta (``span_partial``: the product's split of a mean round without DP, one span
  per worker) and stores it as a blob; the parent joins the spans (``assemble``).
  ``verify_fedavg_2w_shards``: the product's split of a mean round with DP (without the noise): the same
  verification, then each sums one shard of deltas (``shard_size`` 64, two workers: one shard each up to 2,048
  deltas) into float64 partial sums, stored as blobs and ``combine``d by the parent in shard order.
- ``median``, ``trimmed_mean`` (0.1), ``krum``, ``multi_krum``: ours, default params, no verification;
  ``krum_nnm``: Krum with nearest-neighbour mixing, what an adapter's ``krum`` runs unless told not to.
- ``flower_*``: ``flwr.server.strategy.aggregate``'s functions on the same deltas loaded as lists of numpy
  arrays (loading included in the time and shown apart), checked against ours. A Flower method whose
  estimated memory is above ``--flower-max-gb`` or whose Krum distance loop is estimated above
  ``--flower-max-seconds`` is skipped with the estimate.

Prints one Markdown table per size, a targets summary and the command line; writes
``bench/results/aggregation.json``. Throughput is bytes of delta files per second (MB = 10^6 bytes); RSS
is in MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aggregation_data import RESULTS, Size, ensure, layout, parse_size, total_bytes, warm  # noqa: E402

HERE = Path(__file__).resolve().parent
LOGS = RESULTS / "aggregation-logs"
DEFAULT_SIZES = "100x1M,1000x1M,100x10M"
QUICK_SIZES = "20x1M,50x1M"
METHODS = {
    "floor": "floor: sha256 + 1 streaming pass, 1 process",
    "floor_2proc": "floor, 2 processes",
    "verify_fedavg": "ours: verification (streaming) + fedavg, 1 worker",
    "verify_fedavg_product": "ours: verification as in training/federation/verification.py + fedavg, 1 worker",
    "verify_fedavg_2w": "ours: verification + fedavg, 2 workers (a coordinate span each, as without DP)",
    "verify_fedavg_2w_shards": "ours: verification + fedavg, 2 workers (a shard of deltas each, as with DP)",
    "median": "ours: median",
    "trimmed_mean": "ours: trimmed_mean (0.1)",
    "krum": "ours: krum",
    "krum_nnm": "ours: krum with nearest-neighbour mixing (an adapter's krum by default)",
    "multi_krum": "ours: multi_krum",
    "flower_fedavg": "Flower: aggregate (weighted mean)",
    "flower_median": "Flower: aggregate_median",
    "flower_trimmed_mean": "Flower: aggregate_trimmed_avg (0.1)",
    "flower_krum": "Flower: aggregate_krum",
    "flower_multi_krum": "Flower: aggregate_krum (multi, to_keep N - f)",
}
MiB = 1 << 20


# --- running one method -------------------------------------------------------------------------------


def flower_memory(method: str, size: Size) -> float:
    """Estimated peak bytes of a Flower method: every delta in memory, plus its own copies."""
    data = size.n * size.params * 4
    extra = {
        "flower_fedavg": data,  # [layer * num_examples for ...]: a weighted copy of every delta
        # _compute_distances: np.array([np.concatenate(p) for p in weights]), i.e. N flattened copies and
        # then their [N, P] stack (measured at 1000x1M: 12.4 GB peak for 4.2 GB of deltas)
        "flower_krum": 2 * data + size.n * size.n * 8,
        "flower_multi_krum": 2 * data + size.n * size.n * 8,
    }.get(method, 4 * size.n * max(a * b for a, b in layout(size.params).values()) * 4)  # per-layer stacks
    return 400 * MiB + data + extra


def pair_seconds(params: int) -> float:
    """Seconds of one ``np.linalg.norm(w_i - w_j)`` of ``params`` float32 (Flower's Krum inner loop)."""
    import numpy as np

    a, b = np.ones(params, np.float32), np.zeros(params, np.float32)
    np.linalg.norm(a - b)
    start = time.perf_counter()
    for _ in range(10):
        np.linalg.norm(a - b)
    return (time.perf_counter() - start) / 10


def skip_reason(method: str, size: Size, args, measured: dict) -> str | None:
    if not method.startswith("flower_"):
        return None
    need = flower_memory(method, size)
    if need > args.flower_max_gb * 1e9:
        return f"skipped: needs {need / 1e9:.1f} GB (> {args.flower_max_gb:g} GB)"
    if method in ("flower_krum", "flower_multi_krum"):
        known = measured.get(method)  # (seconds, n, params) from a smaller size of this run
        if known:
            estimate = known[0] * (size.n**2 * size.params) / (known[1] ** 2 * known[2])
            how = f"scaled from {known[1]}x{known[2]}"
        else:
            estimate = size.n**2 * pair_seconds(size.params)
            how = "N² pair distances, timed here"
        if estimate > args.flower_max_seconds:
            return f"skipped: estimated {estimate / 60:.0f} min ({how}; limit {args.flower_max_seconds / 60:.0f} min)"
    return None


def run_method(method: str, size: Size, run: int, args) -> dict:
    job = {"method": method, "size": size.label, "torch_threads": args.torch_threads}
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"{size.label}-run{run}-{method}.log"
    warm(size)
    result_waited = wait_idle(args.wait_idle)
    busy_before, children_before = machine_busy(), children_cpu()
    started = time.perf_counter()
    with open(log, "w") as handle:
        proc = subprocess.run(
            [sys.executable, str(HERE / "aggregation_run.py"), json.dumps(job)],
            stdout=subprocess.PIPE,
            stderr=handle,
            text=True,
            timeout=args.timeout,
            cwd=HERE.parent,
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = log.read_text().strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)[-400:]}", "log": str(log)}
    result = json.loads(lines[-1][len("RESULT ") :])
    wall = time.perf_counter() - started
    result["process_seconds"] = wall
    result["waited_for_idle"] = result_waited
    # CPU the rest of the machine (other users) took while this method ran, in cores: the 2-process rows
    # can only scale if the second core was free.
    result["others_cores"] = max(0.0, (machine_busy() - busy_before - (children_cpu() - children_before)) / wall)
    return result


def wait_idle(limit: float) -> float:
    """Wait (at most ``limit`` seconds) until the rest of the machine used under half a core over 1 s."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit:
        before = machine_busy()
        time.sleep(1.0)
        if machine_busy() - before < 0.5:
            break
    return time.perf_counter() - started


def machine_busy() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --- summarising --------------------------------------------------------------------------------------


def summarise(runs: list[dict], nbytes: int) -> dict:
    """Median seconds (and spread) over runs; the peak RSS of the median run's process(es)."""
    good = [r for r in runs if "seconds" in r]
    if not good:
        return runs[-1] if runs else {}
    ordered = sorted(good, key=lambda r: r["seconds"])
    middle = ordered[(len(ordered) - 1) // 2]
    seconds = statistics.median(r["seconds"] for r in good)
    peaks = [w["rss_peak"] for w in middle.get("workers", [])] or [middle["rss_peak"]]
    starts = [w["rss_start"] for w in middle.get("workers", [])] or [middle["rss_start"]]
    return {
        **middle,
        "seconds": seconds,
        "spread": [ordered[0]["seconds"], ordered[-1]["seconds"]],
        "runs": len(good),
        "mb_per_s": nbytes / seconds / 1e6,
        "peak_mib": max(peaks) / MiB,
        "above_start_mib": max(p - s for p, s in zip(peaks, starts, strict=True)) / MiB,
        "parent_peak_mib": middle["rss_peak"] / MiB if middle.get("workers") else None,
        "cores": middle.get("cpu_seconds", 0) / middle["seconds"] if middle["seconds"] else 0,
    }


def notes(method: str, row: dict) -> str:
    parts = []
    if row.get("runs", 1) > 1:
        parts.append(f"{row['runs']} runs {row['spread'][0]:.2f}–{row['spread'][1]:.2f} s")
    if "verify_seconds" in row:
        parts.append(f"verify {row['verify_seconds']:.2f} s")
    if "load_seconds" in row:
        parts.append(f"load {row['load_seconds']:.2f} s")
    if "combine_seconds" in row:
        shards = " + ".join(str(count) for count in row["deltas_per_worker"])
        took = " / ".join(
            f"{w['seconds']:.2f}"
            + (
                f" (verify {w['verify_seconds']:.2f}"
                + (f", wait {w['wait_seconds']:.2f}" if w.get("wait_seconds") else "")
                + f", sum {w['partial_seconds']:.2f}"
                + (f", store {w['store_seconds']:.2f}" if "store_seconds" in w else "")
                + ")"
                if "verify_seconds" in w
                else ""
            )
            for w in row["workers"]
        )
        parts.append(f"deltas verified per worker {shards} took {took} s, combine {row['combine_seconds']:.2f} s")
    if method == "floor_2proc":
        parts.append("workers took " + " / ".join(f"{w['seconds']:.2f}" for w in row["workers"]) + " s")
    if row.get("parent_peak_mib") and method != "floor_2proc":
        parts.append(f"combining process {row['parent_peak_mib']:.0f} MiB")
    if row.get("check"):
        parts.append(row["check"])
    return "; ".join(parts)


def table(size: Size, rows: dict[str, dict], nbytes: int) -> list[str]:
    floor = rows.get("floor", {}).get("mb_per_s")
    runs = max((r.get("runs", 1) for r in rows.values()), default=1)
    out = [
        f"### {size.label}: {size.n} deltas x {size.params:,} float32 parameters, {nbytes / 1e6:,.0f} MB of files"
        + (f" (median of {runs} runs)" if runs > 1 else ""),
        "",
        "| method | seconds | MB/s | × floor | peak RSS MiB | above start MiB | cores | others' cores "
        "| check / notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for method, row in rows.items():
        name = METHODS[method]
        if "seconds" not in row:
            out.append(f"| {name} | – | – | – | – | – | – | – | {row.get('skipped') or row.get('error', '?')} |")
            continue
        ratio = f"{row['mb_per_s'] / floor:.2f}" if floor else "–"
        out.append(
            f"| {name} | {row['seconds']:.2f} | {row['mb_per_s']:,.0f} | {ratio} | {row['peak_mib']:,.0f} "
            f"| {row['above_start_mib']:,.0f} | {row['cores']:.2f} | {row.get('others_cores', 0):.2f} "
            f"| {notes(method, row)} |"
        )
    out += ["", *footer(size, rows)]
    return out


def _speed(rows, method):
    row = rows.get(method) or {}
    return row.get("mb_per_s")


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**not met**")


def footer(size: Size, rows: dict[str, dict]) -> list[str]:
    lines = ["Targets for this size:"]
    floor, one, two = _speed(rows, "floor"), _speed(rows, "verify_fedavg"), _speed(rows, "verify_fedavg_2w")
    if floor and one:
        ratio = one / floor
        lines.append(
            f"- fedavg with verification >= 70% of the floor per worker: {ratio:.0%} → {verdict(ratio >= 0.7)}"
        )
    if one and two:
        by_shards = _speed(rows, "verify_fedavg_2w_shards")
        floor2 = _speed(rows, "floor_2proc")
        said = [f"by shards of deltas, as with DP: {by_shards / one:.2f}x"] if by_shards else []
        if floor2 and floor:
            said.append(f"the floor itself gets {floor2 / floor:.2f}x from 2 processes")
        extra = f" ({'; '.join(said)})" if said else ""
        lines.append(f"- ~2x with two workers: {two / one:.2f}x{extra} → {verdict(two / one >= 1.8)}")
    for ours in ("median", "trimmed_mean"):
        mine, theirs = _speed(rows, ours), _speed(rows, f"flower_{ours}")
        if mine and theirs:
            lines.append(f"- {ours} >= 3x Flower's speed: {mine / theirs:.2f}x → {verdict(mine / theirs >= 3)}")
        elif mine:
            lines.append(
                f"- {ours} >= 3x Flower's speed: Flower {rows.get(f'flower_{ours}', {}).get('skipped', 'not run')}"
            )
    for name in ("krum", "krum_nnm"):
        krum = rows.get(name) or {}
        if size.n == 1000 and size.params == 1 << 20 and "seconds" in krum:
            lines.append(
                f"- {name} at N=1000 of 1M in under a minute: {krum['seconds']:.1f} s → {verdict(krum['seconds'] < 60)}"
            )
    lines.append("- memory flat in N: see the summary after the tables")
    return lines


def memory_summary(results: dict) -> list[str]:
    """Peak RSS above the process's start, per method, across sizes of the same P (flat: <= +10%)."""
    by_params: dict[int, list[tuple[int, str]]] = {}
    for label, entry in results.items():
        by_params.setdefault(entry["params"], []).append((entry["n"], label))
    out = []
    for params, members in sorted(by_params.items()):
        members.sort()
        if len(members) < 2:
            continue
        labels = [label for _, label in members]
        out += [
            f"### Peak memory vs N at {params:,} parameters (MiB above the process's start; flat = at most +10% "
            f"from N={members[0][0]} to N={members[-1][0]})",
            "",
            "| method | " + " | ".join(labels) + " | flat? |",
            "|---|" + "---:|" * len(labels) + "---|",
        ]
        for method in METHODS:
            values = [results[label]["methods"].get(method, {}).get("above_start_mib") for label in labels]
            if values[0] is None or values[-1] is None:
                continue
            flat = values[-1] <= values[0] * 1.10 + 8
            cells = " | ".join("–" if v is None else f"{v:,.0f}" for v in values)
            out.append(f"| {METHODS[method]} | {cells} | {verdict(flat)} |")
        out.append("")
    return out


def machine() -> dict:
    info = {"python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as handle:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
        info["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1)
    except (OSError, StopIteration, ValueError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    for package in ("torch", "numpy", "safetensors", "flwr"):
        try:
            info[package] = version(package)
        except PackageNotFoundError:
            info[package] = None
    return info


# --- main ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=None, help=f"comma-separated NxP (default {DEFAULT_SIZES})")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: --sizes {QUICK_SIZES}")
    parser.add_argument("--repeat", action="append", default=[], metavar="SIZE=K", help="run SIZE K times (median)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of: " + ", ".join(METHODS))
    parser.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads in our methods")
    parser.add_argument("--flower-max-gb", type=float, default=16.0)
    parser.add_argument("--flower-max-seconds", type=float, default=600.0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per method")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each method, wait up to this long for other users' CPU to drop under half a core",
    )
    parser.add_argument("--json", default=str(RESULTS / "aggregation.json"))
    args = parser.parse_args()
    sizes = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)).split(",")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}")
    repeats = {}
    for item in args.repeat:
        label, _, count = item.partition("=")
        repeats[parse_size(label).label] = int(count or 1)
    command = shlex.join([os.path.relpath(sys.executable), os.path.relpath(__file__), *sys.argv[1:]])

    for size in sizes:
        started = time.perf_counter()
        made = ensure(size, log=lambda *a, **k: print(*a, **k))
        if made:
            print(f"made {made} delta files for {size.label} in {time.perf_counter() - started:.0f} s", file=sys.stderr)

    results: dict = {}
    measured: dict = {}  # Flower Krum timings, to estimate larger sizes
    for size in sizes:
        nbytes = total_bytes(size)
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for run in range(repeats.get(size.label, 1)):
            for method in methods:
                reason = skip_reason(method, size, args, measured)
                if reason:
                    runs[method].append({"skipped": reason})
                    print(f"[{size.label} run {run + 1}] {method}: {reason}", file=sys.stderr)
                    continue
                result = run_method(method, size, run + 1, args)
                runs[method].append(result)
                if method in ("flower_krum", "flower_multi_krum") and "seconds" in result:
                    distances = result["seconds"] - result.get("load_seconds", 0)
                    measured[method] = (distances, size.n, size.params)
                shown = f"{result['seconds']:.2f} s" if "seconds" in result else result.get("error")
                print(f"[{size.label} run {run + 1}] {method}: {shown}", file=sys.stderr, flush=True)
        rows = {m: summarise(r, nbytes) for m, r in runs.items()}
        results[size.label] = {"n": size.n, "params": size.params, "bytes": nbytes, "methods": rows, "runs": runs}
        print("\n".join(table(size, rows, nbytes)) + "\n", flush=True)

    summary = memory_summary(results)
    if summary:
        print("\n".join(summary))
    print("Files in the page cache (each method starts after an untimed read of them): CPU and memory, not disk.")
    print("Ours and the floor run the product's code as it is (torch's default threads unless --torch-threads).")
    compiled = {r.get("compiled_loops") for size in results.values() for rs in size["runs"].values() for r in rs}
    compiled.discard(None)
    if compiled:
        built = {frozenset({True}): "yes", frozenset({False}): "no: numpy and torch instead"}.get(
            frozenset(compiled), "in some runs only"
        )
        print(f"Ours ran the compiled loops (training/federation/strategies/sum_kernel.c): {built}.")
    print(f"\ncommand: {command}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {"command": command, "machine": machine(), "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sizes": results},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
