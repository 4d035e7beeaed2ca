"""Deltas read as flat runs of coordinates, straight from their files.

A round's deltas share a coordinate order (``CoordinateOrder``): the adapter's tensors in the order of their
bytes in the first delta's file, then the spec's tensors that file lacks (the FFA layout's ``lora_A``). Each
delta is checked once against the spec (its header parsed once, every key's dtype, scale and shape) and
becomes a list of pieces: runs of coordinates with where their bytes start in the file. Deltas written by one
agent version store their tensors in one order, so a delta is then one piece and a range of coordinates is
one ``pread`` into a preallocated array, decoded with one numpy operation: no per-tensor Python work, however
many small tensors a LoRA adapter has, and no file held open or mapped between reads, so memory is what the
caller allocates, whatever N is. A delta in another order, or lacking keys, has more pieces and reads the
same (absent keys read as zeros).

Reads check that every value is finite; the checks and their messages are those of ``base.check_header``.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from edge_agent.delta import ENCODINGS, FORMAT, read_encoding
from edge_agent.safetensors_header import loads_noting_repeats
from training.registry.artifacts import PassedHeaders
from training.registry.blobs import page_aligned

from .base import DeltaInput, Shape, check_inputs, check_keys, check_spec
from .kernels import sum_kernel

NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "I8": np.int8}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


def _framed_header(path: str, limit: int) -> tuple[bytes, int]:
    """The file's 8 bytes of framing and the header they announce (at most ``limit`` bytes), and its size."""
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) != 8:
            raise ValueError("the file is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > limit:
            raise ValueError("the header is too large")
        return prefix + file.read(length), os.fstat(file.fileno()).st_size


def _parse_framed(raw: bytes) -> tuple[dict, int]:
    """The header in ``raw`` (framing and header bytes: ``_framed_header``), a name given twice refused, and
    where the data section starts."""
    header, repeats = loads_noting_repeats(raw[8:])
    if repeats:
        raise ValueError(f"the header names {repeats[0].key!r} twice")
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, len(raw)


def read_header(path: str) -> tuple[dict, int]:
    """The safetensors header (a name given twice is refused) and where the data section starts."""
    return _parse_framed(_framed_header(path, MAX_HEADER_BYTES)[0])


@dataclass(frozen=True)
class CoordinateOrder:
    """Every coordinate of the adapter in one flat order: ``keys`` with ``starts[key]``, ``total`` in all."""

    keys: tuple[str, ...]
    starts: dict[str, int]
    shapes: dict[str, Shape]
    total: int

    @classmethod
    def of(cls, shapes: dict[str, Shape], first: str | None = None) -> CoordinateOrder:
        """The order of ``first``'s bytes (a delta file), then the spec keys it lacks, in spec order."""
        order: list[str] = []
        if first is not None:
            with contextlib.suppress(ValueError, OSError, TypeError, KeyError, IndexError):
                header, _ = read_header(first)
                stored = [(entry["data_offsets"][0], key) for key, entry in header.items() if key in shapes]
                order = [key for _, key in sorted(stored)]
        order += [key for key in shapes if key not in order]
        order = [key for key in order if math.prod(shapes[key])]
        starts, position = {}, 0
        for key in order:
            starts[key] = position
            position += math.prod(shapes[key])
        return cls(tuple(order), starts, dict(shapes), position)

    def key_at(self, coordinate: int) -> str:
        for key in reversed(self.keys):
            if self.starts[key] <= coordinate:
                return key
        raise IndexError(coordinate)

    def split(self, flat, keys=None) -> dict:
        """``flat`` (every coordinate in this order: a numpy array or a tensor) as one view per key, shaped by
        the spec, for ``keys`` (default all, in spec order); a key without coordinates is an empty array."""
        out = {}
        for key in self.shapes if keys is None else keys:
            if key in self.starts:
                start = self.starts[key]
                out[key] = flat[start : start + math.prod(self.shapes[key])].reshape(self.shapes[key])
            else:
                out[key] = flat[:0].reshape(self.shapes[key])
        return out


def coordinate_spans(total: int, count: int) -> list[tuple[int, int]]:
    """``count`` consecutive ranges of about equal size covering ``total`` coordinates (fewer when there are
    fewer coordinates): the unit of work a rule split by coordinates (the robust rules; the mean family
    without DP) splits into, on one worker or across a chord."""
    count = max(1, min(count, total))
    edges = [total * i // count for i in range(count + 1)]
    return [(edges[i], edges[i + 1]) for i in range(count)]


def spec_spans(spec, count: int) -> list[tuple[int, int]]:
    """``coordinate_spans`` over every coordinate of the adapter ``spec`` describes."""
    return coordinate_spans(sum(math.prod(shape) for shape in check_spec(spec).values()), count)


class KeyWriter:
    """Float32 tensors, one per spec key in ``order`` (each its own memory: safetensors stores no tensors that
    share it), written a run of coordinates at a time, straight into the keys the run covers."""

    def __init__(self, order: CoordinateOrder):
        self.order = order
        self.out = {key: torch.empty(shape, dtype=torch.float32) for key, shape in order.shapes.items()}
        self.flat = {key: tensor.view(-1).numpy() for key, tensor in self.out.items()}

    def write(self, at: int, values: np.ndarray) -> None:
        """Coordinates ``at : at + len(values)`` (any float dtype, rounded to float32 as torch's ``to`` does)."""
        end = at + len(values)
        for key in self.order.keys:
            start = self.order.starts[key]
            target = self.flat[key]
            low, high = max(at, start), min(end, start + len(target))
            if low < high:
                target[low - start : high - start] = values[low - at : high - at]


def assemble_spans(parts, *, spec, inputs) -> dict[str, torch.Tensor]:
    """The aggregated delta from its spans' values (``coordinate_spans``, in span order: a list or any
    iterable of float32 tensors), one float32 tensor per spec key. A key whose coordinates lie within one part is
    a view of that part, no copy (a chord's parts are mapped from their blobs, so the callback makes no new
    memory for them: new pages cost this host more than the copying; bench/README.md as of 9a8d7eb, "Measured: the spans
    joined in place"); a key across two parts is copied into its own tensor."""
    order = CoordinateOrder.of(check_spec(spec), check_inputs(inputs)[0].path)
    out: dict[str, torch.Tensor] = {}
    at = 0
    for part in parts:
        values = part.reshape(-1).to(torch.float32)
        end = at + values.numel()
        if end > order.total:  # too many coordinates: counted on, and refused below
            at = end
            continue
        for key in order.keys:
            start, shape = order.starts[key], order.shapes[key]
            stop = start + math.prod(shape)
            if stop <= at or start >= end:
                continue
            if at <= start and stop <= end:
                out[key] = values[start - at : stop - at].view(shape)
            else:
                target = out.setdefault(key, torch.empty(shape, dtype=torch.float32)).view(-1)
                low, high = max(at, start), min(end, stop)
                target[low - start : high - start] = values[low - at : high - at]
        at = end
    if at != order.total:
        raise ValueError(f"the spans hold {at} coordinates, the adapter has {order.total}")
    empty = torch.empty(0, dtype=torch.float32)
    return {key: out[key] if key in out else empty.reshape(shape) for key, shape in order.shapes.items()}


@dataclass(frozen=True)
class Piece:
    start: int  # first coordinate, in the round's order
    stop: int
    offset: int  # byte offset of coordinate ``start`` in the file
    dtype: str  # safetensors dtype (F32, F16, I8)
    scale: float | None  # int8: value = stored x scale


@dataclass(frozen=True)
class _FileFacts:
    """What a delta file's header says, once the safetensors library and ``read_header`` have read it."""

    encoding: str
    scales: dict
    header: dict
    data_start: int
    present: list[str]


# Headers read before (``PassedHeaders``): the library's read and the JSON parse run once per process rather
# than once per delta (the rest of a LoRA delta's setup, many small tensors, is per key).
_KNOWN: PassedHeaders[_FileFacts] = PassedHeaders()


def _file_facts(path: str, label: str) -> _FileFacts:
    try:  # the key to what is known: the header's bytes and the file's size, when they are plainly there
        key = _framed_header(path, _KNOWN.max_bytes)
    except (ValueError, OSError):
        key = None  # the full reading below says why
    if key is not None and (known := _KNOWN.get(key)) is not None:
        return known
    try:
        handle = safe_open(path, framework="np")
    except SafetensorError as exc:
        raise ValueError(f"{label} is not a readable safetensors file: {exc}") from None
    with handle as opened:
        metadata = opened.metadata() or {}
        present = list(opened.keys())
    if metadata.get("format", FORMAT) != FORMAT:
        raise ValueError(f"{label} is not a {FORMAT} file (format {metadata.get('format')!r})")
    try:
        encoding, scales = read_encoding(metadata)
    except ValueError as exc:
        raise ValueError(f"{label}: {exc}") from None
    try:
        header, data_start = _parse_framed(key[0]) if key is not None else read_header(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{label} is not a readable safetensors file: {exc}") from None
    facts = _FileFacts(encoding, scales, header, data_start, present)
    if key is not None and not scales:  # int8 headers hold their own scales
        _KNOWN.keep(key, facts)
    return facts


class FlatDelta:
    """One delta checked against the spec and cut into pieces of the round's coordinate order."""

    def __init__(self, inp: DeltaInput, index: int, order: CoordinateOrder, shared: dict | None = None):
        self.path = inp.path
        self.label = label = f"delta #{index} ({inp.path})"
        facts = _file_facts(inp.path, label)
        self.encoding = facts.encoding
        self.order = order
        # A header this round has checked and cut already (the same facts: ``_KNOWN``): the same keys and pieces,
        # shared, rather than the per-key checks again for each of a LoRA adapter's many small tensors.
        known = shared.get(id(facts)) if shared is not None else None
        if known is not None and known[0] is facts:
            self.keys, self.pieces = known[1], known[2]
            return
        scales, header, data_start, present = facts.scales, facts.header, facts.data_start, facts.present
        stored = ENCODINGS[self.encoding]
        shapes = order.shapes
        check_keys(label, present, shapes)
        for key in present:
            entry = header[key]
            if entry["dtype"] != stored:
                raise ValueError(
                    f"{label}: {key!r} is stored as {entry['dtype']}, its {self.encoding} encoding stores {stored}"
                )
            if self.encoding == "int8" and key not in scales:
                raise ValueError(f"{label}: the int8 tensor {key!r} has no scale in the metadata")
            shape = tuple(entry["shape"])
            if shape != shapes[key]:
                raise ValueError(f"{label}: {key!r} has shape {list(shape)}, the adapter's is {list(shapes[key])}")
        # The keys it holds, one set shared by the deltas that hold the same (memory flat in N).
        self.keys = shared.setdefault(tuple(present), frozenset(present)) if shared is not None else frozenset(present)
        pieces: list[Piece] = []
        itemsize = np.dtype(NUMPY_DTYPES[stored]).itemsize
        for key in order.keys:
            if key not in self.keys:
                continue
            start = order.starts[key]
            stop = start + math.prod(shapes[key])
            offset = data_start + header[key]["data_offsets"][0]
            scale = float(scales[key]) if self.encoding == "int8" else None
            last = pieces[-1] if pieces else None
            if (
                last is not None
                and last.stop == start
                and last.offset + (last.stop - last.start) * itemsize == offset
                and last.scale == scale
            ):
                pieces[-1] = Piece(last.start, stop, last.offset, stored, scale)
            else:
                pieces.append(Piece(start, stop, offset, stored, scale))
        self.pieces = pieces
        if shared is not None:
            shared[id(facts)] = (facts, self.keys, pieces)  # facts held here, so its id stays its own

    @contextlib.contextmanager
    def opened(self) -> Iterator[_OpenDelta]:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            yield _OpenDelta(self, fd)
        finally:
            os.close(fd)

    def read(self, start: int, stop: int, out: np.ndarray, *, check: bool = True) -> np.ndarray:
        with self.opened() as reader:
            return reader.read(start, stop, out, check=check)


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise ValueError("the file ended before its tensors did")
        done += got


class _OpenDelta:
    def __init__(self, delta: FlatDelta, fd: int):
        self.delta, self.fd = delta, fd

    def read(self, start: int, stop: int, out: np.ndarray, *, check: bool = True) -> np.ndarray:
        """Coordinates ``start:stop`` decoded to float32 into ``out`` (float32, at least that long; zeros where
        the delta has no tensor); ValueError naming the tensor when a value is NaN or infinite (unless not
        ``check``: the caller checks what it makes of the values, and reads again with the check if need be)."""
        target = out[: stop - start]
        covered = start
        for piece in self.delta.pieces:
            if piece.stop <= start or piece.start >= stop:
                continue
            first, last = max(start, piece.start), min(stop, piece.stop)
            if first > covered:
                target[covered - start : first - start] = 0
            into = target[first - start : last - start]
            dtype = NUMPY_DTYPES[piece.dtype]
            itemsize = np.dtype(dtype).itemsize
            offset = piece.offset + (first - piece.start) * itemsize
            if dtype is np.float32:
                _pread_into(self.fd, memoryview(into).cast("B"), offset)
            else:
                raw = np.empty(last - first, dtype=dtype)
                _pread_into(self.fd, memoryview(raw).cast("B"), offset)
                if piece.scale is not None:
                    np.multiply(raw, np.float32(piece.scale), out=into, dtype=np.float32)
                else:
                    into[:] = raw
            covered = last
        if covered < stop:
            target[covered - start :] = 0
        if check and not np.isfinite(target).all():
            bad = start + int(np.flatnonzero(~np.isfinite(target))[0])
            raise ValueError(f"{self.delta.label}: {self.delta.order.key_at(bad)!r} holds NaN or infinite values")
        return target


def open_flat(inputs: list[DeltaInput], shapes: dict[str, Shape]) -> tuple[CoordinateOrder, list]:
    """The round's coordinate order and every input checked and cut into pieces (one file open at a time)."""
    order = CoordinateOrder.of(shapes, inputs[0].path if inputs else None)
    shared: dict = {}
    return order, [FlatDelta(inp, index, order, shared) for index, inp in enumerate(inputs)]


def block_columns(n: int, budget_bytes: int, bytes_per_value: int, *, at_least: int = 1024) -> int:
    """How many coordinates of N deltas fit the budget at ``bytes_per_value`` per delta and coordinate (the
    gathered block and the temporaries of what runs on it)."""
    return max(at_least, budget_bytes // max(1, n * bytes_per_value))


# Coordinates read per step of a streaming pass (one delta at a time): 16 MiB of float32.
READ_COLUMNS = 1 << 22


def flat_norms(deltas: list[FlatDelta]) -> list[float]:
    """Each delta's L2 norm over all its coordinates, accumulated in float64."""
    total = deltas[0].order.total if deltas else 0
    columns = min(READ_COLUMNS, max(1, total))
    buffer = np.frombuffer(page_aligned(columns * 4), dtype=np.float32)
    widened = np.empty(columns, dtype=np.float64)  # one buffer for every read, not a new 32 MiB array each
    norms = []
    for delta in deltas:
        squares = 0.0
        with delta.opened() as reader:
            for start in range(0, total, READ_COLUMNS):
                values = reader.read(start, min(total, start + READ_COLUMNS), buffer)
                wide = widened[: len(values)]
                np.copyto(wide, values)
                squares += float(np.dot(wide, wide))
        norms.append(math.sqrt(squares))
    return norms


# Coordinates summed per step of a weighted sum: a block of the float64 sums (2 MiB) stays in the CPU's cache
# while every delta's values for it are added, where a whole-length sum would stream through memory once per
# delta (blocks of 262,144 added 100 deltas of 1M 10% faster than blocks of 131,072 or 524,288: fewer reads,
# each still within the last-level cache; bench/README.md, "aggregation.py").
SUM_COLUMNS = 1 << 18


# Deltas added into a block in one pass over it by the compiled loop (its most): the block's sums are read and
# written once per group rather than once per delta (100 x 1M: 0.076 to 0.081 s for the reads and additions,
# against 0.087 to 0.100 one delta at a time; bench/README.md as of 9a8d7eb, "Measured: the sum compiled").
SUM_GROUP = 4


def add_weighted_numpy(sums: np.ndarray, values: list[np.ndarray], weights: list[float], wide: np.ndarray) -> None:
    """``sums += weight * value`` for each of ``values`` in order, as ``sum_kernel.add_weighted`` computes it
    (the value widened to float64, the product rounded, then the sum): numpy's multiply, into ``wide`` (float64,
    at least as long), then add. Where the compiled module was not built (no C compiler), and the reference the
    tests hold it to."""
    for value, weight in zip(values, weights, strict=True):
        product = wide[: len(value)]
        np.multiply(value, np.float64(weight), out=product, dtype=np.float64)
        np.add(sums, product, out=sums)


def flat_weighted_sum(
    deltas: list[FlatDelta], weights: list[float], span: tuple[int, int] | None = None, *, finish=None
) -> np.ndarray | None:
    """``sum_i weights[i] * delta_i`` over the coordinates of ``span`` (default all), in float64, a block of
    coordinates at a time, the deltas in order within each (SUM_GROUP of them read, then added in one pass).
    Each element as ``sum_kernel.add_weighted`` computes it (the float32 value widened, times its weight rounded
    to float64, added rounded to float64, delta by delta, never fused), so the same bytes whatever the block's
    size, with or without the compiled module, and a span's sums are those coordinates' of the whole sum.
    Values are checked finite once per block, on the sums (finite values times finite weights add up to finite
    sums in float64); a block that is not is read again, checked, to name the delta and tensor.

    ``finish(start, sums)``: where given, each block's finished sums (the first coordinate, float64 values) go to
    it in turn, in one reused buffer, and nothing is returned (no float64 array of the whole span is made)."""
    if len(weights) != len(deltas):
        raise ValueError(f"{len(deltas)} deltas and {len(weights)} weights")
    first, last = span if span is not None else (0, deltas[0].order.total if deltas else 0)
    columns = min(SUM_COLUMNS, max(1, last - first))
    sums = np.zeros(last - first if finish is None else columns, dtype=np.float64)
    group = SUM_GROUP if sum_kernel is not None else 1
    buffers = [np.frombuffer(page_aligned(columns * 4), dtype=np.float32) for _ in range(min(group, len(deltas)))]
    wide = np.empty(columns, dtype=np.float64) if sum_kernel is None else None
    for start in range(first, last, SUM_COLUMNS):
        stop = min(last, start + SUM_COLUMNS)
        if finish is None:
            block = sums[start - first : stop - first]
        else:
            block = sums[: stop - start]
            block.fill(0.0)
        for at in range(0, len(deltas), group):
            batch = deltas[at : at + group]
            values = [
                delta.read(start, stop, buffer, check=False)
                for delta, buffer in zip(batch, buffers[: len(batch)], strict=True)
            ]
            if sum_kernel is not None:
                sum_kernel.add_weighted(block, values, weights[at : at + group])
            else:
                add_weighted_numpy(block, values, weights[at : at + group], wide)
        if not np.isfinite(block).all():
            for delta in deltas:
                delta.read(start, stop, buffers[0])  # the first delta with a NaN or infinite value is named
            raise ValueError("the weighted sum is not finite: a weight is not a finite number")
        if finish is not None:
            finish(start, block)
    return sums if finish is None else None


def flat_clip_factors(inputs: list[DeltaInput], deltas: list[FlatDelta], clip: float | None, *, recompute=False):
    """``base.clip_factors`` with the norms a delta lacks (or all, when ``recompute``) read flat."""
    if clip is None:
        return [1.0] * len(inputs)
    need = [i for i, inp in enumerate(inputs) if recompute or inp.norm is None]
    computed = dict(zip(need, flat_norms([deltas[i] for i in need]), strict=True))
    factors = []
    for index, inp in enumerate(inputs):
        norm = computed.get(index, inp.norm)
        factors.append(1.0 if norm <= clip else clip / norm)
    return factors
