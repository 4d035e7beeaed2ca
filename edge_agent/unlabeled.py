"""Samples the device's application hands over without a label: a bounded store beside the labelled one.

On a device most data comes without a label. ``Agent.add_samples`` (and every sample file, ``add_file``) sends a
batch or record without ``y`` here: ``<home>/unlabeled/``, a ``SampleStore`` of the same shards (the family's
encoded inputs, no ``y``), with ``load`` and ``load_recent`` newest last. It is bounded: at most ``keep`` samples
(the setting ``unlabeled_keep``, 2,000 unless set; ``edge-agent configure --unlabeled-keep N``), the oldest
dropped first, exactly (a shard partly dropped is written again with only its newer samples, under the same
sequence number and a smaller count; a shard that is there twice after a power cut is read as its smaller,
newer, copy). With ``keep`` 0 none is kept and unlabeled samples are refused with a ``SampleError`` saying so;
lowering the setting drops the oldest at once (``trim``). A sample's place (``load(start, stop)``) moves as the
oldest are dropped; what is inherited from ``SampleStore`` about training (``trained_count``) counts places too.

It is a separate store, and that is what keeps the held figures honest: the training passes, their validation
and the held slice read only ``<home>/samples/`` (``samples.device_split``), so nothing unlabeled ever enters
them, and a labelled sample is never taken from here. A user's label wins: ``Agent.ask`` records the samples it
asks about as answers (``edge_agent.feedback``) and notes here which sample each answer is (``asked.json``, by
the sample's content: ``row_keys``); feedback on such an answer removes that sample (and any equal copy of it)
from this store before its labelled copy is written, so it is never used unlabeled again. A power cut between the
two writes loses the sample from this store while its answer stays open with its input kept, so feedback given
again stores it; the sample is never in both stores.

Every change is made under an exclusive lock of ``.lock`` (the application's ``Agent`` and ``edge-agent run``'s
inbox may both write), loads under a shared one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from edge_agent.families.common import LABEL
from edge_agent.identity import atomic_write
from edge_agent.sample_bounds import SampleError
from edge_agent.samples import SampleStore, _as_numpy, _npz_bytes

UNLABELED_DIR = "unlabeled"
KEEP_UNLABELED = 2000
MAX_UNLABELED = 1_000_000  # the setting's largest: every ask reads them all through the model
ASKED_FILE = "asked.json"
LOCK_FILE = ".lock"


def refused_by_setting() -> str:
    return (
        "unlabeled samples are not kept (unlabeled_keep is 0): give each sample its label 'y', or keep some with "
        "`edge-agent configure --unlabeled-keep N`"
    )


def row_keys(arrays: dict[str, np.ndarray]) -> list[str]:
    """One key a sample, from its fields' names, dtypes, shapes and bytes: equal samples have equal keys."""
    count = len(next(iter(arrays.values()))) if arrays else 0
    keys = []
    for index in range(count):
        digest = hashlib.sha256()
        for name in sorted(arrays):
            value = np.ascontiguousarray(arrays[name][index])
            digest.update(f"{name}\0{value.dtype.str}\0{value.shape}\0".encode())
            digest.update(value.tobytes())
        keys.append(digest.hexdigest()[:32])
    return keys


class UnlabeledStore(SampleStore):
    """The unlabeled samples of one agent home, at most ``keep`` of them, the oldest dropped first."""

    def __init__(self, directory: Path | str, *, keep: int = KEEP_UNLABELED):
        super().__init__(directory)
        self.keep = max(int(keep), 0)

    @classmethod
    def of(cls, home: Path, config) -> UnlabeledStore:
        """The store as the agent's settings bound it (``unlabeled_keep``)."""
        return cls(Path(home) / UNLABELED_DIR, keep=config.unlabeled_keep)

    @contextlib.contextmanager
    def _locked(self, *, shared: bool = False) -> Iterator[None]:
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (and the lock with it)

    def _shards(self) -> list[tuple[int, int, Path]]:
        """The shards in order; of a shard there twice (a power cut while it was written again with fewer
        samples), the copy with fewer samples, which is the newer."""
        chosen: dict[int, tuple[int, int, Path]] = {}
        for shard in super()._shards():
            if shard[0] not in chosen or shard[1] < chosen[shard[0]][1]:
                chosen[shard[0]] = shard
        return [chosen[sequence] for sequence in sorted(chosen)]

    def _stale(self) -> None:
        """Remove the older copies of shards written again (what ``_shards`` skips)."""
        kept = {path for _, _, path in self._shards()}
        for _, _, path in super()._shards():
            if path not in kept:
                path.unlink(missing_ok=True)

    def fields(self) -> set[str] | None:
        """The fields the stored samples have (None while it holds none)."""
        shards = self._shards()
        if not shards:
            return None
        with np.load(shards[0][2]) as first:
            return set(first.files)

    def refusal(self, arrays: dict[str, np.ndarray]) -> str | None:
        """Why ``append`` would refuse these samples, or None."""
        if LABEL in arrays:
            return f"unlabeled samples carry no {LABEL!r}; labelled ones go to the sample store"
        if self.keep == 0:
            return refused_by_setting()
        held = self.fields()
        if held is not None and held != set(arrays):
            return f"unlabeled samples have fields {sorted(arrays)}, the store holds {sorted(held)}"
        return None

    def append(self, samples: dict) -> int:
        """Store a batch (the newest ``keep`` of it when it is larger), dropping the oldest samples to make room;
        returns the store's length after it. Refused whole (``SampleError``) with ``y`` or when ``keep`` is 0."""
        arrays = _as_numpy(samples)
        count = len(next(iter(arrays.values()), ()))
        with self._locked():
            refused = self.refusal(arrays)
            if refused:
                raise SampleError(refused)
            if count == 0:
                return len(self)
            if count > self.keep:
                arrays = {key: value[count - self.keep :] for key, value in arrays.items()}
                count = self.keep
            self._stale()
            shards = self._shards()
            self._drop_oldest(sum(c for _, c, _ in shards) + count - self.keep)
            sequence = shards[-1][0] + 1 if shards else 0
            atomic_write(self.directory / f"shard-{sequence:08d}-{count}.npz", _npz_bytes(arrays))
            return len(self)

    def trim(self) -> int:
        """Drop the oldest samples beyond ``keep`` (the setting lowered: ``edge-agent configure`` calls it); returns
        how many were dropped."""
        with self._locked():
            self._stale()
            excess = len(self) - self.keep
            self._drop_oldest(excess)
            return max(excess, 0)

    def _drop_oldest(self, excess: int) -> None:
        """Drop the oldest ``excess`` samples: whole shards, then the older part of the next one (made room before
        the new batch is written, so a power cut between leaves fewer samples, never more than ``keep``)."""
        for _, count, path in self._shards():
            if excess <= 0:
                return
            if count <= excess:
                path.unlink()
            else:
                self._rewrite(path, np.arange(excess, count))
            excess -= count

    def _rewrite(self, path: Path, rows: np.ndarray) -> None:
        """Keep only ``rows`` of a shard: the new copy (same sequence, fewer samples) written before the old is
        removed."""
        sequence = int(path.name.split("-")[1])
        if len(rows):
            with np.load(path) as shard:
                arrays = {key: shard[key][rows] for key in shard.files}
            atomic_write(self.directory / f"shard-{sequence:08d}-{len(rows)}.npz", _npz_bytes(arrays))
        path.unlink()

    def load(self, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
        """Samples ``start:stop``, oldest first, newest last (empty dict when none). Positions move as the oldest
        are dropped: a sample's place is good only until the next ``append`` or ``discard``."""
        with self._locked(shared=True):
            return super().load(start, stop)

    def load_recent(self, n: int) -> dict[str, np.ndarray]:
        """The newest ``n`` samples, newest last."""
        with self._locked(shared=True):
            return super().load(max(len(self) - max(int(n), 0), 0))

    def discard(self, keys: Iterable[str]) -> int:
        """Remove the samples whose ``row_keys`` are ``keys`` (a user labelled them); returns how many."""
        wanted = set(keys)
        if not wanted:
            return 0
        removed = 0
        with self._locked():
            self._stale()
            for _, count, path in self._shards():
                with np.load(path) as shard:
                    keep = np.asarray([key not in wanted for key in row_keys({k: shard[k] for k in shard.files})])
                if not keep.all():
                    self._rewrite(path, np.flatnonzero(keep))
                    removed += count - int(keep.sum())
        return removed

    # Which samples were asked about (Agent.ask): answer id -> the sample's key ----------------------------------

    @property
    def _asked_path(self) -> Path:
        return self.directory / ASKED_FILE

    def asked(self) -> dict[str, str]:
        """The answers ``Agent.ask`` gave (their ids) and the sample each is about (its key)."""
        try:
            return dict(json.loads(self._asked_path.read_text()))
        except FileNotFoundError:
            return {}

    def note_asked(self, asked: dict[str, str], *, keep_only: set[str] | None = None) -> None:
        """Add ``asked`` (id -> key) to the notes; with ``keep_only``, first forget the ids not in it (answers no
        longer open)."""
        with self._locked():
            notes = self.asked()
            if keep_only is not None:
                notes = {answer: key for answer, key in notes.items() if answer in keep_only}
            atomic_write(self._asked_path, json.dumps({**notes, **asked}).encode())

    def status(self) -> dict:
        return {"stored": len(self), "keep": self.keep}
