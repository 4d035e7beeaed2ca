"""Local samples on disk: an append-only store fed by a pluggable source, and a reservoir replay buffer.

The store is a folder of numpy shards named ``shard-<seq>-<count>.npz``, each written atomically (a shard is
there whole or not at all, so a power cut loses at most the batch being written) and never rewritten, plus
``state.json`` with how many samples the last training used. Samples are dicts of arrays with a common
first dimension (the family's inputs and ``"y"``).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from edge_agent.identity import atomic_write

SHARD = re.compile(r"^shard-(\d{8})-(\d+)\.npz$")


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _as_numpy(samples: dict) -> dict[str, np.ndarray]:
    arrays = {
        k: (v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)) for k, v in samples.items()
    }
    lengths = {len(a) for a in arrays.values()}
    if len(lengths) != 1:
        raise ValueError(f"sample fields differ in length: { {k: len(a) for k, a in arrays.items()} }")
    return arrays


def to_tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in arrays.items()}


class SampleSource(Protocol):
    """Where new samples come from: ``poll()`` gives the next batch or None when nothing is new."""

    def poll(self) -> dict[str, np.ndarray] | None: ...


class SimulatedStream:
    """A demo source: the device's shard of a data set arriving ``per_poll`` samples at a time, in an order
    fixed by ``seed``. ``seek(n)`` resumes after the first ``n`` samples (the store's length after a restart).

    With ``wrap`` the shard arrives again and again, as a user keeps writing the same digits: every later pass
    has the same order (so a sample keeps its place in ``device_split`` when each pass's length is a multiple of
    ``multiple``; the remainder is left out) and its float fields a little fresh noise (``jitter``)."""

    def __init__(
        self, data: dict, indices=None, *, per_poll: int = 16, seed: int = 0, wrap: bool = False,
        multiple: int = 1, jitter: float = 0.02,
    ):  # fmt: skip
        self.data = _as_numpy(data)
        n = len(next(iter(self.data.values())))
        order = np.arange(n) if indices is None else np.asarray(indices, dtype=np.int64)
        self.order = np.random.default_rng(seed).permutation(order)
        if wrap:
            self.order = self.order[: len(self.order) - len(self.order) % max(int(multiple), 1)]
        self.per_poll, self.wrap, self.jitter, self.seed = int(per_poll), wrap, float(jitter), seed
        self.position = 0

    def seek(self, position: int) -> None:
        self.position = int(position) if self.wrap else min(int(position), len(self.order))

    def poll(self) -> dict[str, np.ndarray] | None:
        n = len(self.order)
        if not n or (not self.wrap and self.position >= n):
            return None
        stop = self.position + self.per_poll if self.wrap else min(self.position + self.per_poll, n)
        positions = np.arange(self.position, stop)
        self.position = stop
        batch = {key: value[self.order[positions % n]] for key, value in self.data.items()}
        repeat = positions // n
        if self.jitter and repeat.any():  # a repeat is the same digit written again, not the same pixels
            rng = np.random.default_rng([self.seed, int(positions[0])])
            for key, value in batch.items():
                if np.issubdtype(value.dtype, np.floating):
                    noise = rng.normal(0.0, self.jitter, value.shape).astype(value.dtype)
                    noise[repeat == 0] = 0
                    batch[key] = value + noise
        return batch


class SampleStore:
    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _shards(self) -> list[tuple[int, int, Path]]:
        found = []
        for path in self.directory.iterdir():
            match = SHARD.match(path.name)
            if match:
                found.append((int(match[1]), int(match[2]), path))
        return sorted(found)

    def __len__(self) -> int:
        return sum(count for _, count, _ in self._shards())

    def append(self, samples: dict) -> int:
        """Store a batch as a new shard; returns the store's length after it."""
        arrays = _as_numpy(samples)
        count = len(next(iter(arrays.values())))
        if count == 0:
            return len(self)
        shards = self._shards()
        if shards:
            with np.load(shards[0][2]) as first:
                if set(first.files) != set(arrays):
                    raise ValueError(f"samples have fields {sorted(arrays)}, the store holds {sorted(first.files)}")
        sequence = shards[-1][0] + 1 if shards else 0
        atomic_write(self.directory / f"shard-{sequence:08d}-{count}.npz", _npz_bytes(arrays))
        return sum(c for _, c, _ in shards) + count

    def collect(self, source: SampleSource, *, max_polls: int | None = None) -> int:
        """Poll ``source`` until it has nothing new (or ``max_polls``); returns how many samples were added.
        A source with ``seek`` is first positioned after what the store already holds."""
        if hasattr(source, "seek"):
            source.seek(len(self))
        added, polls = 0, 0
        while max_polls is None or polls < max_polls:
            polls += 1
            batch = source.poll()
            if batch is None:
                break
            before = len(self)
            added += self.append(batch) - before
        return added

    def load(self, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
        """Samples ``start:stop`` in arrival order (empty dict when the store is empty)."""
        parts: list[dict[str, np.ndarray]] = []
        offset = 0
        for _, count, path in self._shards():
            if (stop is None or offset < stop) and offset + count > start:
                with np.load(path) as shard:
                    lo, hi = max(start - offset, 0), count if stop is None else min(stop - offset, count)
                    parts.append({key: shard[key][lo:hi] for key in shard.files})
            offset += count
        if not parts:
            return {}
        return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}

    @property
    def _state_path(self) -> Path:
        return self.directory / "state.json"

    @property
    def trained_count(self) -> int:
        """How many samples (from the start of the store) the last completed training had."""
        if not self._state_path.exists():
            return 0
        return int(json.loads(self._state_path.read_text()).get("trained_count", 0))

    def new_count(self) -> int:
        return max(len(self) - self.trained_count, 0)

    def mark_trained(self, count: int | None = None) -> None:
        count = len(self) if count is None else int(count)
        atomic_write(self._state_path, json.dumps({"trained_count": count}).encode())


def local_split(data: dict, *, val_fraction: float = 0.2) -> tuple[dict, dict]:
    """The device's train and validation slices: every ``round(1 / val_fraction)``-th sample in arrival order
    is validation, so the split is stable as the store grows and across restarts."""
    n = len(next(iter(data.values())))
    every = max(round(1 / val_fraction), 2)
    val_mask = np.zeros(n, dtype=bool)
    val_mask[every - 1 :: every] = True
    index_val, index_train = np.flatnonzero(val_mask), np.flatnonzero(~val_mask)
    return {k: v[index_train] for k, v in data.items()}, {k: v[index_val] for k, v in data.items()}


SPLIT_EVERY = 10  # device_split's period: a window or a wrapped stream on a multiple of it keeps every sample's side


def device_split(data: dict) -> tuple[dict, dict, dict]:
    """The device's train, validation and held slices, by place in arrival order (stable as the store grows):
    the 10th sample of every ten is **held**: no pass trains on it, so the device measures the shared version and
    its own model there and chooses between them (README.md, "Personalization"); the 5th is validation, held out
    within a pass (when to stop, whether to undo) and then trained on too (``TrainConfig.refit``); the other
    eight train."""
    place = np.arange(len(next(iter(data.values())))) % SPLIT_EVERY
    val, held = place == SPLIT_EVERY // 2 - 1, place == SPLIT_EVERY - 1
    train, val, held = ({k: v[np.flatnonzero(mask)] for k, v in data.items()} for mask in (~(val | held), val, held))
    return train, val, held


class ReplayBuffer:
    """A fixed-capacity reservoir sample (Vitter's algorithm R) of every sample ever added, persisted as one
    ``.npz`` file written atomically (with how many were seen and the generator's state)."""

    def __init__(self, path: Path | str, *, capacity: int = 256, seed: int = 0):
        self.path = Path(path)
        self.capacity = int(capacity)
        self.seen = 0
        self.data: dict[str, np.ndarray] = {}
        self.rng = np.random.default_rng(seed)
        if self.path.exists():
            with np.load(self.path, allow_pickle=False) as stored:
                meta = json.loads(bytes(stored["__meta__"]).decode())
                self.data = {k: stored[k] for k in stored.files if k != "__meta__"}
            self.seen, self.capacity = int(meta["seen"]), int(meta["capacity"])
            self.rng.bit_generator.state = meta["rng"]

    def __len__(self) -> int:
        return len(next(iter(self.data.values()))) if self.data else 0

    def add(self, samples: dict) -> None:
        arrays = _as_numpy(samples)
        n = len(next(iter(arrays.values())))
        if not self.data:
            self.data = {k: np.empty((0, *v.shape[1:]), dtype=v.dtype) for k, v in arrays.items()}
        room = max(self.capacity - len(self), 0)
        fill = min(room, n)
        if fill:
            self.data = {k: np.concatenate([self.data[k], arrays[k][:fill]]) for k in self.data}
        self.seen += fill
        for i in range(fill, n):
            self.seen += 1
            slot = int(self.rng.integers(0, self.seen))
            if slot < self.capacity:
                for key in self.data:
                    self.data[key][slot] = arrays[key][i]

    def sample(self, n: int, *, generator: np.random.Generator | None = None) -> dict[str, torch.Tensor]:
        """``n`` stored samples drawn with replacement (empty dict when the buffer is empty)."""
        if not self.data or n <= 0:
            return {}
        rng = generator or self.rng
        chosen = rng.integers(0, len(self), size=n)
        return to_tensors({key: value[chosen] for key, value in self.data.items()})

    def save(self) -> None:
        meta = {"seen": self.seen, "capacity": self.capacity, "rng": self.rng.bit_generator.state}
        arrays = {**self.data, "__meta__": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
        atomic_write(self.path, _npz_bytes(arrays))
