"""``python -m tests.edge_agent.peak_rss HOME WARMUP... -- FILE...``: how much memory the agent's own process takes
to read each FILE through its real reader (``Agent.add_file``), above what it held idle just before.

The WARMUP files (good ones of every kind) are read first, so what the reader imports on first use counts as
idle. Before each FILE the process's peak resident size is reset (``/proc/self/clear_refs``), so ``VmHWM``
afterwards is that file's own peak. The address space is capped a few GiB above idle, so a reader without
bounds fails here with MemoryError instead of taking the machine. Prints one JSON line a file:
``{"file", "outcome", "idle_mib", "peak_above_idle_mib", "seconds"}``.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import time
from pathlib import Path

import psutil

from edge_agent.api import Agent

GUARD_BYTES = 3 * 2**30


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def main(argv: list[str]) -> int:
    home, rest = Path(argv[0]), argv[1:]
    split = rest.index("--")
    warmups, files = rest[:split], rest[split + 1 :]
    agent, process = Agent(home), psutil.Process()
    for path in warmups:
        agent.add_file(path)
    vms = process.memory_info().vms
    resource.setrlimit(resource.RLIMIT_AS, (vms + GUARD_BYTES, resource.getrlimit(resource.RLIMIT_AS)[1]))
    for path in files:
        gc.collect()
        idle = process.memory_info().rss
        reset_peak()
        started = time.monotonic()
        try:
            outcome = f"stored {agent.add_file(path)} samples"
        except BaseException as error:  # noqa: BLE001  (MemoryError above all: reported, not raised)
            outcome = f"{type(error).__name__}: {str(error)[:300]}"
        seconds = time.monotonic() - started
        peak = max(peak_rss(), process.memory_info().rss)
        print(
            json.dumps(
                {
                    "file": Path(path).name,
                    "outcome": outcome,
                    "idle_mib": round(idle / 2**20, 1),
                    "peak_above_idle_mib": round(max(peak - idle, 0) / 2**20, 1),
                    "seconds": round(seconds, 2),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
