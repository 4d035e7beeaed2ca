"""The inbox: a folder (``<home>/inbox``) where the device's application drops sample files for the agent.

``edge-agent run`` looks at it before every training check. Each file (or image folder) is claimed by a rename
into ``.taking/``, read and checked whole (``edge_agent.sample_files``), stored, then deleted: taken once. A
file that does not fit is moved to ``rejected/`` with ``<name>.reason.txt`` beside it saying why, and nothing
of it is stored; nothing in the inbox can stop the agent. Write a file under a name starting with ``.`` or
ending in ``.tmp`` / ``.part`` and rename it when complete: such names are left alone.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("edge_agent.inbox")
INBOX_DIR = "inbox"
INCOMPLETE = (".tmp", ".part")


class Inbox:
    def __init__(self, home: Path):
        self.root = Path(home) / INBOX_DIR
        self.taking = self.root / ".taking"
        self.rejected = self.root / "rejected"

    def make(self) -> Path:
        """Create the folder (and its parents) if it is not there; returns it. ``configure --data app`` and
        ``run`` make it, so the application has a place to drop files from the start."""
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root

    def _remove(self, path: Path) -> None:
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    def _reject(self, path: Path, reason: str) -> None:
        self.rejected.mkdir(parents=True, exist_ok=True)
        target = self.rejected / path.name
        if target.exists():
            self._remove(target)
        path.rename(target)
        (self.rejected / f"{path.name}.reason.txt").write_text(reason + "\n")
        logger.warning("inbox: %s refused: %s", path.name, reason)

    def waiting(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(
            p
            for p in self.root.iterdir()
            if not p.name.startswith(".") and p.name != self.rejected.name and not p.name.endswith(INCOMPLETE)
        )

    def take(self, add: Callable[[Path], int]) -> list[dict]:
        """Hand every waiting file to ``add`` (which stores it and returns how many samples); returns what
        became of each: ``{"file", "added"}`` or ``{"file", "rejected": reason}``."""
        self.taking.mkdir(parents=True, exist_ok=True)
        claimed = sorted(self.taking.iterdir())  # claimed before a crash: taken up again first
        for path in self.waiting():
            target = self.taking / path.name
            if target.exists():
                self._remove(target)
            path.rename(target)
            claimed.append(target)
        outcomes = []
        for path in claimed:
            try:
                added = add(path)
            except Exception as error:  # noqa: BLE001  (whatever a file does, the agent goes on)
                reason = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
                self._reject(path, reason)
                outcomes.append({"file": path.name, "rejected": reason})
                continue
            self._remove(path)
            logger.info("inbox: stored %d samples from %s", added, path.name)
            outcomes.append({"file": path.name, "added": added})
        return outcomes
