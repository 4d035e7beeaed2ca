"""CPU and memory of process trees and of the whole machine, sampled with psutil.

CPU figures are percent of one core (200 = both cores of this machine); the machine figure is percent of all
cores, every process included.
"""

from __future__ import annotations


def raise_open_file_limit() -> tuple[int, int]:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1_048_576
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def safe(fn, default):
    try:
        return fn()
    except Exception:
        return default


def rss(processes: list) -> int:
    return sum(safe(lambda p=p: p.memory_info().rss, 0) for p in processes)


def cpu_seconds(processes: list) -> dict[int, float]:
    out = {}
    for p in processes:
        times = safe(p.cpu_times, None)
        if times is not None:
            out[p.pid] = times.user + times.system
    return out


def cpu_percent(before: dict[int, float], after: dict[int, float], seconds: float) -> float:
    """Percent of one core over the window (200 = both cores of this machine)."""
    used = sum(after[pid] - before.get(pid, 0.0) for pid in after)
    return 100.0 * used / seconds if seconds > 0 else 0.0


def machine_cpu(before, after) -> float:
    """Percent of all cores busy between two psutil.cpu_times() samples (every process on the machine)."""

    def busy(t) -> float:
        return t.user + t.nice + t.system + t.irq + t.softirq + t.steal

    total = (busy(after) + after.idle + after.iowait) - (busy(before) + before.idle + before.iowait)
    return 100.0 * (busy(after) - busy(before)) / max(1e-9, total)


def established(process, port: int) -> int:
    import psutil

    try:
        return sum(
            1
            for c in process.net_connections(kind="tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port
        )
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return -1


def processes_named(name: str, containing: str | None = None) -> list:
    """Processes called ``name`` whose command line holds ``containing`` (a PostgreSQL backend's names its
    database)."""
    import psutil

    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        if process.info["name"] != name:
            continue
        if containing is None or containing in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found


def listening_tree(url: str) -> list:
    """The processes listening on ``url``'s port, and their children (a server we did not start)."""
    import psutil

    port = int(url.rsplit(":", 1)[1].split("/")[0])
    pids = {c.pid for c in psutil.net_connections(kind="tcp") if c.status == "LISTEN" and c.laddr.port == port}
    processes = [psutil.Process(pid) for pid in pids if pid]
    return processes + [p for root in processes for p in root.children(recursive=True)]


def wait_for_quiet_machine(limit: float, say, threshold: float = 25.0) -> None:
    """Wait up to ``limit`` seconds until the whole machine is under ``threshold`` percent busy over 3 s (other
    users' work on this shared machine, plus our idle server)."""
    import time

    import psutil

    started = time.monotonic()
    while True:
        busy = psutil.cpu_percent(interval=3)
        if busy < threshold or time.monotonic() - started > limit:
            say(f"machine {busy:.0f}% busy after waiting {time.monotonic() - started:.0f}s")
            return
