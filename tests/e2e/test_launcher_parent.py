"""The launcher stops everything when make, which started it, goes away, and when asked to watch any parent
(``fleet/parent_watch.py``); otherwise it outlives whatever started it.

A real make runs the launcher the way the Makefile's ``run`` recipe does (``exec``, so make is its parent),
and gets SIGINT alone, as ``kill -INT <pid of make>`` sends it: make waits for its child, and the launcher
must notice and stop. A plain parent that is killed outright leaves the launcher orphaned: with
``--watch-parent`` it must stop too. These check that the launcher, its web/worker/beat processes and the port
are gone afterwards. Without ``--watch-parent``, a script that starts the launcher in the background and ends
leaves the product running (it stopped the server, issue 50).
"""

from __future__ import annotations

import shlex
import signal
import socket
import sys
import time

import psutil
import pytest

from fleet.parent_watch import ParentWatch
from tests.e2e.support import await_ready, drop_stack, free_port, launcher_argv, spawn, stack_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# make keeps a SIGINT its starter ignored (a test run in the background has it ignored); a terminal's
# make has it at the default, so the wrapper sets that before it becomes make.
AS_FROM_A_TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"
)


def _launcher_and_children(parent_pid: int) -> tuple[psutil.Process, list[psutil.Process]]:
    (launcher,) = psutil.Process(parent_pid).children()
    return launcher, [launcher, *launcher.children(recursive=True)]


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def _assert_everything_stopped(processes: list[psutil.Process], port: int, output) -> None:
    _, alive = psutil.wait_procs(processes, timeout=60)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for leftover in alive:
        leftover.kill()
    assert not alive, f"processes outlived their parent: {alive}\n{output.tail()}"
    assert not _port_open(port), "the web server's port still answers"
    assert any("[fleet] stopped" in line for line in output.lines), output.tail()


def test_sigint_sent_to_make_alone_stops_the_launcher_its_children_and_the_port(tmp_path):
    env = stack_env(tmp_path)
    port = free_port()
    makefile = tmp_path / "Makefile"
    makefile.write_text(f"run:\n\texec {shlex.join(launcher_argv(port))}\n")
    make, output = spawn([sys.executable, "-c", AS_FROM_A_TERMINAL, "make", "-f", str(makefile), "run"], env)
    processes: list[psutil.Process] = []
    try:
        await_ready(make, output)
        launcher, processes = _launcher_and_children(make.pid)
        assert launcher.cmdline()[1:4] == ["-m", "fleet.launcher", "run"]
        assert len(processes) >= 4 and _port_open(port)  # launcher, web, worker, beat

        make.send_signal(signal.SIGINT)  # to make only: the launcher is in its process group but gets nothing
        assert make.wait(timeout=90) == -signal.SIGINT  # make waited for the launcher, then died of the signal
        _assert_everything_stopped(processes, port, output)
        assert any("make" in line and "got SIGINT" in line for line in output.lines), output.tail()
    finally:
        for process in [*processes, psutil.Process(make.pid) if make.poll() is None else None]:
            if process is not None and process.is_running():
                process.kill()
        drop_stack(env)


def test_launcher_watching_its_parent_and_orphaned_by_its_death_stops_its_children_and_the_port(tmp_path):
    env = stack_env(tmp_path)
    port = free_port()
    starter = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(3600)"
    parent, output = spawn([sys.executable, "-c", starter, *launcher_argv(port, None, 1, "--watch-parent")], env)
    processes: list[psutil.Process] = []
    try:
        await_ready(parent, output)
        launcher, processes = _launcher_and_children(parent.pid)
        assert _port_open(port)

        parent.kill()  # SIGKILL: nothing is forwarded, the launcher is re-parented
        parent.wait(timeout=10)
        _assert_everything_stopped(processes, port, output)
        assert any(f"its parent process {parent.pid} exited" in line for line in output.lines), output.tail()
    finally:
        for process in processes:
            if process.is_running():
                process.kill()
        if parent.poll() is None:
            parent.kill()
        drop_stack(env)


def test_a_script_that_starts_the_launcher_in_the_background_and_ends_leaves_the_product_running(tmp_path):
    env = stack_env(tmp_path)
    port = free_port()
    script = tmp_path / "start.sh"
    # The product in the background; the script waits until it answers, then ends (as a deploy script would).
    wait_ready = (
        "import time, urllib.request as u\n"
        "while True:\n"
        f"  try: u.urlopen('http://127.0.0.1:{port}/readyz')\n"
        "  except OSError: time.sleep(0.5)\n"
        "  else: break"
    )
    lines = [shlex.join(launcher_argv(port)) + " &", shlex.join([sys.executable, "-c", wait_ready]), "echo started"]
    script.write_text("#!/bin/sh\n" + "\n".join(lines) + "\n")
    script.chmod(0o755)
    starter, output = spawn([str(script)], env)
    launcher: psutil.Process | None = None
    try:
        assert starter.wait(timeout=120) == 0, output.tail()  # it waited for the product, then ended
        assert any("press Ctrl-C to stop" in line for line in output.lines), output.tail()
        launcher = next(p for p in psutil.process_iter(["cmdline"])
                        if p.info["cmdline"] and p.info["cmdline"][1:4] == ["-m", "fleet.launcher", "run"]
                        and str(port) in p.info["cmdline"])  # fmt: skip
        time.sleep(3 * ParentWatch.interval)  # as long as the watch would take to notice
        assert launcher.is_running() and _port_open(port), output.tail()
        assert not any("stopping everything" in line for line in output.lines), output.tail()
        processes = [launcher, *launcher.children(recursive=True)]
        launcher.send_signal(signal.SIGTERM)  # stopped by its own signal, as the README says
        _assert_everything_stopped(processes, port, output)
    finally:
        if launcher is not None and launcher.is_running():
            for process in [*launcher.children(recursive=True), launcher]:
                process.kill()
        drop_stack(env)
