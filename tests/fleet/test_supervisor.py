"""The launcher's supervisor: a child that dies after it ran is started again (what is left of its process
group killed first); one that dies at start, or keeps dying, stops everything."""

from __future__ import annotations

import os
import sys
import threading
import time

import psutil

from fleet.launcher import Supervisor


def _supervisor(**limits) -> Supervisor:
    supervisor = Supervisor(dict(os.environ))
    for name, value in limits.items():
        setattr(supervisor, name, value)
    return supervisor


def _wait(check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_child_that_dies_after_running_is_started_again_and_its_leftovers_killed():
    supervisor = _supervisor(min_uptime=0.5)
    # Like uvicorn or a Celery worker: the main process has a child of its own, and dies without it.
    child = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(1); raise SystemExit(1)"
    supervisor.start("worker", [sys.executable, "-c", child])
    first = supervisor.children["worker"]
    orphan = _wait(lambda: psutil.Process(first.pid).children()).pop().pid
    codes: list[int] = []
    waiting = threading.Thread(target=lambda: codes.append(supervisor.wait()))
    waiting.start()
    try:
        second = _wait(lambda: supervisor.children["worker"] is not first and supervisor.children["worker"])
        assert second.poll() is None
        assert _wait(lambda: _gone(orphan), timeout=5)
    finally:
        supervisor.stopping.set()
        waiting.join(10)
        supervisor.stop(timeout=5)
    assert codes == [0]


def test_a_child_that_dies_at_start_stops_everything():
    supervisor = _supervisor(min_uptime=5.0)
    supervisor.start("web", [sys.executable, "-c", "raise SystemExit(3)"])
    assert supervisor.wait() == 3


def test_a_child_that_keeps_dying_stops_everything():
    supervisor = _supervisor(min_uptime=0.2, max_restarts=2)
    supervisor.start("beat", [sys.executable, "-c", "import time; time.sleep(0.3); raise SystemExit(4)"])
    started = time.monotonic()
    assert supervisor.wait() == 4
    assert len(supervisor.restarts["beat"]) == 2
    assert time.monotonic() - started < 15
