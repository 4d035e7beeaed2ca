"""What ``test_agent_kill.py`` reads from the agent it kills: the ``sitecustomize`` that makes it dump every thread's
stack on SIGUSR1, one agent process (``AgentRun``) and where its training thread was when killed
(``training_phase``), the state it leaves on disk (``outbox_rows``, ``check_state``, ``orphans``), and the triggers
for targeted kills (``wait_for_phase``)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import signal
import sqlite3
import sys
import time
from collections import Counter
from pathlib import Path

from tests.e2e.support import ROOT, spawn

SITECUSTOMIZE = """\
import faulthandler, os, signal
if os.environ.get("FLEET_KILL_TEST_STACKS"):
    faulthandler.register(signal.SIGUSR1, all_threads=True)
"""
HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):")
FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
STATE_RANK = {"queued": 0, "uploading": 1, "sent": 2, "accepted": 3, "rejected": 3}


# --- the agent process ------------------------------------------------------------------------------------------


class AgentRun:
    """One `python -m edge_agent --home H run` process, its output, and when it started."""

    def __init__(self, home: Path, env: dict, *extra: str):
        self.started_wall = time.time()
        self.started = time.monotonic()
        self.process, self.output = spawn(
            [sys.executable, "-m", "edge_agent", "--home", str(home), "run", "--max-backoff", "2", *extra], env
        )

    def lines(self) -> list[str]:
        return list(self.output.lines)

    def stacks_then_kill(self) -> tuple[bool, list[list[tuple[str, int, str]]], float]:
        """SIGUSR1 (faulthandler writes every thread's stack from inside its signal handler), SIGKILL as soon as
        the dump starts arriving (a millisecond or so later), then read the whole dump. Returns whether the
        agent was still running, the threads' frames (most recent first) and the seconds the process lived."""
        start = len(self.output.lines)
        alive = self.process.poll() is None
        if alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGUSR1)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and not any(HEADER.match(line) for line in self.output.lines[start:]):
                time.sleep(0.0005)
        lived = time.monotonic() - self.started
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        self.output._thread.join(timeout=5)  # the pipe is closed: the reader has everything once it returns
        threads: list[list[tuple[str, int, str]]] = []
        for line in self.output.lines[start:]:
            if HEADER.match(line):
                threads.append([])
            elif threads and (frame := FRAME.match(line)):
                threads[-1].append((frame["file"], int(frame["line"]), frame["func"]))
        return alive, threads, lived


def _runtime_marks() -> tuple[int, int, int]:
    """Line numbers in edge_agent/runtime.py: train_once's call of train_adapter, its call of put_delta, and
    the first line after that call."""
    source = (ROOT / "edge_agent" / "runtime.py").read_text().splitlines()
    train = next(i for i, line in enumerate(source, 1) if "= train_adapter(" in line)
    put = next(i for i, line in enumerate(source, 1) if "self.outbox.put_delta(" in line)
    after = next(i for i, line in enumerate(source, 1) if i > put and line.strip() == ")") + 1
    return train, put, after


def training_phase(threads: list[list[tuple[str, int, str]]]) -> str:
    """Where the agent's training thread was: startup (the loop not running yet), idle, setup (train_once before
    train_adapter: samples, base model, adapter), training (train_adapter and judging its result), packaging
    (put_delta: delta, sign, file write, commit), bookkeeping (train_once after put_delta: metrics file,
    samples marked, outcome noted), or unknown (no stack dump arrived)."""
    if not threads:
        return "unknown"
    train_line, put_line, after_put = _runtime_marks()
    loop_running = False
    for frames in threads:
        files = [(Path(f).as_posix(), line, func) for f, line, func in frames]
        loop_running = loop_running or any(f.endswith("asyncio/runners.py") for f, _, _ in files)
        once = [(line, func) for f, line, func in files if f.endswith("edge_agent/runtime.py") and func == "train_once"]
        if not once:
            continue
        if any(f.endswith(("edge_agent/packaging.py", "edge_agent/delta.py")) for f, _, _ in files):
            return "packaging"
        if any(f.endswith(("edge_agent/training.py", "edge_agent/checkpoint.py")) for f, _, _ in files):
            return "training"
        line = once[0][0]
        if line <= train_line:
            return "setup"
        return "training" if line < put_line else "packaging" if line < after_put else "bookkeeping"
    return "idle" if loop_running else "startup"


# --- the state on disk ------------------------------------------------------------------------------------------


def outbox_rows(home: Path) -> dict[str, dict]:
    path = home / "outbox.sqlite3"
    if not path.exists():
        return {}
    db = sqlite3.connect(path, timeout=10)
    db.row_factory = sqlite3.Row
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        # Killed between creating the file and its schema (each CREATE commits alone): the next start makes the
        # rest (CREATE TABLE IF NOT EXISTS), and nothing can be in a table made after the kill.
        rows = [dict(r) for r in db.execute("SELECT * FROM deltas ORDER BY counter")] if "deltas" in tables else []
        next_counter = (
            db.execute("SELECT next FROM counters WHERE name = 'delta'").fetchone() if "counters" in tables else None
        )
    finally:
        db.close()
    shas = [r["sha256"] for r in rows]
    counters = [r["counter"] for r in rows]
    assert len(set(shas)) == len(shas), f"a delta is in the outbox twice: {Counter(shas).most_common(3)}"
    assert len(set(counters)) == len(counters), f"a counter is used twice: {Counter(counters).most_common(3)}"
    if rows:
        assert next_counter is not None and next_counter[0] > max(counters), (next_counter, max(counters))
    return {r["sha256"]: r for r in rows}


def check_state(home: Path, previous: dict[str, dict], public_key) -> dict[str, dict]:
    """Everything a restarted agent reads must be whole; returns the outbox rows."""
    from edge_agent.assignments import AdapterStore
    from edge_agent.checkpoint import CheckpointManager
    from edge_agent.cli import main as agent_main
    from edge_agent.protocol import verify
    from edge_agent.samples import ReplayBuffer, SampleStore

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = agent_main(["--home", str(home), "status"])
    assert code == 0, printed.getvalue()
    report = json.loads(printed.getvalue())

    rows = outbox_rows(home)
    assert report["outbox"] == dict(Counter(r["state"] for r in rows.values())), (report["outbox"], rows)
    for sha, row in rows.items():
        path = Path(row["path"])
        assert path.exists(), f"outbox row {sha[:12]} ({row['state']}) has no file {path}"
        data = path.read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha and len(data) == row["size"], f"{path} is damaged"
        signed = json.loads(row["envelope"])
        envelope = signed["envelope"]
        assert (envelope["sha256"], envelope["counter"], envelope["size"]) == (sha, row["counter"], row["size"])
        assert verify(public_key, envelope, signed["signature"]), f"bad signature on {sha[:12]}"
    for sha, before in previous.items():  # nothing queued is ever lost, and states only move forward
        assert sha in rows, f"outbox row {sha[:12]} vanished"
        after = rows[sha]
        assert after["counter"] == before["counter"]
        went_back = STATE_RANK[after["state"]] < STATE_RANK[before["state"]]
        assert not went_back or (before["state"], after["state"]) == ("uploading", "queued"), (before, after)

    AdapterStore(home).state()
    samples = SampleStore(home / "samples")
    loaded = samples.load()
    assert len(samples) == (len(loaded["y"]) if loaded else 0)
    assert samples.trained_count <= len(samples)
    if (home / "replay.npz").exists():
        ReplayBuffer(home / "replay.npz")
    CheckpointManager(home / "checkpoints").load_latest()  # falls back past a torn one, never raises
    for name in ("agent.json", "settings.json", "last_training.json", "status.json"):
        if (home / name).exists():
            json.loads((home / name).read_text())
    return rows


def orphans(home: Path, rows: dict[str, dict]) -> tuple[int, int]:
    """Delta files without a row (killed between the file write and the commit: harmless, never signed into
    anything sent) and temporary files left by atomic writes cut short."""
    files = {p.name for p in (home / "outbox").glob("*.delta")}
    referenced = {Path(r["path"]).name for r in rows.values()}
    temporary = list(home.rglob(".*.tmp"))
    return len(files - referenced), len(temporary)


# --- triggers for targeted kills --------------------------------------------------------------------------------


def _poll(check, timeout: float, interval: float = 0.003) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return False


def wait_for_phase(phase: str, home: Path, staging: Path, run: AgentRun, timeout: float) -> bool:
    checkpoints = home / "checkpoints"

    def fresh_checkpoint() -> bool:
        with contextlib.suppress(OSError):
            return any(p.stat().st_mtime >= run.started_wall for p in checkpoints.glob("ckpt-*.pt"))
        return False

    if phase == "training":
        return _poll(fresh_checkpoint, timeout)
    if phase == "packaging":  # the pass wrote checkpoints, then train_adapter cleared them: put_delta is next
        return _poll(fresh_checkpoint, timeout) and _poll(lambda: not any(checkpoints.glob("ckpt-*.pt")), timeout)

    def staging_started() -> bool:
        with contextlib.suppress(OSError):
            return any(p.stat().st_mtime >= run.started_wall for p in staging.glob("*.part"))
        return False

    return _poll(staging_started, timeout)
