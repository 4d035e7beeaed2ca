"""A delta file's contents checked in one pass over its stored bytes (``contents_check``): hashed and counted
while read, the header against the adapter's spec (and the safetensors library's own check), then every value
decoded, checked finite and added to the L2 norm. Memory is bounded whatever the file's size. Run by
verification (``training.federation.verification``) after the checks on the device and its counter.

The norm's squares are summed in float64 by the compiled loop (``sum_kernel.squares``, one call per read; each
square exact, finite exactly when every value is). Where the install built no C extension
(``training.federation.strategies.kernels``), each slice's sum of squares is one float32 BLAS dot product, the
slices added in float64 (within 1e-4 of the exact norm, relative, when every value is alike, the worst case;
about 1e-7 for values spread as updates are), and a slice whose float32 sum is not finite is summed again in
float64. Either way a finite value whose square is past float32's range is a large norm, not a bad value. The
norm is compared with a bound and scales a clip (stored with the delta: every aggregation worker uses the same);
DP recomputes its own in float64.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import io
import math
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np
import torch
from safetensors import safe_open

from edge_agent.delta import ENCODINGS, read_encoding
from training.federation.aggregation_settings import aggregation_settings
from training.federation.strategies.kernels import sum_kernel
from training.models import Adapter
from training.registry.artifacts import (
    ArtifactRejected,
    PassedHeaders,
    check_spec,
    data_layout,
    header_length,
    parse_header,
)
from training.registry.blobs import CHUNK, page_aligned


@dataclass(frozen=True)
class Rejection(Exception):
    code: str
    detail: str


def delta_spec(adapter: Adapter, encoding: str) -> dict[str, dict]:
    """The tensors a delta for this adapter must hold, in the dtype its encoding stores."""
    settings_ = aggregation_settings(adapter)
    ffa = settings_["ffa"] or settings_["strategy"] == "ffa_lora"
    dtype = ENCODINGS[encoding]
    return {
        name: {"shape": entry["shape"], "dtype": dtype}
        for name, entry in adapter.tensor_spec.items()
        if not (ffa and ".lora_A." in name)
    }


# Values decoded at a time (f16, int8, a misaligned data section: into one float32 buffer per thread), and, without
# the compiled loop, summed at a time: one float32 BLAS dot product on torch's threads (one in a worker); widening
# every slice to float64 first took twice as long as the product itself, and numpy's einsum twice as long again
# (bench/README.md, "aggregation.py"). Aligned stored float32 values (f32, most of the time) are summed where they
# lie: by the compiled loop a read at a time, else a slice at a time.
DECODE_SLICE = 1 << 16
_STORED = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "I8": np.dtype("i1")}


class _Buffers(threading.local):
    """One read buffer, one float32 slice and one float64 slice per thread, reused by every file it checks (new
    ones for each delta are new pages to fault in, each time: glibc maps allocations this size afresh)."""

    def __init__(self):
        self.read = page_aligned(CHUNK)
        self.narrow = np.empty(DECODE_SLICE, dtype=np.float32)  # a slice decoded (f16, int8 times its scale)
        self.wide = torch.empty(DECODE_SLICE, dtype=torch.float64)  # a slice summed again in float64
        self.wide_values = self.wide.numpy()  # the same memory, written by numpy


_BUFFERS = _Buffers()


class _ShortFile(Exception):
    """The stored file ended before the bytes its signed size promises (the size check then says so)."""


class _Stream:
    """The stored file read once, front to back, CHUNK bytes at a time into one reused buffer, each read hashed
    and counted. A view it hands out holds until the next read (a new 1 MiB object per read, and copies of what
    was left of one, cost as much as decoding the values: bench/README.md, "aggregation.py")."""

    def __init__(self, handle: BinaryIO):
        self.handle = handle
        self.digest = hashlib.sha256()
        self.size = 0
        self.buffer = _BUFFERS.read  # this thread's: one check at a time
        self.into = True  # the handle fills the buffer (``readinto``); else each read is a new object
        self.pending = memoryview(b"")  # read and hashed, not yet taken

    def _read(self) -> memoryview:
        chunk = None
        if self.into:
            try:
                count = self.handle.readinto(self.buffer)
            except (AttributeError, NotImplementedError, io.UnsupportedOperation):
                self.into = False  # a stream without readinto (S3's, some wrappers): read() from now on
            else:
                chunk = memoryview(self.buffer)[: count or 0]
        if chunk is None:
            chunk = memoryview(self.handle.read(CHUNK))
        if chunk:
            self.digest.update(chunk)
            self.size += len(chunk)
        return chunk

    def take(self, count: int) -> bytes:
        """The next ``count`` bytes (the framing and the header: at most MAX_HEADER_BYTES + 8), copied."""
        parts, have, pending = [], 0, self.pending
        while have + len(pending) < count:
            parts.append(bytes(pending))  # the buffer is read into again below
            have += len(pending)
            pending = self._read()
            if not pending:
                self.pending = pending
                raise _ShortFile
        parts.append(bytes(pending[: count - have]))
        self.pending = pending[count - have :]
        return b"".join(parts)

    def rest(self) -> Iterator[memoryview]:
        """The bytes after those taken, a chunk at a time (each view holds until the next is asked for)."""
        if self.pending:
            yield self.pending
            self.pending = memoryview(b"")
        while chunk := self._read():
            yield chunk


class _Values:
    """The data section's values as its bytes stream past (tensors in the order they lie, ``layout``): each
    decoded to float32 as ``edge_agent.delta.decode_tensor`` does (int8 times its tensor's scale, in float32),
    checked finite, and its square summed in float64. Holds a few bytes of a value split between two reads and
    at most DECODE_SLICE values decoded at a time.

    Float encodings (f32, f16) have no per-tensor scale, so their values are taken a read at a time, across
    tensor boundaries: a few numpy calls per MiB rather than per tensor, which for a LoRA delta of many small
    tensors was most of the decoding's time (bench/README.md, "aggregation.py"). The tensor a bad value lies
    in is found from its position only when there is one. int8 values are taken a tensor at a time, each with
    its own scale."""

    def __init__(self, layout: list[tuple[str, int, int]], encoding: str, scales: dict[str, float]):
        self.layout = layout
        self.stored = _STORED[ENCODINGS[encoding]]
        self.width = self.stored.itemsize
        with np.errstate(over="ignore"):  # a scale past float32's range is inf, as in torch: not finite
            self.scales = {name: np.float32(scale) for name, scale in scales.items()} if encoding == "int8" else {}
        self.by_read = encoding != "int8"
        self.starts = [start for _, start, _ in layout]
        self.end = layout[-1][2] if layout else 0  # the data section's length
        self.seen = 0  # its bytes seen so far
        self.index = 0  # int8: the tensor the next byte belongs to
        self.done = 0  # int8: its bytes seen so far
        self.carry = b""  # the start of a value split between two reads
        self.squares = 0.0
        self.narrow = _BUFFERS.narrow  # a slice decoded to float32
        self.wide, self.wide_values = _BUFFERS.wide, _BUFFERS.wide_values  # a slice summed again in float64

    def feed(self, view: memoryview) -> None:
        if self.by_read:
            view = view[: self.end - self.seen]
            self._bytes(None, view)
            self.seen += len(view)
            return
        while len(view) and self.index < len(self.layout):
            name, start, end = self.layout[self.index]
            part = view[: end - start - self.done]
            view = view[len(part) :]
            self._bytes(name, part)
            self.seen += len(part)
            self.done += len(part)
            if self.done == end - start:
                self.index, self.done = self.index + 1, 0

    def _bytes(self, name: str | None, part: memoryview) -> None:
        at = self.seen - len(self.carry)  # where in the data section the next value starts
        if self.carry:
            head = self.carry + bytes(part[: self.width - len(self.carry)])
            part = part[self.width - len(self.carry) :]
            if len(head) < self.width:
                self.carry = head
                return
            self.carry = b""
            self._sum(name, head, at)
            at += self.width
        whole = len(part) - len(part) % self.width
        if whole:
            self._sum(name, part[:whole], at)
        if whole < len(part):
            self.carry = bytes(part[whole:])

    def _sum(self, name: str | None, data, at: int) -> None:
        """Add the squares of ``data``'s values (of tensor ``name``, or of whichever tensors they belong to when
        None; the first starts ``at`` bytes into the data section)."""
        values = np.frombuffer(data, dtype=self.stored)
        scale = self.scales.get(name)
        stored = scale is None and values.dtype == np.float32 and values.flags.aligned
        if sum_kernel is not None and stored:  # one call for the whole read, in float64
            squares = sum_kernel.squares(values)
            if not math.isfinite(squares):
                self._bad_value(name, values, at)
            self.squares += squares
            return
        for first in range(0, len(values), DECODE_SLICE):
            part = values[first : first + DECODE_SLICE]
            if not stored or not part.flags.writeable:
                narrow = self.narrow[: len(part)]
                with np.errstate(all="ignore"):  # an int8 value times its scale past float32's range: below
                    if scale is not None:  # in float32, as edge_agent.delta.decode_tensor
                        np.multiply(part, scale, out=narrow, dtype=np.float32)
                    else:
                        np.copyto(narrow, part)
                part = narrow
            if sum_kernel is not None:
                squares = sum_kernel.squares(part)
                if not math.isfinite(squares):
                    self._bad_value(name, part, at + first * self.width)
            else:
                tensor = torch.from_numpy(part)
                squares = float(torch.dot(tensor, tensor))
                if not math.isfinite(squares):
                    squares = self._wide_squares(name, part, at + first * self.width)
            self.squares += squares

    def _bad_value(self, name: str | None, part: np.ndarray, at: int) -> None:
        """Refuse the delta, naming the tensor that holds ``part``'s first value that is not finite (float32
        values, the first ``at`` bytes into the data section)."""
        bad = name or self._tensor_at(at + int(np.flatnonzero(~np.isfinite(part))[0]) * self.width)
        raise Rejection("not_finite", f"tensor {bad!r} holds NaN or infinite values")

    def _wide_squares(self, name: str | None, part: np.ndarray, at: int) -> float:
        """The sum of squares of ``part`` (float32 values, the first ``at`` bytes into the data section) in
        float64, where float32's was not finite: finite exactly when every value is (a float32 value's square is
        exact in float64), else the tensor holding the first bad value is named."""
        wide = self.wide_values[: len(part)]
        np.copyto(wide, part)
        tensor = self.wide[: len(part)]
        squares = float(torch.dot(tensor, tensor))
        if not math.isfinite(squares):
            self._bad_value(name, part, at)
        return squares

    def _tensor_at(self, offset: int) -> str:
        return self.layout[bisect.bisect_right(self.starts, offset) - 1][0]


def _library_message(exc: Exception) -> str:
    """The safetensors library's refusal as ``safetensors.torch.load`` words it (``safe_open`` reads the same
    header with the same checks and words it "Error while deserializing header: ...")."""
    text = str(exc)
    prefix = "Error while deserializing header: "
    return "Error while deserializing: " + text[len(prefix) :] if text.startswith(prefix) else text


def _library_check(path: str | None, head: bytes, size: int) -> None:
    """What the safetensors library refuses in the header that ``parse_header`` lets through (a metadata value
    that is not a string, a gap between tensors, JSON Python reads and serde does not), found by its own header
    check: ``safe_open`` on the stored file (``path``) maps it and reads only the header; without a local file
    (S3), on a sparse temporary file of the same size holding only the header (``head``, the framing included).
    Nothing else of the file is read."""
    try:
        if path is not None:
            with safe_open(path, framework="np"):
                return
        with tempfile.NamedTemporaryFile(prefix="delta-header-", suffix=".safetensors") as sparse:
            sparse.write(head)
            sparse.truncate(size)
            sparse.flush()
            with safe_open(sparse.name, framework="np"):
                return
    except Exception as exc:
        raise Rejection("malformed", f"safetensors could not read the file: {_library_message(exc)}") from None


# Adapters a kept header was seen to match, remembered with it: the last few.
MATCHED_SPECS = 4


@dataclass(frozen=True)
class _Header:
    """What a header that passed every check independent of the adapter says: its tensors, encoding, int8
    scales and where each tensor's bytes lie; and copies of the adapters' specs and aggregation settings it was
    seen to match (``matches``): the same header against an equal spec passes again without comparing it tensor
    by tensor (one comparison of two dicts, in C, where the check takes 1.5 µs a tensor in Python: a tenth of a
    LoRA delta's time outside hashing, bench/README.md, "aggregation.py")."""

    header: dict[str, dict]
    encoding: str
    scales: dict[str, float]
    layout: list[tuple[str, int, int]]
    matched: list[tuple[dict, dict | None]] = field(default_factory=list, compare=False)

    def matches(self, adapter: Adapter) -> bool:
        return any(
            spec == adapter.tensor_spec and aggregation == adapter.aggregation for spec, aggregation in self.matched
        )

    def remember(self, adapter: Adapter) -> None:
        seen = (copy.deepcopy(adapter.tensor_spec), copy.deepcopy(adapter.aggregation))
        self.matched[:] = [*self.matched[-(MATCHED_SPECS - 1) :], seen]


# Headers seen to pass every check independent of the adapter (most of the time a LoRA delta of many small
# tensors spends outside hashing its values: the JSON, the entries, the library's check).
_PASSED: PassedHeaders[_Header] = PassedHeaders()


def _check_header(head: bytes, header_size: int, size: int, adapter: Adapter, path: str | None) -> _Header:
    """The header's checks in the documented order: the header itself (limits, JSON, no key twice, entries,
    offsets), the encoding, the adapter's spec, the int8 scales, the library's own header check, the layout.
    A header seen to pass before (``_PASSED``) runs only the checks that depend on the adapter, and the spec's
    only against an adapter it has not matched (``_Header.matches``: an equal spec and equal settings)."""
    facts = _PASSED.get((head, size))
    if facts is None:
        try:
            header, metadata = parse_header(head[8:], size - 8 - header_size)
            encoding, scales = read_encoding(metadata if metadata and isinstance(metadata, dict) else {})
        except ArtifactRejected as exc:
            code = exc.code if exc.code in ("header_too_large", "duplicate_tensor") else "malformed"
            raise Rejection(code, str(exc)) from None
        except ValueError as exc:
            raise Rejection("malformed", str(exc)) from None
    else:
        header, encoding, scales = facts.header, facts.encoding, facts.scales
    matched = facts is not None and facts.matches(adapter)
    if not matched:
        try:
            check_spec(header, delta_spec(adapter, encoding))
        except ArtifactRejected as exc:
            raise Rejection("spec_mismatch", str(exc)) from None
    if encoding == "int8" and set(scales) != set(header):
        raise Rejection("malformed", "an int8 delta needs one scale per tensor")
    if facts is None:
        _library_check(path, head, size)
        try:
            layout = data_layout(header, size - 8 - header_size)
        except ArtifactRejected as exc:
            raise Rejection("malformed", str(exc)) from None
        facts = _Header(header, encoding, scales, layout)
        if not scales:  # an int8 header holds its delta's own scales
            _PASSED.keep((head, size), facts)
    if not matched and not scales:
        facts.remember(adapter)
    return facts


def _read_contents(stream: _Stream, size: int, adapter: Adapter, path: str | None) -> tuple[str, float]:
    """The checks on the file's bytes, in the documented order, as the stream passes: the framing, the header
    (``_check_header``), then the data: finite values and the norm bound."""
    prefix = stream.take(min(size, 8))
    try:
        header_size = header_length(prefix, size)
    except ArtifactRejected as exc:
        raise Rejection(exc.code if exc.code == "header_too_large" else "malformed", str(exc)) from None
    head = prefix + stream.take(header_size)
    facts = _check_header(head, header_size, size, adapter, path)
    values = _Values(facts.layout, facts.encoding, facts.scales)
    for chunk in stream.rest():
        values.feed(chunk)
    norm = math.sqrt(values.squares)
    bound = aggregation_settings(adapter)["max_norm"]
    if bound is not None and norm > bound:
        raise Rejection("norm_too_large", f"the update's L2 norm is {norm:.4g}; the adapter's bound is {bound:.4g}")
    return facts.encoding, norm


def contents_check(
    handle: BinaryIO, *, size: int, sha256: str, adapter: Adapter, path: str | None = None
) -> tuple[str, float]:
    """Check a delta file's contents against ``adapter`` in one pass over ``handle`` (its stored bytes, read in
    CHUNK reads; ``path``: the same file on local disk, if it is there): ``(encoding, L2 norm)``, or the first
    failed check as a ``Rejection``. The bytes are hashed and counted on the way; if they are not the ``size``
    bytes of ``sha256`` the signature covers, that is the answer (``hash_mismatch``, before any finding on the
    contents, which are then not the signed file's). Memory, whatever the file's size: the header (at most 1 MiB),
    a read or two (1 MiB each) and a DECODE_SLICE of values decoded (256 KiB) and widened (512 KiB)."""
    stream = _Stream(handle)
    found: Rejection | None = None
    try:
        encoding, norm = _read_contents(stream, size, adapter, path)
    except Rejection as rejection:
        found = rejection
    except _ShortFile:
        pass  # the size check below tells
    for _ in stream.rest():  # the rest of a refused file, for its hash
        pass
    if stream.size != size:
        raise Rejection("hash_mismatch", f"{stream.size} bytes stored, the envelope says {size}")
    if stream.digest.hexdigest() != sha256:
        raise Rejection("hash_mismatch", "the stored bytes do not hash to the signed sha256")
    if found is not None:
        raise found
    return encoding, norm
