"""The bounds within which the agent reads a sample file: what a file may cost is known before it is paid.

Files in the inbox are written by someone else, and no file may stop the agent or take its memory. Every format
(``edge_agent.sample_formats``, ``edge_agent.sample_npz``, ``edge_agent.sample_images``) is read under the same
rules:

- regular files and folders only, never through a symbolic link: ``lstat`` first, files opened with
  ``O_NOFOLLOW | O_NONBLOCK`` and checked again with ``fstat`` (``open_regular``), so a FIFO or a device is
  refused, not waited on or read forever;
- at most ``MAX_FILE_BYTES`` on disk, ``MAX_SAMPLES`` samples and ``MAX_DECODED_BYTES`` of values, each known
  before the memory is taken: an ``.npz`` is checked on its zip directory (each array's unpacked size) and each
  array's ``.npy`` header (shape and dtype, against the schema) before a byte of data is unpacked; JSON lines
  and CSV rows are read one at a time, each at most ``MAX_LINE_BYTES``; a ``.json`` document is at most
  ``MAX_JSON_BYTES``; an image's size, known once its header is read, is at most ``MAX_IMAGE_PIXELS`` before
  its pixels are decoded;
- values go straight into the schema's dtype (``float32`` for pixels, ``numeric_dtype``): no float64 copy of a
  file is made, and booleans, text and complex numbers are refused, not converted (``real_numbers``);
- JSON nested deeper than 64 levels is refused (``edge_agent.bounded_json``).

Whatever is wrong with a file is a ``SampleError`` naming the file and why.
"""

from __future__ import annotations

import errno
import math
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from edge_agent.families.common import SampleField

MIB = 2**20
MAX_SAMPLES = 100_000  # a single file or call; larger sets come in several
MAX_FILE_BYTES = 256 * MIB  # on disk: a file, or an image folder's images together
MAX_DECODED_BYTES = 64 * MIB  # a file's values once read (an .npz's arrays as stored)
MAX_LINE_BYTES = 1 * MIB  # a JSON line or CSV row: one sample
MAX_JSON_BYTES = 4 * MIB  # a .json document is parsed whole; larger sets come as JSON lines
MAX_IMAGE_PIXELS = 4096 * 4096  # decoded, an image takes up to 4 bytes a pixel (64 MiB at this size)

LINK = "a symbolic link; the agent reads regular files and folders only and never follows a link (copy the file in)"
KINDS = {
    "b": "booleans",
    "c": "complex numbers",
    "U": "text",
    "S": "bytes",
    "M": "dates",
    "m": "durations",
    "V": "records",
}


class SampleError(ValueError):
    """A batch or file that does not fit the family's schema; the message says what and where."""


def mib(size: int) -> str:
    return f"{size / MIB:,.1f} MiB"


def field_size(field: SampleField) -> int:
    return math.prod(field.shape)


def real_numbers(name: str, field: SampleField, values: Any, where: str = "") -> np.ndarray:
    """``values`` as an array of real numbers (integers or floats), not yet in the field's dtype or shape;
    booleans, text, complex numbers and anything else are refused, saying which."""
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor, whatever device or grad it has
        values = values.detach().cpu().numpy()
    try:
        array = values if isinstance(values, np.ndarray) else np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        raise SampleError(f"{where}field {name!r} must hold numbers ({field.describe()})") from None
    kind = array.dtype.kind
    if kind not in "iuf" or array.dtype.itemsize > 8:
        what = KINDS.get(kind) or (str(array.dtype) if kind in "iuf" else None)
        raise SampleError(
            f"{where}field {name!r} must hold numbers ({field.describe()})" + (f", not {what}" if what else "")
        )
    return array


def numeric_dtype(field: SampleField, source: np.dtype) -> np.dtype:
    """What a numeric field is read into: float32 for float32 fields; int64 for integer fields, or float64 while
    values written as floats wait for the check that they are whole numbers."""
    if field.dtype == "float32":
        return np.dtype(np.float32)
    return np.dtype(np.float64 if source.kind == "f" else np.int64)


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path, *, limit: int = MAX_FILE_BYTES, hint: str = "") -> BinaryIO:
    """``path`` open for reading when it is a regular file of at most ``limit`` bytes, else ``SampleError``. A
    link is not followed (``O_NOFOLLOW``) and a FIFO does not block the open (``O_NONBLOCK``); ``fstat`` then
    says what was opened."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_BINARY", 0))
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise SampleError(f"{path.name}: {LINK}") from None
        raise SampleError(f"{path.name}: cannot be opened ({error.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SampleError(f"{path.name}: {file_kind(info.st_mode)}; the agent reads regular files and folders only")
        if info.st_size > limit:
            raise SampleError(f"{path.name}: {mib(info.st_size)}, more than the {mib(limit)} a file may be{hint}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
