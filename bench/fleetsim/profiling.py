"""Where the server's processes spend the measured window, sampled with py-spy (``pip install py-spy``):
``py-spy record --nonblocking --format raw`` on every uvicorn worker and Celery pool process, folded into the
functions with the most samples, inclusive (the function or anything it called) and self (the function's own
code), per group. Non-blocking sampling does not pause the processes; idle samples are dropped."""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?P<line>:\d+)?\)$")
IDLE = ("select (selectors.py", "poll (selectors.py", "_worker (concurrent/futures/thread.py", "Condition.wait (")
PROJECT = ("training/", "devices/", "fleet/", "edge_agent/", "accounts/", "frontend/")


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"  # installed into the venv
    return str(beside) if beside.exists() else shutil.which("py-spy")


async def record(
    groups: dict[str, list], seconds: float, folder: Path, rate: int = 97, waits: bool = False, gil: bool = False
) -> dict[str, list[Path]]:
    """Sample every process of every group for ``seconds``; the raw files per group. ``waits``: also the
    threads blocked in a system call (py-spy ``--idle``), so time spent waiting on PostgreSQL or Redis shows.
    ``gil``: only the thread holding the GIL (py-spy ``--gil``), which is where the process's Python CPU goes
    (threads waiting for the GIL otherwise count as busy)."""
    executable = py_spy()
    if executable is None:
        raise RuntimeError("py-spy is not installed: .venv/bin/pip install py-spy")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    runs, files = [], {}
    for name, processes in groups.items():
        for process in processes:
            out = folder / f"{name}-{process.pid}.txt"
            files.setdefault(name, []).append(out)
            command = [executable, "record", "--nonblocking", "--format", "raw", "-r", str(rate)]
            command += ["--idle"] if waits else []
            command += ["--gil"] if gil else []
            command += ["-d", str(int(seconds)), "-p", str(process.pid), "-o", str(out)]
            runs.append(
                await asyncio.create_subprocess_exec(
                    *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
                )
            )
    await asyncio.gather(*(run.wait() for run in runs))
    return files


def _name(frame: str) -> str:
    """``function (path:line)`` with the path shortened to the package or project-relative part."""
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = match["file"]
    for marker in ("site-packages/", "/work/main/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{match['function']} ({path}{match['line'] or ''})"


def _project(frame: str) -> bool:
    return any(f"({prefix}" in frame for prefix in PROJECT)


def fold(files: list[Path], top: int = 14) -> dict:
    """Where the samples went (idle waits excluded): the project's own functions by inclusive share (the line
    and everything it called), and the lines with the most samples of their own (any code)."""
    inclusive, own = Counter(), Counter()
    busy = idle = 0
    for path in files:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            frames = [_name(f) for f in stack.split(";")[1:]]  # the first entry names the thread
            if not frames:
                continue
            samples = int(count)
            if any(marker in frames[-1] for marker in IDLE):
                idle += samples
                continue
            busy += samples
            own[frames[-1]] += samples
            for frame in set(frames):
                if _project(frame):
                    inclusive[frame] += samples
    share = lambda n: round(100.0 * n / busy, 1) if busy else 0.0  # noqa: E731
    return {
        "busy_samples": busy,
        "idle_samples": idle,
        "inclusive": [(frame, share(n)) for frame, n in inclusive.most_common(top)],
        "self": [(frame, share(n)) for frame, n in own.most_common(top)],
    }
