"""The staging folder of unfinished delta uploads (``DELTA_STAGING_DIR/<device>/<sha256>.part``, the envelope
beside it as ``.json``): the lock per file that keeps two connections of one device from interleaving writes,
and the expiry of uploads no chunk reached for ``DELTA_STAGED_EXPIRY_SECONDS`` (one on demand, ``expire``;
all of them in beat's sweep, ``staged_expire``). What is staged, and when, is ``training.federation.intake``'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import time
from contextlib import contextmanager
from pathlib import Path

from django.conf import settings

logger = logging.getLogger(__name__)


@contextmanager
def locked(path: Path):
    """Hold the exclusive lock of the staged upload ``path`` (its ``.lock`` file beside it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock = open(path.with_suffix(".lock"), "a")  # noqa: SIM115  (closed below)
    except FileNotFoundError:  # the sweep removed the device's empty folder just now
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")  # noqa: SIM115
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def lock_if_free(lock_path: Path, *, create: bool):
    """Yields True holding the lock at ``lock_path`` if no one holds it (or, without ``create``, if there is no
    lock file: an upload takes its lock before it touches anything), False if someone does."""
    try:
        lock = open(lock_path, "a" if create else "r")  # noqa: SIM115  (closed below)
    except FileNotFoundError:
        yield True
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def expire(part: Path, now: float | None = None) -> bool:
    """Discard a staged upload (its part, envelope and lock files) that no chunk reached for
    DELTA_STAGED_EXPIRY_SECONDS; True if it is gone. Only when no one holds its lock: an upload being written
    to right now is not stale. (The caller may hold another upload's lock.)"""
    try:
        age = (now or time.time()) - part.stat().st_mtime
    except FileNotFoundError:
        return True
    if age < settings.DELTA_STAGED_EXPIRY_SECONDS:
        return False
    lock_path = part.with_suffix(".lock")
    with lock_if_free(lock_path, create=True) as free:
        if not free:
            return False
        for path in (part, part.with_suffix(".json"), lock_path):
            path.unlink(missing_ok=True)
    logger.info("discarded a staged upload no chunk reached for %.0f s: %s", age, part)
    return True


def staged_expire() -> int:
    """Beat's sweep of the staging folder: every device's stale unfinished uploads, and the lock and envelope
    files that finished uploads leave behind once they are as old. Returns how many uploads were discarded."""
    root = Path(settings.DELTA_STAGING_DIR)
    if not root.is_dir():
        return 0
    now, expired = time.time(), 0
    for folder in (path for path in root.iterdir() if path.is_dir()):
        for part in folder.glob("*.part"):
            expired += expire(part, now)
        for leftover in (*folder.glob("*.lock"), *folder.glob("*.json")):
            with contextlib.suppress(FileNotFoundError):
                if now - leftover.stat().st_mtime < settings.DELTA_STAGED_EXPIRY_SECONDS:
                    continue
                with lock_if_free(leftover.with_suffix(".lock"), create=False) as free:
                    if free and not leftover.with_suffix(".part").exists():
                        leftover.unlink()
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty
    return expired
