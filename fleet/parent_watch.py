"""The launcher stops when whoever started it goes away, not only on Ctrl-C.

`make run` starts the launcher as make's child (the recipe ``exec``\\ s it: no shell in between). Ctrl-C in the
terminal reaches both, as they share the terminal's process group, but a signal sent to make alone does not
reach the launcher:

- on SIGINT, SIGHUP or SIGQUIT make sets that signal back to its default action, then waits for its children
  to exit before it dies of the signal itself: without help the launcher runs on and make waits for ever;
- on SIGKILL (or any other death) make is gone and the launcher is left orphaned, re-parented to init.

``ParentWatch`` polls for both, twice a second on a daemon thread: the parent's pid changed (it died), or the
parent is make and no longer catches a terminating signal it caught when the watch began (it is on its way
out, waiting for us). Then it calls ``on_gone`` once; the launcher sends itself SIGTERM, which stops
everything as Ctrl-C does. Catching signals is read from ``/proc/<pid>/status`` (``SigCgt``), so the make
check works on Linux only; the orphan check works everywhere.

It watches only when the parent is make, or when asked (``always``: the launcher's ``--watch-parent``, or
``FLEET_WATCH_PARENT=1``). Any other parent may end on purpose while the launcher goes on: a script that starts
the product in the background and exits, a shell's ``nohup ... &``, a service manager's wrapper; stopping the
product then would surprise (it did, issue 50).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("fleet.parent_watch")

TERMINATING = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM)
MAKE_NAMES = frozenset({"make", "gmake"})


def caught_signals(pid: int) -> frozenset[int]:
    """The signals process ``pid`` has a handler for (empty when /proc cannot tell)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return frozenset()
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            mask = int(line.split(":", 1)[1].strip(), 16)
            return frozenset(number for number in range(1, 65) if mask >> (number - 1) & 1)
    return frozenset()


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class ParentWatch:
    """Calls ``on_gone(reason)`` once when the parent process dies or, if it is make, is dying of a signal. Only
    when the parent is make, or ``always`` (otherwise ``watching`` is false and it does nothing)."""

    interval = 0.5

    def __init__(self, on_gone: Callable[[str], None], *, always: bool = False):
        self.on_gone = on_gone
        self.parent = os.getppid()
        self.is_make = process_name(self.parent) in MAKE_NAMES
        self.watching = self.is_make or always
        self.watched = caught_signals(self.parent) & set(TERMINATING) if self.is_make else frozenset()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="parent-watch", daemon=True)

    def start(self) -> ParentWatch:
        if self.watching:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> str | None:
        """Why the launcher should stop now, or None."""
        if not self.watching:
            return None
        if os.getppid() != self.parent:
            return f"its parent process {self.parent} exited"
        if self.watched:
            dropped = self.watched - caught_signals(self.parent)
            if dropped:
                names = ", ".join(sorted(signal.Signals(number).name for number in dropped))
                return f"make ({self.parent}) got {names} and waits for the launcher to exit"
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            reason = self.check()
            if reason:
                logger.warning("stopping: %s", reason)
                self.on_gone(reason)
                return
