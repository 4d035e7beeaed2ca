"""Atomic training checkpoints that survive a power cut, and detect a torn or corrupted one.

Each checkpoint is one file ``ckpt-<step>.pt``: a header line ``fleet-ckpt-1 <sha256 of the payload>`` then
the payload (``torch.save`` of a dict of tensors, numbers and strings: adapter tensors, optimizer state,
step, whatever the trainer needs). It is written to a temporary file, fsynced, renamed into place and the
folder fsynced. ``load_latest`` checks the hash and falls back to the previous good checkpoint when the
newest one is truncated or damaged.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from edge_agent.identity import atomic_write

MAGIC = b"fleet-ckpt-1"
NAME = re.compile(r"^ckpt-(\d{10})\.pt$")
log = logging.getLogger(__name__)


class CorruptCheckpoint(ValueError):
    pass


@dataclass
class Checkpoint:
    step: int
    state: dict[str, Any]
    path: Path
    skipped: list[Path] = field(default_factory=list)  # newer checkpoints found corrupt


def encode(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    return MAGIC + b" " + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def decode(data: bytes) -> dict[str, Any]:
    header, newline, payload = data.partition(b"\n")
    parts = header.split(b" ")
    if not newline or len(parts) != 2 or parts[0] != MAGIC:
        raise CorruptCheckpoint("not a checkpoint (bad header)")
    if hashlib.sha256(payload).hexdigest().encode() != parts[1]:
        raise CorruptCheckpoint("checkpoint hash mismatch (truncated or damaged)")
    return torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")


class CheckpointManager:
    """Checkpoints in ``directory``, keeping the newest ``keep``."""

    def __init__(self, directory: Path | str, *, keep: int = 2):
        self.directory = Path(directory)
        self.keep = max(int(keep), 1)

    def paths(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every checkpoint file, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m[1]), p) for p in self.directory.iterdir() if (m := NAME.match(p.name))]
        return sorted(found)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        path = self.directory / f"ckpt-{int(step):010d}.pt"
        atomic_write(path, encode({**state, "step": int(step)}))
        for _, old in self.paths()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint whose hash checks out (None when there is none); corrupt newer ones are
        listed in ``skipped`` and logged."""
        skipped: list[Path] = []
        for step, path in reversed(self.paths()):
            try:
                state = decode(path.read_bytes())
            except (CorruptCheckpoint, OSError, RuntimeError, EOFError) as exc:
                log.warning("skipping checkpoint %s: %s", path.name, exc)
                skipped.append(path)
                continue
            return Checkpoint(step=step, state=state, path=path, skipped=skipped)
        return None

    def clear(self) -> None:
        for _, path in self.paths():
            path.unlink(missing_ok=True)
