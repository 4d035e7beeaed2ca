"""The launcher's supervisor: a child that dies after it ran is started again (what is left of its process
group killed first); one that dies at start, or keeps dying, stops everything."""

from __future__ import annotations

import os
import sys
import threading
import time

import psutil
import pytest

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


def test_the_children_named_first_are_stopped_and_gone_before_the_others_get_their_signal(tmp_path):
    """The demo fleet before the web server its agents talk to: the others are signalled only once those exited."""
    supervisor = _supervisor()
    log = tmp_path / "order"
    child = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        f"    open({str(log)!r}, 'a').write(sys.argv[1] + ' got SIGTERM at ' + repr(time.monotonic()) + '\\n')\n"
        "    time.sleep(float(sys.argv[2]))\n"
        f"    open({str(log)!r}, 'a').write(sys.argv[1] + ' exited at ' + repr(time.monotonic()) + '\\n')\n"
        "    raise SystemExit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    for name, linger in (("web", "0"), ("demo", "1.0"), ("worker", "0")):
        supervisor.start(name, [sys.executable, "-c", child, name, linger])
    _wait(lambda: all(_handles_sigterm(p.pid) for p in supervisor.children.values()))
    supervisor.stop(timeout=10, first=("demo",))
    events = [line.split(" at ")[0] for line in log.read_text().splitlines()]
    assert events[:2] == ["demo got SIGTERM", "demo exited"], events
    assert sorted(events[2:]) == ["web exited", "web got SIGTERM", "worker exited", "worker got SIGTERM"]
    assert all(process.poll() == 0 for process in supervisor.children.values())


def _handles_sigterm(pid: int) -> bool:
    import signal

    from fleet.parent_watch import caught_signals

    return signal.SIGTERM in caught_signals(pid)


@pytest.mark.parametrize("devices", ["1", "2", "-1"])
def test_run_refuses_a_demo_fleet_of_fewer_than_three_devices_before_starting_anything(devices, capsys):
    from fleet.launcher import main

    with pytest.raises(SystemExit) as exited:
        main(["run", "--devices", devices])
    assert exited.value.code == 2
    assert "--devices 0 seeds the demo setup without any" in capsys.readouterr().err
