"""Benchmark of the run command, `make run`: cold (no .venv, no .data), then warm (both present, median of --runs).

Baselines measured in the same invocation: services only (`.venv/bin/python -m fleet.launcher exec -- true` in the
warm checkout, start + stop) and `pip install torch==2.13.0` alone into a fresh venv (its share of the cold install).
The checkout is --checkout or a fresh `git clone` of this repository into a temporary folder (removed at the end).

Time to ready: wall time from launching `make run` until `GET /readyz` answers 200 with "ok": true (polled every
0.2 s). Memory: every 0.2 s (psutil), the SUM of RSS over the process tree of `make` plus the embedded PostgreSQL,
which pg_ctl daemonizes: the postmaster is found by the data folder in its cmdline, its backends as its children
(the embedded redis-server is a child of the launcher). Shared pages count once per process, as RSS does. Peaks
per phase: install (until `fleet.launcher` appears), start-up (until ready), serving (--serve-seconds after ready).
Stop: SIGINT to make's process group, as Ctrl-C in a terminal does (make alone would wait for the launcher), then
the time until every process seen, and the embedded PostgreSQL, is gone. --mode external gives every run a fresh
database on DATABASE_URL's server and a fresh REDIS_PREFIX (both removed at the end); embedded unsets both URLs.

Output: a Markdown table, bench/results/run_command.json (keyed by mode) and one log per run next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psutil

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PHASES = ("install", "startup", "serving", "stopping")
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
RUN_CELLS = ("ready_s", "install_mb", "serving_mb", "stop_s")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def is_ready(port: int) -> bool:
    try:
        with NO_PROXY.open(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return response.status == 200 and json.load(response).get("ok") is True
    except (OSError, ValueError):
        return False


def embedded_postgres(data_dir: str | None) -> dict[int, psutil.Process]:
    """The postmaster whose cmdline names our data folder, and its children (the backends)."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["name", "cmdline"]) if data_dir else ():
        if proc.info["name"] == "postgres" and data_dir in " ".join(proc.info["cmdline"] or ()):
            found[proc.pid] = proc
            with contextlib.suppress(psutil.Error):
                found.update((child.pid, child) for child in proc.children())
    return found


def running(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    return False


def kill(procs: list[psutil.Process]) -> list[str]:
    """SIGKILL (by pid; only processes this benchmark started) and say which they were."""
    described = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            described.append(f"{proc.pid} {' '.join(proc.cmdline())[:200]}")
            proc.kill()
    return described


class Sampler(threading.Thread):
    """Every 0.2 s: sum of RSS over the root's process tree plus the embedded PostgreSQL; the peak per phase."""

    def __init__(self, root_pid: int, data_dir: str | None, phase: str = "install"):
        super().__init__(daemon=True)
        self.root, self.data_dir, self.phase = psutil.Process(root_pid), data_dir, phase
        self.peaks: dict[str, int] = {}
        self.seen: dict[tuple[int, float], psutil.Process] = {}  # every process ever sampled, for the stop check
        self.lock, self.done = threading.Lock(), threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.is_set():
            procs: dict[int, psutil.Process] = {}
            with contextlib.suppress(psutil.Error):
                procs = {p.pid: p for p in [self.root, *self.root.children(recursive=True)]}
            procs.update(embedded_postgres(self.data_dir))
            total = 0
            for proc in procs.values():
                with contextlib.suppress(psutil.Error):
                    total += proc.memory_info().rss
                    if self.phase == "install" and "fleet.launcher" in " ".join(proc.cmdline()):
                        self.phase = "startup"
                    with self.lock:
                        self.seen.setdefault((proc.pid, proc.create_time()), proc)
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), total)
            self.done.wait(0.2)

    def alive(self) -> list[psutil.Process]:
        with self.lock:
            procs = list(self.seen.values())
        return [proc for proc in procs + list(embedded_postgres(self.data_dir).values()) if running(proc)]

    def finish(self, grace: float) -> tuple[dict[str, float], list[str]]:
        """Wait up to `grace` s for every process to go, kill the rest; the peaks in MB and what was killed."""
        deadline = time.monotonic() + grace
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.done.set()
        self.join()
        return {phase: round(peak / 2**20, 1) for phase, peak in self.peaks.items()}, kill(left)


def run_env(args, checkout: Path, created: list[str]) -> dict[str, str]:
    drop = {"DATABASE_URL", "REDIS_URL", "REDIS_PREFIX", "FLEET_DATA_DIR", "FLEET_PORT", "VIRTUAL_ENV"}
    env = {key: value for key, value in os.environ.items() if key not in drop}
    env.update(FLEET_PORT=str(args.port), FLEET_DATA_DIR=str(checkout / ".data"))
    if args.mode == "external":  # a fresh database (the launcher creates it) and Redis namespace per run
        created.append(name := f"fleet_bench_{uuid.uuid4().hex[:10]}")
        env["DATABASE_URL"] = urlunsplit(urlsplit(os.environ["DATABASE_URL"])._replace(path="/" + name))
        env.update(REDIS_URL=os.environ["REDIS_URL"], REDIS_PREFIX=name)
    return env


def measure_run(args, checkout: Path, env: dict, label: str) -> dict:
    """`make run` until ready, serve for a while, then Ctrl-C and wait for a clean stop."""
    log_path = RESULTS / f"run_command-{args.mode}-{label}.log"
    with open(log_path, "w") as log:
        started = time.monotonic()
        make = subprocess.Popen(["make", "run"], cwd=checkout, env=env, stdout=log, stderr=log, start_new_session=True)
        sampler = Sampler(make.pid, str(checkout / ".data") if args.mode == "embedded" else None)
        try:
            while not is_ready(args.port):
                if make.poll() is not None or time.monotonic() - started > args.ready_timeout:
                    raise RuntimeError(f"{label}: not ready (make exit {make.returncode}); see {log_path}")
                time.sleep(0.2)
            ready_s = time.monotonic() - started
            sampler.phase = "serving"
            time.sleep(args.serve_seconds)
            sampler.phase = "stopping"
            stop_started = time.monotonic()
            os.killpg(make.pid, signal.SIGINT)
            while (make.poll() is None or sampler.alive()) and time.monotonic() - stop_started < args.stop_timeout:
                time.sleep(0.05)
            stop_s = time.monotonic() - stop_started
            clean = make.poll() is not None and not sampler.alive()
        finally:
            if make.poll() is None:
                os.killpg(make.pid, signal.SIGINT)
            peaks, leftovers = sampler.finish(grace=20)
            make.wait()
    said = [line.split("ready in ")[1] for line in log_path.read_text().splitlines() if "[fleet] ready in " in line]
    result = {"ready_s": round(ready_s, 2), "stop_s": round(stop_s, 2) if clean else None, "make_exit": make.returncode}
    result.update({f"{phase}_mb": peaks.get(phase) for phase in PHASES})
    return {**result, "launcher_says_ready": said[0] if said else None, "leftovers": leftovers, "log": str(log_path)}


def measure_command(argv: list[str], cwd: Path, env: dict, data_dir: str | None, label: str) -> dict:
    """Wall time and peak RSS (process tree plus embedded PostgreSQL) of one command run to completion."""
    log_path = RESULTS / f"run_command-{label}.log"
    with open(log_path, "w") as log:
        started = time.monotonic()
        process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=log)
        sampler = Sampler(process.pid, data_dir, phase="all")
        code = process.wait()
        elapsed = time.monotonic() - started
        peaks, leftovers = sampler.finish(grace=5)
    if code != 0:
        raise RuntimeError(f"{label} failed (exit {code}); see {log_path}")
    return {"time_s": round(elapsed, 2), "peak_mb": peaks["all"], "leftovers": leftovers, "log": str(log_path)}


def median_row(runs: list[dict]) -> dict:
    row: dict = {"runs": runs}
    for key in ("ready_s", "stop_s", *(f"{phase}_mb" for phase in PHASES)):
        values = [run[key] for run in runs if run[key] is not None]
        row[key] = round(statistics.median(values), 2) if values else None
    return row


def cleanup_external(created: list[str]) -> None:
    maintenance = urlunsplit(urlsplit(os.environ["DATABASE_URL"])._replace(path="/postgres"))
    redis = ["redis-cli", "-u", os.environ["REDIS_URL"]]
    for name in created:
        subprocess.run(["psql", "-X", "-q", maintenance, "-c", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'])
        keys = subprocess.run([*redis, "--scan", "--pattern", f"*{name}*"], capture_output=True, text=True).stdout
        for start in range(0, len(keys := keys.split()), 500):
            subprocess.run([*redis, "DEL", *keys[start : start + 500]], capture_output=True)


def table(rows: dict, runs: int) -> str:
    spec = [
        ("cold", rows["cold"], RUN_CELLS),
        (f"warm (median of {runs})", rows["warm"], RUN_CELLS),
        ("services-only baseline", rows["services_only"], ("time_s", "", "peak_mb", "")),
        ("torch-install baseline", rows["torch_install"], ("time_s", "peak_mb", "", "")),
    ]
    lines = ["| | time to ready s | peak RSS MB (install phase) | peak RSS MB (serving) | stop time s |"]
    lines.append("| --- | ---: | ---: | ---: | ---: |")
    for name, row, keys in spec:
        cells = [row.get(key) for key in keys]
        lines.append(f"| {name} | " + " | ".join("—" if cell is None else f"{cell:.1f}" for cell in cells) + " |")
    lines.append("\nservices-only = `launcher exec -- true` from start to exit (services up and down again);")
    lines.append("torch-install = `pip install torch==2.13.0` into a fresh venv. Stop time — = not clean in time.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, help="git checkout to run in (default: a fresh clone of this repo)")
    parser.add_argument("--port", type=int, default=free_port(), help="FLEET_PORT (default: a free port)")
    parser.add_argument("--mode", choices=("embedded", "external"), default="embedded")
    parser.add_argument("--runs", type=int, default=3, help="warm runs")
    parser.add_argument("--serve-seconds", type=float, default=5.0, help="how long to sample once ready")
    parser.add_argument("--ready-timeout", type=float, default=1200.0)
    parser.add_argument("--stop-timeout", type=float, default=60.0)
    args = parser.parse_args()
    if args.mode == "external" and not (os.environ.get("DATABASE_URL") and os.environ.get("REDIS_URL")):
        parser.error("--mode external needs DATABASE_URL and REDIS_URL in the environment")
    env_words = [f"{key}={os.environ[key]}" for key in ("DATABASE_URL", "REDIS_URL") if args.mode == "external"]
    command = f"cd {shlex.quote(os.getcwd())} && {shlex.join([*env_words, sys.executable, *sys.argv])}"
    RESULTS.mkdir(parents=True, exist_ok=True)

    temp = None
    if args.checkout:
        checkout = args.checkout.resolve()
        if (checkout / ".venv").exists() or (checkout / ".data").exists():
            parser.error(f"a cold start needs {checkout} without .venv and .data")
    else:
        temp = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
        checkout = temp / "checkout"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(checkout)], check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True).stdout.strip()
    created: list[str] = []
    rows: dict = {}
    try:
        print(f"[bench] {args.mode}: cold run in {checkout} ({commit[:10]}), port {args.port}", flush=True)
        rows["cold"] = measure_run(args, checkout, run_env(args, checkout, created), "cold")
        warm = []
        for index in range(1, args.runs + 1):
            print(f"[bench] warm run {index}/{args.runs}", flush=True)
            warm.append(measure_run(args, checkout, run_env(args, checkout, created), f"warm{index}"))
        rows["warm"] = median_row(warm)
        print("[bench] services-only baseline", flush=True)
        data_dir = str(checkout / ".data") if args.mode == "embedded" else None
        argv = [str(checkout / ".venv/bin/python"), "-m", "fleet.launcher", "exec", "--", "true"]
        env = run_env(args, checkout, created)
        rows["services_only"] = measure_command(argv, checkout, env, data_dir, f"{args.mode}-services")
        print("[bench] torch-install baseline", flush=True)
        venv = Path(tempfile.mkdtemp(prefix="fleet-bench-torch-"))
        try:  # the same python3 and pip upgrade as the Makefile; only the torch install is timed
            subprocess.run([shutil.which("python3") or sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([venv / "bin/python", "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True)
            argv = [str(venv / "bin/python"), "-m", "pip", "install", "--quiet", "torch==2.13.0"]
            rows["torch_install"] = measure_command(argv, venv, dict(os.environ), None, f"{args.mode}-torch")
        finally:
            shutil.rmtree(venv, ignore_errors=True)
    finally:  # anything still naming the checkout was started by us: report it, then kill it
        mine = [p for p in psutil.process_iter(["cmdline"]) if str(checkout) in " ".join(p.info["cmdline"] or ())]
        rows["stray_processes_at_end"] = kill([proc for proc in mine if proc.pid != os.getpid()])
        if rows["stray_processes_at_end"]:
            print("[bench] killed processes left behind:\n  " + "\n  ".join(rows["stray_processes_at_end"]))
        if created:
            cleanup_external(created)
        if temp:
            shutil.rmtree(temp, ignore_errors=True)

    markdown = table(rows, args.runs)
    print(f"\n### make run, {args.mode} services\n\n{markdown}\n\ncommand: `{command}`")
    out = RESULTS / "run_command.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    machine = {"cpus": os.cpu_count(), "memory_mb": round(psutil.virtual_memory().total / 2**20)}
    results[args.mode] = {"command": command, "commit": commit, "machine": machine, "table": markdown, "rows": rows}
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
