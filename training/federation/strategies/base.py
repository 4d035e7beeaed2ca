"""What every strategy shares: its input, reading deltas, validation, norm clipping, the base classes.

Pure torch + safetensors (no Django). A delta file is read with ``safe_open`` and decoded to float32 by
``edge_agent.delta`` (encodings f32/f16/int8). Deltas are opened one at a time and closed before the next
(the file's mapping goes with it), so a pass over N deltas holds one delta's pages at most.

Key layout: a delta holds every key of the adapter's spec, except that ``lora_A`` keys may be absent (the
FFA-LoRA layout: A is frozen and shared); an absent key is a zero delta. Keys outside the spec, a missing
non-A key, a wrong shape, a stored dtype that is not the one the encoding names, a missing int8 scale and a
non-finite value are refused with ValueError.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from edge_agent.delta import ENCODINGS, FORMAT, decode_tensor, read_encoding

from .server_optimizers import BETA2, MOMENTUM, OPTIMIZERS, TAU

Shape = tuple[int, ...]
LORA_A_MARKERS = (".lora_A.", ".lora_embedding_A")
LORA_B_MARKERS = (".lora_B.", ".lora_embedding_B")


def is_lora_a(key: str) -> bool:
    return any(marker in key for marker in LORA_A_MARKERS)


def is_lora_b(key: str) -> bool:
    return any(marker in key for marker in LORA_B_MARKERS)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class DeltaInput:
    path: str  # local path of the delta safetensors file (safe_open-able)
    num_samples: int  # sample weight
    staleness: int = 0  # versions between the device's base and the round's base
    norm: float | None = None  # L2 norm of the decoded delta over all tensors (computed if None)

    def __post_init__(self):
        if not isinstance(self.path, str | os.PathLike) or not os.fspath(self.path):
            raise ValueError(f"a delta input needs a file path, not {self.path!r}")
        object.__setattr__(self, "path", os.fspath(self.path))
        if not _is_int(self.num_samples) or self.num_samples < 1:
            raise ValueError(f"{self.path}: num_samples must be a whole number >= 1, not {self.num_samples!r}")
        if not _is_int(self.staleness) or self.staleness < 0:
            raise ValueError(f"{self.path}: staleness must be a whole number >= 0, not {self.staleness!r}")
        if self.norm is not None:
            if not _is_real(self.norm) or self.norm < 0:
                raise ValueError(f"{self.path}: norm must be a finite number >= 0 or None, not {self.norm!r}")
            object.__setattr__(self, "norm", float(self.norm))


def check_inputs(inputs) -> list[DeltaInput]:
    if not isinstance(inputs, list | tuple) or not inputs:
        raise ValueError("aggregation needs at least one delta")
    bad = [i for i, inp in enumerate(inputs) if not isinstance(inp, DeltaInput)]
    if bad:
        raise ValueError(f"inputs must be DeltaInput objects; #{bad[0]} is {type(inputs[bad[0]]).__name__}")
    return list(inputs)


def check_spec(spec) -> dict[str, Shape]:
    """The spec's shapes by key; ValueError for an empty or malformed spec."""
    if not isinstance(spec, dict) or not spec:
        raise ValueError("the adapter's tensor spec is empty")
    shapes: dict[str, Shape] = {}
    for key, entry in spec.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if (
            not isinstance(key, str)
            or not isinstance(shape, list | tuple)
            or not all(_is_int(d) and d >= 0 for d in shape)
        ):
            raise ValueError(f"the tensor spec's entry for {key!r} needs a shape of whole numbers")
        shapes[key] = tuple(shape)
    return shapes


# The most deltas one shard holds: a task's work, and what a killed worker's retry redoes, stays bounded.
MAX_SHARD = 1024


def shards(inputs: list[DeltaInput], size: int, workers: int = 2) -> list[list[DeltaInput]]:
    """The units of one partial sum each: consecutive shards, as even as they can be (sizes differing by one at
    most). ``size`` inputs or fewer are one shard; more are split across ``workers`` (the aggregation workers,
    ``AGGREGATION_WORKERS``): one shard each, or a multiple of that when a shard would pass MAX_SHARD, so the
    workers finish together and each writes as few float64 partials as it can (each one is 8 bytes per
    parameter to write, read and add: with shards of 64, 300 deltas of 10M parameters on two workers ran at
    1.67x one worker's speed, with one shard per worker 1.88x; bench/README.md, "aggregation.py"). Never more
    shards than inputs."""
    if not _is_int(size) or size < 1:
        raise ValueError(f"shard_size must be a whole number >= 1, not {size!r}")
    if not _is_int(workers) or workers < 1:
        raise ValueError(f"workers must be a whole number >= 1, not {workers!r}")
    if not inputs:
        return []
    count = 1 if len(inputs) <= size else min(len(inputs), workers * -(-len(inputs) // (workers * MAX_SHARD)))
    bounds = [len(inputs) * i // count for i in range(count + 1)]
    return [list(inputs[start:stop]) for start, stop in zip(bounds, bounds[1:], strict=False)]


class DeltaReader:
    """One open delta: its keys, shapes, and tensors (or row ranges of them) decoded to float32."""

    def __init__(self, handle, label: str):
        self._f = handle
        self.label = label
        metadata = handle.metadata() or {}
        if metadata.get("format", FORMAT) != FORMAT:
            raise ValueError(f"{label} is not a {FORMAT} file (format {metadata.get('format')!r})")
        try:
            self.encoding, self._scales = read_encoding(metadata)
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from None
        self._stored = ENCODINGS[self.encoding]
        self._keys = list(handle.keys())

    def names(self) -> list[str]:
        return list(self._keys)

    def shape(self, key: str) -> Shape:
        piece = self._f.get_slice(key)
        if piece.get_dtype() != self._stored:
            raise ValueError(
                f"{self.label}: {key!r} is stored as {piece.get_dtype()}, its {self.encoding} encoding stores "
                f"{self._stored}"
            )
        if self.encoding == "int8" and key not in self._scales:
            raise ValueError(f"{self.label}: the int8 tensor {key!r} has no scale in the metadata")
        return tuple(piece.get_shape())

    def _decode(self, key: str, raw: torch.Tensor) -> torch.Tensor:
        value = decode_tensor(raw, encoding=self.encoding, scale=self._scales.get(key))
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"{self.label}: {key!r} holds NaN or infinite values")
        return value

    def read(self, key: str) -> torch.Tensor:
        return self._decode(key, self._f.get_tensor(key))

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` along the first dimension (a 0-d tensor is one row), flattened, float32."""
        if not self._f.get_slice(key).get_shape():
            return self.read(key).reshape(-1)
        return self._decode(key, self._f.get_slice(key)[start:stop]).reshape(-1)


@contextmanager
def open_delta(inp: DeltaInput, index: int) -> Iterator[DeltaReader]:
    label = f"delta #{index} ({inp.path})"
    try:
        handle = safe_open(inp.path, framework="pt")
    except SafetensorError as exc:
        raise ValueError(f"{label} is not a readable safetensors file: {exc}") from None
    with handle as opened:
        yield DeltaReader(opened, label)


ShapeCheck = Callable[[str, Shape, Shape], bool]


def check_keys(label: str, present, shapes: dict[str, Shape]) -> None:
    """No key outside the spec, and every key of it (but an FFA-layout lora_A) there."""
    unknown = sorted(set(present) - set(shapes))
    if unknown:
        raise ValueError(f"{label} holds keys the adapter does not have: {unknown[:3]}")
    missing = [key for key in shapes if key not in present and not is_lora_a(key)]
    if missing:
        raise ValueError(f"{label} lacks {len(missing)} required key(s), e.g. {missing[:3]}")


def check_header(reader: DeltaReader, shapes: dict[str, Shape], shape_ok: ShapeCheck | None = None) -> dict:
    """The delta's shapes by key, after checking its keys, dtypes, scales and shapes against the spec."""
    present = reader.names()
    check_keys(reader.label, present, shapes)
    found = {}
    for key in present:
        shape = reader.shape(key)
        if shape != shapes[key] and not (shape_ok and shape_ok(key, shape, shapes[key])):
            raise ValueError(f"{reader.label}: {key!r} has shape {list(shape)}, the adapter's is {list(shapes[key])}")
        found[key] = shape
    return found


def check_headers(inputs, shapes, shape_ok: ShapeCheck | None = None, extra=None) -> list[dict]:
    """``check_header`` for every input (one open file at a time); ``extra(reader)`` runs more checks."""
    found = []
    for index, inp in enumerate(inputs):
        with open_delta(inp, index) as reader:
            found.append(check_header(reader, shapes, shape_ok))
            if extra is not None:
                extra(reader)
    return found


def row_ranges(shape: Shape, chunk_elements: int) -> Iterator[tuple[int, int, int, int]]:
    """``(start, stop, offset, size)``: whole rows of a tensor (a 0-d tensor is one row), at most
    ``chunk_elements`` coordinates per range (or one row), ``offset`` into the flattened tensor."""
    numel = math.prod(shape)
    rows = shape[0] if shape else 1
    if numel == 0:
        return
    row = numel // rows
    step = max(1, chunk_elements // row)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        yield start, stop, start * row, (stop - start) * row


# Tensors are read in row ranges, not whole: decoding a whole large f16/int8 tensor per delta leaves the
# allocator fragmented, so the process grows delta after delta; row ranges do not.
READ_CHUNK = 1 << 20


def delta_norm(inp: DeltaInput, index: int = 0) -> float:
    """L2 norm of the decoded delta over all its tensors (one delta open at a time, read in row ranges)."""
    total = 0.0
    with open_delta(inp, index) as reader:
        for key in reader.names():
            for start, stop, _, _ in row_ranges(reader.shape(key), READ_CHUNK):
                total += float(torch.linalg.vector_norm(reader.read_rows(key, start, stop), dtype=torch.float64) ** 2)
    return math.sqrt(total)


def clip_factors(inputs: list[DeltaInput], clip: float | None, *, recompute: bool = False) -> list[float]:
    """``min(1, clip / norm)`` per input (1.0 without clipping). Norms come from ``DeltaInput.norm`` unless
    missing or ``recompute`` (DP recomputes: its guarantee must not rest on a caller-given number)."""
    if clip is None:
        return [1.0] * len(inputs)
    factors = []
    for index, inp in enumerate(inputs):
        norm = delta_norm(inp, index) if recompute or inp.norm is None else inp.norm
        factors.append(1.0 if norm <= clip else clip / norm)
    return factors


def weighted_sum(inputs, weights: list[float], shapes: dict[str, Shape], keys) -> dict[str, torch.Tensor]:
    """``sum_i weights[i] * delta_i`` over ``keys`` in float64, streaming: one delta open at a time, one
    running sum per tensor. A key a delta lacks (an FFA-layout lora_A) adds nothing."""
    sums = {key: torch.zeros(shapes[key], dtype=torch.float64) for key in keys}
    for index, (inp, weight) in enumerate(zip(inputs, weights, strict=True)):
        with open_delta(inp, index) as reader:
            present = set(reader.names())
            for key in (key for key in keys if key in present):
                flat = sums[key].view(-1)
                for start, stop, offset, size in row_ranges(shapes[key], READ_CHUNK):
                    flat[offset : offset + size].add_(reader.read_rows(key, start, stop), alpha=weight)
    return sums


def _whole(minimum):
    return lambda v: _is_int(v) and v >= minimum


# Every strategy accepts (and checks) these, ignoring the ones it does not use, so one round can carry an
# adapter's whole settings; an unknown name is refused (a typo must not silently change the aggregate).
# name: (default, check, what the check wants)
PARAMS: dict[str, tuple] = {
    "shard_size": (64, _whole(1), "a whole number >= 1"),
    # The workers a round of the mean family over more than shard_size deltas is split across (the server passes
    # its AGGREGATION_WORKERS): one span of coordinates each, or with DP one shard of deltas each, so a chord and
    # one worker's aggregate cut the same shards.
    "workers": (2, _whole(1), "a whole number >= 1"),
    "chunk_elements": (1 << 20, _whole(1), "a whole number >= 1"),
    # Ceiling on the robust rules' memory, in bytes (the server passes its AGGREGATION_MEMORY_BUDGET_MB): a
    # block holds robust.RobustStrategy.WORKING_BYTES whatever N is, or less where this leaves less room.
    "memory_budget": (512 << 20, _whole(1 << 20), "a whole number of bytes >= 1 MiB"),
    # The robust rules' coordinate spans: the tasks of a chord across workers, and the order one worker adds
    # their Gram matrices in (so both give the same bytes).
    "coordinate_shards": (4, _whole(1), "a whole number >= 1"),
    "clip_norm": (None, lambda v: v is None or (_is_real(v) and v > 0), "a positive finite number or null"),
    "trim_ratio": (0.1, lambda v: _is_real(v) and 0 <= v < 0.5, "a number in [0, 0.5)"),
    "byzantine": (None, lambda v: v is None or _whole(0)(v), "a whole number >= 0 or null"),
    "multi_k": (None, lambda v: v is None or _whole(1)(v), "a whole number >= 1 or null"),
    "mixing": (None, lambda v: v is None or v == "nnm", 'null or "nnm" (nearest-neighbour mixing)'),
    # The share of the aggregated update the server applies (``training.federation.aggregation._finish``); the
    # strategies compute the whole update whatever it is.
    "server_lr": (1.0, lambda v: _is_real(v) and 0 < v <= 10, "a number above 0 and at most 10"),
    # A server optimizer on the aggregated update (``server_optimizers.py``), applied in ``_finish`` as server_lr is.
    "server_optimizer": (None, lambda v: v is None or v in OPTIMIZERS, f"null or one of {', '.join(OPTIMIZERS)}"),
    "server_momentum": (MOMENTUM, lambda v: _is_real(v) and 0 <= v < 1, "a number in [0, 1)"),
    "server_beta2": (BETA2, lambda v: _is_real(v) and 0 <= v < 1, "a number in [0, 1)"),
    "server_tau": (TAU, lambda v: _is_real(v) and 0 < v <= 1, "a number above 0 and at most 1"),
}


class Strategy:
    """One aggregation rule. ``aggregate`` returns the aggregated delta (float32, every spec key)."""

    name: str = ""
    shardable: bool = False  # by deltas: ``partial`` of shards of deltas, ``combine``d (the mean family with DP)
    shardable_by_coordinates: bool = False  # by coordinate spans (the robust rules; the mean family without DP)
    supports_dp: bool = False

    def check_params(self, params: dict | None) -> dict:
        """The params with defaults filled in; ValueError for an unknown name or a bad value."""
        params = dict(params or {})
        if params.get("dp") is None:
            params.pop("dp", None)  # "dp": null means off, for every strategy
        known = set(PARAMS) | ({"dp"} if self.supports_dp else set())
        unknown = sorted(set(params) - known)
        if "dp" in unknown:
            raise ValueError(f"{self.name} does not support server-side DP: use fedavg, fedbuff or ffa_lora")
        if unknown:
            raise ValueError(f"unknown {self.name} params {unknown}: accepted are {sorted(known)}")
        for key, (_, ok, wanted) in PARAMS.items():
            if key in params and not ok(params[key]):
                raise ValueError(f"{key} must be {wanted}, not {params[key]!r}")
        return {**{key: default for key, (default, _, _) in PARAMS.items()}, **params}

    def by_coordinates(self, params) -> bool:
        """Whether a round with these params is split across workers by coordinate spans (``spans``,
        ``span_partial``, ``assemble``) rather than by shards of deltas (``partial``, ``combine``)."""
        return self.shardable_by_coordinates

    def needs_gram(self, params) -> bool:
        """Whether a round split by coordinates needs the deltas' Gram matrix first (the distance rules)."""
        return False

    def aggregate(self, inputs, *, spec, base, params) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
