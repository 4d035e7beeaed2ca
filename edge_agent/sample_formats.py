"""Sample files of every format, read within the bounds of ``edge_agent.sample_bounds``: ``read_fields``.

JSON lines and CSV rows are read one at a time (each at most ``MAX_LINE_BYTES``), a ``.json`` document whole (at
most ``MAX_JSON_BYTES``), each sample's fields going straight into their dtype as it comes (``_Columns``); an
``.npz`` through ``edge_agent.sample_npz``, an image folder through ``edge_agent.sample_images``. ``read_fields``
returns a file's fields as arrays (``{"x": float32 (n, 1, 8, 8), "y": (n,)}``) for
``edge_agent.sample_files.check``, which holds them to the schema's ranges.
"""

from __future__ import annotations

import csv
import io
import os
import stat
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from edge_agent import bounded_json
from edge_agent.families.common import LABEL, SampleField
from edge_agent.sample_bounds import (
    LINK,
    MAX_DECODED_BYTES,
    MAX_FILE_BYTES,
    MAX_JSON_BYTES,
    MAX_LINE_BYTES,
    MAX_SAMPLES,
    MIB,
    SampleError,
    field_size,
    file_kind,
    mib,
    numeric_dtype,
    open_regular,
    real_numbers,
)
from edge_agent.sample_images import read_image_folder
from edge_agent.sample_npz import read_npz


class _Columns:
    """Samples that arrive one at a time (a JSON object, a CSV row), each field going straight into its dtype:
    what a file costs is its samples as the schema stores them, counted as they come. ``labelled``: True, every
    sample has its label; False, labels are not read (inputs to predict on); None, a sample without ``y`` (or with
    ``y`` null) is unlabeled, its label None."""

    def __init__(self, name: str, fields: dict[str, SampleField], *, labelled: bool | None):
        self.name, self.either = name, labelled is None
        self.fields = fields if labelled is not False else {k: f for k, f in fields.items() if k != LABEL}
        self.ignored = {LABEL} if labelled is False else set()
        self.values: dict[str, list] = {key: [] for key in self.fields}
        self.count, self.decoded = 0, 0

    def add(self, record: Any, where: str) -> None:
        if not isinstance(record, dict):
            raise SampleError(f"{self.name}: {where}: expected a JSON object, one per sample")
        unlabeled = self.either and record.get(LABEL) is None
        names = set(record) - self.ignored - ({LABEL} if unlabeled else set())
        wanted = {key for key in self.fields if not (unlabeled and key == LABEL)}
        if names != wanted:
            missing, unknown = sorted(wanted - names), sorted(names - wanted)
            need = f"samples need the fields {sorted(wanted)}: missing {missing}, unknown {unknown}"
            raise SampleError(f"{self.name}: {where}: {need}")
        if self.count >= MAX_SAMPLES:
            raise SampleError(f"{self.name}: more than {MAX_SAMPLES} samples in one file; hand them over in several")
        for key, field in self.fields.items():
            self.values[key].append(None if key not in wanted else self._value(key, field, record[key]))
        self.count += 1
        if self.decoded > MAX_DECODED_BYTES:
            raise SampleError(f"{self.name}: more than {mib(MAX_DECODED_BYTES)} of values; hand them over in several")

    def _value(self, key: str, field: SampleField, value: Any):
        where = f"sample {self.count}: "
        if field.dtype == "text":
            if not isinstance(value, str) or not value.strip():
                raise SampleError(f"{where}field {key!r} must be a non-empty text")
            self.decoded += sys.getsizeof(value)
            return value
        array = real_numbers(key, field, value, where)
        if array.size != field_size(field):
            raise SampleError(
                f"{where}field {key!r} has shape {list(array.shape)}; each sample needs {field.describe()}"
            )
        with np.errstate(over="ignore"):  # beyond float32 is inf, refused by the check as not finite
            array = array.astype(numeric_dtype(field, array.dtype)).reshape(field.shape)
        self.decoded += array.nbytes
        return array

    def arrays(self) -> dict:
        """The fields, each an array; of samples some of which are unlabeled, the labels a list with None for
        those (``edge_agent.sample_files.split_labelled``), and no labels when none has one."""
        if not self.count:
            raise SampleError(f"{self.name}: holds no samples")
        labels = self.values.get(LABEL, [])
        unlabeled = sum(label is None for label in labels)
        return {
            key: values
            if key == LABEL and unlabeled
            else np.asarray(values, dtype=object)
            if self.fields[key].dtype == "text"
            else np.stack(values)
            for key, values in self.values.items()
            if not (key == LABEL and unlabeled == len(labels))
        }


def bounded_lines(file: BinaryIO, name: str, size: int, *, limit: int = MAX_LINE_BYTES, each: str = "one sample"):
    """``(number, line)`` of a file, each line at most ``limit`` bytes, no more in all than the file's size
    when it was opened (a file still being written is not read past it)."""
    total = 0
    for number in range(1, sys.maxsize):
        line = file.readline(limit + 1)
        if not line:
            return
        total += len(line)
        if len(line) > limit:
            longest = mib(limit) if limit >= MIB else f"{limit:,} bytes"
            raise SampleError(f"{name}: line {number} is longer than {longest}; {each} a line")
        if total > size:
            raise SampleError(f"{name}: grew while it was read; write it under a .part name and rename it when whole")
        yield number, line


def _json_lines(file: BinaryIO, name: str, size: int, fields: dict, *, labelled: bool | None) -> dict:
    columns = _Columns(name, fields, labelled=labelled)
    for number, line in bounded_lines(file, name, size):
        if not line.strip():
            continue
        try:
            record = bounded_json.loads(line)
        except ValueError as error:  # not JSON, not UTF-8, too deep
            raise SampleError(f"{name}: line {number} cannot be read ({type(error).__name__}: {error})") from None
        columns.add(record, f"line {number}")
    return columns.arrays()


def _json(file: BinaryIO, name: str, size: int, fields: dict, *, labelled: bool | None) -> dict:
    text = file.read(MAX_JSON_BYTES + 1)
    if len(text) > min(size, MAX_JSON_BYTES):
        raise SampleError(f"{name}: grew while it was read; write it under a .part name and rename it when whole")
    records = bounded_json.loads(text)
    del text
    if not isinstance(records, list) or not records:
        raise SampleError(f"{name}: expected a list of JSON objects, one per sample")
    columns = _Columns(name, fields, labelled=labelled)
    for index in range(len(records)):
        columns.add(records[index], f"sample {index}")
        records[index] = None  # each sample's JSON goes as its arrays come
    return columns.arrays()


class _Rows:
    """A CSV file's lines for ``csv.reader``, no row (one or more lines, for quoted newlines) longer than
    ``MAX_LINE_BYTES`` characters, and no more in all than the file's size."""

    def __init__(self, text: io.TextIOBase, name: str, size: int):
        self.text, self.name, self.size = text, name, size
        self.row = self.total = 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = self.text.readline(MAX_LINE_BYTES + 1)
        if not line:
            raise StopIteration
        self.row, self.total = self.row + len(line), self.total + len(line)
        if self.row > MAX_LINE_BYTES:
            raise SampleError(f"{self.name}: a row longer than {mib(MAX_LINE_BYTES)}; one sample a row")
        if self.total > self.size:
            raise SampleError(f"{self.name}: grew while it was read; write it under a .part name, rename it when whole")
        return line


def _csv(file: BinaryIO, name: str, size: int, fields: dict, *, labelled: bool | None) -> dict:
    """A header row, then one sample a row: ``y`` is the label column, a text family's ``text`` column is the
    text, otherwise the other columns, in order, are the one input field's values. Read as UTF-8, with or without
    the byte order mark that Excel's "CSV UTF-8" writes. Where samples may be unlabeled (``labelled`` None), a
    file without a ``y`` column is all unlabeled, and a row with its ``y`` cell empty is."""
    inputs = [key for key in fields if key != LABEL]
    if len(inputs) != 1:
        raise SampleError(f"CSV carries one input field; this family takes {inputs}")
    lines = _Rows(io.TextIOWrapper(file, encoding="utf-8-sig", newline=""), name, size)
    reader = csv.reader(lines)
    header = next(reader, None)
    lines.row = 0
    if header is None:
        raise SampleError("a CSV file needs a header row and at least one sample")
    if LABEL not in header and labelled:  # (where samples may be unlabeled, all of this file's are)
        raise SampleError(f"the CSV header needs a {LABEL!r} column")
    label = header.index(LABEL) if LABEL in header else None
    text = fields[inputs[0]].dtype == "text"
    if text and inputs[0] not in header:
        raise SampleError(f"the CSV header needs a {inputs[0]!r} column")
    others = [header.index(inputs[0])] if text else [i for i in range(len(header)) if i != label]
    columns = _Columns(name, fields, labelled=labelled)
    for number, row in enumerate(reader, start=2):
        lines.row = 0
        if not row:
            continue
        if len(row) != len(header):
            raise SampleError(f"CSV row {number} has {len(row)} values, the header {len(header)}")
        try:
            values = row[others[0]] if text else [float(row[i]) for i in others]
            record = {inputs[0]: values}
            if label is not None and (labelled or (labelled is None and row[label].strip())):  # empty: unlabeled
                record[LABEL] = float(row[label])
        except ValueError as error:
            raise SampleError(f"CSV row {number}: {error}") from None
        columns.add(record, f"CSV row {number}")
    if not columns.count:
        raise SampleError("a CSV file needs a header row and at least one sample")
    return columns.arrays()


_READERS = {".npz": read_npz, ".jsonl": _json_lines, ".ndjson": _json_lines, ".json": _json, ".csv": _csv}
_CANNOT_READ = (ValueError, OSError, EOFError, zipfile.BadZipFile, csv.Error, struct.error, RecursionError)


def read_fields(path: Path, family, fields: dict[str, SampleField], *, labelled: bool | None = True) -> dict:
    """The fields of the samples in ``path`` (a file or an image folder), each an array in its dtype with one
    entry a sample, read within the bounds of ``edge_agent.sample_bounds``; not yet held to the schema's
    ranges. Whatever is wrong with the file is a ``SampleError``. ``labelled``: True, every sample needs its
    label; False, labels are not read; None, samples without a label are unlabeled (``_Columns``: no ``y`` when
    none has one, else a list with None for those without)."""
    path = Path(path)
    try:
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode):
            return read_image_folder(path, family, labelled=labelled)
        if stat.S_ISLNK(info.st_mode):
            raise SampleError(f"{path.name}: {LINK}")
        if not stat.S_ISREG(info.st_mode):
            raise SampleError(f"{path.name}: {file_kind(info.st_mode)}; the agent reads regular files and folders only")
        reader = _READERS.get(path.suffix.lower())
        if reader is None:
            raise SampleError(f"{path.name}: unknown format; use .npz, .jsonl, .json, .csv or an image folder")
        json_document = reader is _json  # parsed whole: a smaller bound
        limit = MAX_JSON_BYTES if json_document else MAX_FILE_BYTES
        hint = "; write larger sets as JSON lines (.jsonl)" if json_document else ""
        with open_regular(path, limit=limit, hint=hint) as file:
            return reader(file, path.name, os.fstat(file.fileno()).st_size, fields, labelled=labelled)
    except SampleError:
        raise
    except MemoryError:
        raise SampleError(f"{path.name}: too large to read") from None
    except _CANNOT_READ as error:  # JSON, zip, npy, decoding and file system errors
        raise SampleError(f"{path.name}: cannot be read ({type(error).__name__}: {error})") from None
