"""The inbox: a folder (``<home>/inbox``) where the device's application drops sample files for the agent, and
feedback files (``*.feedback.jsonl`` / ``*.feedback.json``: users' labels on the agent's answers, taken by
``edge_agent.feedback`` under the same rules: whole or not at all, a bad one moved to ``rejected/`` with its reason).

``edge-agent run`` looks at it before every training check. Each file (or image folder) is claimed by a rename
into ``.taking/``, read and checked whole (``edge_agent.sample_files``, within the bounds of
``edge_agent.sample_bounds``), stored, then deleted: taken once, one at a time. Whatever goes wrong with an entry
stays with that entry: it is moved to ``rejected/`` with ``<name>.reason.txt`` beside it saying why, nothing of it
is stored, and the next one is taken; nothing in the inbox can stop the agent or its training. Only regular files
and folders are read: a symbolic link, FIFO, socket or device is refused unopened (a link is moved, never
followed). Write a file under a name starting with ``.`` or ending in ``.tmp`` / ``.part`` and rename it when
complete: such names are left alone.

An entry still in ``.taking/`` when a take begins was being taken when the agent stopped (killed, out of memory, a
power cut): it is refused ("the agent stopped while taking it"), not taken again, so a file that stops the agent
cannot do so at every start. Drop it in again to have it taken again.

``rejected/`` is bounded: at most ``keep_files`` refused entries, and ``keep_bytes`` for the copies kept (the
settings ``rejected_keep_files`` and ``rejected_keep_mib``: 100 and 128 MiB unless set), the oldest removed first
with their reasons; an entry larger than ``keep_bytes`` on its own keeps only its reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from edge_agent.visible_text import visible

logger = logging.getLogger("edge_agent.inbox")
INBOX_DIR = "inbox"
INCOMPLETE = (".tmp", ".part")
REASON = ".reason.txt"
KEEP_FILES = 100
KEEP_BYTES = 128 * 2**20
STOPPED = (
    "the agent stopped while taking it (killed, out of memory or a power cut?) and does not take it again; drop it "
    "in again to have it taken"
)


def _remove(path: Path) -> None:
    """Delete ``path`` whatever it is, without following it when it is a link."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(path)  # (does not follow links inside)
    else:
        path.unlink(missing_ok=True)


def _size(path: Path) -> int:
    """Bytes on disk of a file, or of every file under a folder; links are counted as links."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        return info.st_size
    total = 0
    for folder, _, names in os.walk(path):  # (followlinks is off)
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _entries(folder: Path) -> list[Path]:
    try:
        return [folder / name for name in sorted(os.listdir(folder))]
    except (FileNotFoundError, NotADirectoryError):
        return []


class Inbox:
    def __init__(self, home: Path, *, keep_files: int = KEEP_FILES, keep_bytes: int = KEEP_BYTES):
        self.root = Path(home) / INBOX_DIR
        self.taking = self.root / ".taking"
        self.rejected = self.root / "rejected"
        self.keep_files, self.keep_bytes = int(keep_files), int(keep_bytes)

    def make(self) -> Path:
        """Create the folder (and its parents) if it is not there; returns it. ``configure --data app`` and
        ``run`` make it, so the application has a place to drop files from the start."""
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root

    def waiting(self) -> list[Path]:
        return [
            path
            for path in _entries(self.root)
            if not path.name.startswith(".") and path.name != self.rejected.name and not path.name.endswith(INCOMPLETE)
        ]

    def interrupted(self) -> list[Path]:
        """What was being taken when the agent stopped."""
        return _entries(self.taking)

    def take(self, add: Callable[[Path], int]) -> list[dict]:
        """Hand every waiting file to ``add`` (which stores it and returns how many samples: ``Agent.take_file``'s
        ``Stored`` says how many were labelled and how many unlabeled), one at a time; returns what became of each:
        ``{"file", "added", "labelled", "unlabeled"}`` or ``{"file", "rejected": reason}``."""
        self.taking.mkdir(parents=True, exist_ok=True)
        outcomes = [self._refuse(path, STOPPED) for path in self.interrupted()]
        outcomes += [self._take_one(path, add) for path in self.waiting()]
        if any("rejected" in outcome for outcome in outcomes):
            self.bound_rejected()
        return outcomes

    def _take_one(self, path: Path, add: Callable[[Path], int]) -> dict:
        claimed = self.taking / path.name
        try:
            path.rename(claimed)  # (.taking/ is empty: what was there was refused first)
        except OSError as error:
            return self._refuse(path, f"cannot be claimed ({error.strerror})")
        try:
            added = add(claimed)
        except Exception as error:  # whatever a file does, the agent goes on
            return self._refuse(
                claimed, str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
            )
        try:
            _remove(claimed)
        except OSError as error:  # stored: moved aside so it is not stored again
            self._refuse(claimed, f"its {added} samples were stored, but it could not be deleted ({error.strerror})")
        labelled, unlabeled = getattr(added, "labelled", added), getattr(added, "unlabeled", 0)
        logger.info("inbox: stored %d samples (%d labelled, %d unlabeled) from %s", added, labelled, unlabeled,
                    visible(path.name))  # fmt: skip
        return {"file": path.name, "added": int(added), "labelled": labelled, "unlabeled": unlabeled}

    def _refuse(self, path: Path, reason: str) -> dict:
        """Move ``path`` to ``rejected/`` with its reason beside it; where it cannot be moved, delete it, so it
        is not taken again."""
        logger.warning("inbox: %s refused: %s", visible(path.name), visible(reason))
        try:
            self.rejected.mkdir(parents=True, exist_ok=True)
            target = self.rejected / path.name
            _remove(target)
            path.rename(target)
        except OSError as error:
            logger.error("inbox: %s cannot be moved to rejected/ (%s): deleted", visible(path.name), error.strerror)
            with contextlib.suppress(OSError):
                _remove(path)
        try:
            (self.rejected / f"{path.name}{REASON}").write_text(visible(reason) + "\n")
        except OSError as error:
            logger.error("inbox: the reason for %s cannot be written (%s)", visible(path.name), error.strerror)
        return {"file": path.name, "rejected": reason}

    def bound_rejected(self) -> None:
        """Keep ``rejected/`` within ``keep_files`` entries and ``keep_bytes``: the newest first, an entry
        larger than ``keep_bytes`` on its own keeping only its reason, then every entry older than the first
        that does not fit removed with its reason."""
        groups: dict[str, list[Path]] = {}
        for path in _entries(self.rejected):
            groups.setdefault(path.name.removesuffix(REASON), []).append(path)
        found = []
        for name, paths in groups.items():
            with contextlib.suppress(OSError):  # (what another process removed meanwhile is gone anyway)
                reason = self.rejected / f"{name}{REASON}"
                when = os.lstat(reason if reason in paths else paths[0]).st_mtime_ns  # when it was refused
                copies = [p for p in paths if p != reason]
                found.append((when, name, copies, reason, sum(_size(p) for p in copies)))
        total = 0
        for index, (_, name, copies, reason, size) in enumerate(sorted(found, key=lambda f: f[:2], reverse=True)):
            try:
                if size > self.keep_bytes and index < self.keep_files and total <= self.keep_bytes:
                    for copy in copies:
                        _remove(copy)
                    if copies:
                        with reason.open("a") as note:
                            note.write(f"(not kept: {size:,} bytes, more than rejected/ keeps, {self.keep_bytes:,})\n")
                    continue
                total += size
                if index >= self.keep_files or total > self.keep_bytes:
                    for path in [*copies, reason]:
                        _remove(path)
            except OSError as error:
                logger.error("inbox: cannot trim rejected/%s (%s)", visible(name), error.strerror)
