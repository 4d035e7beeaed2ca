"""An ``.npz`` (as ``numpy.savez`` writes: a zip of one ``.npy`` array a field) read within bounds.

A small zip can unpack to gigabytes and an ``.npy`` header can declare any shape, so neither is trusted with memory:
no read of the file is larger than ``MAX_ZIP_READ`` (a zip reader reads the central directory in one read of the
size the zip declares: five million entries, a few hundred bytes of objects each, fit in 250 MB on disk); the
arrays' unpacked sizes in the zip directory are at most ``MAX_DECODED_BYTES`` together; each array's header (shape
and dtype) is held to the schema and to the bytes the array holds before any data is unpacked; the data is then
read ``CHUNK_BYTES`` at a time straight into the field's dtype.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile
from typing import BinaryIO

import numpy as np

from edge_agent.families.common import LABEL, SampleField
from edge_agent.sample_bounds import (
    KINDS,
    MAX_DECODED_BYTES,
    MAX_SAMPLES,
    SampleError,
    field_size,
    mib,
    numeric_dtype,
)

MAX_ZIP_READ = 2 * 2**20  # the zip directory and records; data comes CHUNK_BYTES at a time
CHUNK_BYTES = 2**20
NPY_MAGIC = b"\x93NUMPY"
NPY_MAX_HEADER = 10_000  # numpy's own bound on an .npy header


class _SmallReads:
    """A file whose every read is at most ``MAX_ZIP_READ`` bytes, handed to ``zipfile``: it reads a zip's central
    directory in one read of the size the zip declares (five million entries, a few hundred bytes of objects each,
    fit in 250 MB on disk), so a directory larger than any .npz of a few arrays needs is refused at that read."""

    def __init__(self, file: BinaryIO, name: str):
        self.file, self.name = file, name

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:  # the rest of the file
            at = self.file.tell()
            size = self.file.seek(0, os.SEEK_END) - at
            self.file.seek(at)
        if size > MAX_ZIP_READ:
            raise SampleError(
                f"{self.name}: its zip directory or a record in it is {mib(size)}; an .npz of a few arrays needs "
                "a few hundred bytes"
            )
        return self.file.read(size)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def seekable(self) -> bool:
        return True


def _read_exactly(stream, size: int, what: str) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise SampleError(f"{what} is cut short")
    return data


def _npy_header(stream, key: str) -> tuple[tuple, bool, np.dtype]:
    """Shape, Fortran order and dtype of an ``.npy`` array, read from its header (at most ``NPY_MAX_HEADER``
    bytes, with numpy's own parser) and nothing of its data."""
    magic = _read_exactly(stream, 8, f"{key}.npy")
    if magic[:6] != NPY_MAGIC or magic[6] not in (1, 2):
        raise SampleError(f"{key}.npy: not an array numpy.savez writes (.npy format 1.0 or 2.0)")
    length_format = "<H" if magic[6] == 1 else "<I"
    length_bytes = _read_exactly(stream, struct.calcsize(length_format), f"{key}.npy")
    (length,) = struct.unpack(length_format, length_bytes)
    if length > NPY_MAX_HEADER:
        raise SampleError(f"{key}.npy: a header of {length} bytes; numpy writes at most {NPY_MAX_HEADER}")
    header = io.BytesIO(length_bytes + _read_exactly(stream, length, f"{key}.npy's header"))
    parse = np.lib.format.read_array_header_1_0 if magic[6] == 1 else np.lib.format.read_array_header_2_0
    try:
        shape, fortran, dtype = parse(header)
    except (ValueError, SyntaxError, RecursionError, TypeError) as error:
        raise SampleError(f"{key}.npy: its header cannot be read ({error})") from None
    return shape, fortran, dtype


def _npy_fits(key: str, field: SampleField, shape: tuple, dtype: np.dtype) -> None:
    """The array a header declares, held to the schema before any of it is read."""
    if dtype.hasobject or dtype.names is not None:
        raise SampleError(f"field {key!r} must hold plain numbers ({field.describe()}), not {dtype}")
    if field.dtype == "text":
        if dtype.kind != "U":
            raise SampleError(f"field {key!r} must hold texts, not {KINDS.get(dtype.kind, dtype)}")
    elif dtype.kind not in "iuf" or dtype.itemsize > 8:
        raise SampleError(f"field {key!r} must hold numbers ({field.describe()}), not {KINDS.get(dtype.kind, dtype)}")
    if not shape or any(n < 0 for n in shape):
        raise SampleError(f"field {key!r} has shape {list(shape)}; each sample needs {field.describe()}")
    if shape[0] > MAX_SAMPLES:
        raise SampleError(f"field {key!r} holds {shape[0]} samples; at most {MAX_SAMPLES} a file")
    if math.prod(shape[1:]) != (1 if field.dtype == "text" else field_size(field)):
        raise SampleError(f"field {key!r} has shape {list(shape)}; each sample needs {field.describe()}")


def _npy(archive: zipfile.ZipFile, info: zipfile.ZipInfo, key: str, field: SampleField) -> np.ndarray:
    with archive.open(info) as stream:
        shape, fortran, dtype = _npy_header(stream, key)
        _npy_fits(key, field, shape, dtype)
        items = math.prod(shape)
        declared, held = items * dtype.itemsize, info.file_size - stream.tell()
        if declared != held:
            raise SampleError(f"{key}.npy declares {list(shape)} {dtype} ({declared:,} bytes) and holds {held:,}")
        target = dtype if field.dtype == "text" else numeric_dtype(field, dtype)
        out = np.empty(items, dtype=target)
        step = max(CHUNK_BYTES // dtype.itemsize, 1)
        for start in range(0, items, step):
            count = min(step, items - start)
            chunk = np.frombuffer(_read_exactly(stream, count * dtype.itemsize, f"{key}.npy"), dtype=dtype)
            with np.errstate(over="ignore", invalid="ignore"):  # beyond float32 is inf: refused by the check
                out[start : start + count] = chunk
        if stream.read(1):  # also where zipfile checks the CRC
            raise SampleError(f"{key}.npy holds more than its header declares")
    return out.reshape(shape[::-1]).T if fortran else out.reshape(shape)


def read_npz(file: BinaryIO, name: str, size: int, fields: dict, *, labelled: bool | None) -> dict:
    """One ``.npy`` array a field (as ``numpy.savez`` writes), samples along the first axis; an image field may
    come flattened (64 values for the digits). Where samples may be unlabeled (``labelled`` None), a file without
    ``y`` is all unlabeled."""
    with zipfile.ZipFile(_SmallReads(file, name)) as archive:
        members: dict[str, zipfile.ZipInfo] = {}
        for info in archive.infolist():
            key = info.filename.removesuffix(".npy")
            if key in members:
                raise SampleError(f"{name}: holds {info.filename!r} twice")
            members[key] = info
        if labelled is None:
            labelled = LABEL in members
        wanted = fields if labelled else {k: f for k, f in fields.items() if k != LABEL}
        present = set(members) - (set() if labelled else {LABEL})
        if present != set(wanted):
            missing, unknown = sorted(set(wanted) - present), sorted(present - set(wanted))
            raise SampleError(f"samples need the fields {sorted(wanted)}: missing {missing}, unknown {unknown}")
        unpacked = sum(members[key].file_size for key in wanted)
        if unpacked > MAX_DECODED_BYTES + NPY_MAX_HEADER * len(wanted):
            raise SampleError(f"{name}: its arrays unpack to {mib(unpacked)}; at most {mib(MAX_DECODED_BYTES)} a file")
        return {key: _npy(archive, members[key], key, field) for key, field in wanted.items()}
