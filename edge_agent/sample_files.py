"""Samples handed to the agent by the device's application: checked against the family's schema, then stored.

A family declares what it takes (``sample_fields(config)``: per field a shape, a dtype and a range; the label
is ``y``) and how those fields become the model's inputs (``encode_samples``). ``check`` holds a batch to the
schema and refuses it whole with a ``SampleError`` naming the first field and sample that does not fit, so a
bad batch stores nothing. Files (``read_samples``):

- ``.npz``: one array per field, samples along the first axis (an image field may come flattened, 64 values);
- ``.jsonl`` / ``.ndjson``: one JSON object per line, ``{"x": [[...]], "y": 3}`` or ``{"text": "...", "y": 1}``;
- ``.json``: a list of such objects;
- ``.csv``: a header row; ``y`` is the label column, a text family's ``text`` column is the text, otherwise the
  other columns, in order, are the one input field's values (64 pixels for the digits);
- a folder of image folders named by label (``7/photo.png``), for families that take images.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np

from edge_agent.families.common import LABEL, SampleField

MAX_SAMPLES = 100_000  # a single file or call; larger sets come in several
MAX_FILE_BYTES = 256 * 1024 * 1024
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".pgm")


class SampleError(ValueError):
    """A batch or file that does not fit the family's schema; the message says what and where."""


def _numbers(name: str, field: SampleField, values, count: int) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise SampleError(f"field {name!r} must hold numbers ({field.describe()})") from None
    size = int(np.prod(field.shape)) if field.shape else 1
    if array.shape[:1] != (count,) or array[0:1].size not in (0, size):
        raise SampleError(f"field {name!r} has shape {list(array.shape)}; each sample needs {field.describe()}")
    array = array.reshape((count, *field.shape))
    bad = ~np.isfinite(array)
    if field.low is not None:
        bad |= array < field.low
    if field.high is not None:
        bad |= array > field.high
    if field.dtype == "int64":
        bad |= array != np.round(array)
    if bad.any():
        sample = int(np.argwhere(bad)[0][0])
        raise SampleError(
            f"sample {sample}: field {name!r} holds {array[sample].ravel()[:4].tolist()}..., outside {field.describe()}"
            if array[sample].size > 1
            else f"sample {sample}: field {name!r} is {array[sample].item()!r}, outside {field.describe()}"
        )
    return array.astype(np.float32 if field.dtype == "float32" else np.int64)


def check(fields: dict[str, SampleField], samples: dict, *, labelled: bool = True) -> dict[str, np.ndarray]:
    """``samples`` (field -> values, one per sample) held to ``fields``; returns them as typed arrays. Without
    ``labelled`` (inputs to predict on) the label is not asked for."""
    if not isinstance(samples, dict):
        raise SampleError("samples must be an object of fields")
    if not labelled:
        fields = {name: field for name, field in fields.items() if name != LABEL}
    missing, unknown = sorted(set(fields) - set(samples)), sorted(set(samples) - set(fields))
    if missing or unknown:
        raise SampleError(f"samples need the fields {sorted(fields)}: missing {missing}, unknown {unknown}")
    counts = {name: len(values) if hasattr(values, "__len__") else -1 for name, values in samples.items()}
    count = next(iter(counts.values()), 0)
    if count <= 0 or len(set(counts.values())) != 1:
        raise SampleError(f"every field needs the same number (> 0) of samples, got {counts}")
    if count > MAX_SAMPLES:
        raise SampleError(f"{count} samples at once; at most {MAX_SAMPLES}")
    checked = {}
    for name, field in fields.items():
        if field.dtype == "text":
            texts = list(samples[name])
            bad = next((i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()), None)
            if bad is not None:
                raise SampleError(f"sample {bad}: field {name!r} must be a non-empty text")
            checked[name] = np.asarray(texts, dtype=object)
        else:
            checked[name] = _numbers(name, field, samples[name], count)
    return checked


def _columns(records: list, where: str) -> dict[str, list]:
    if not records or not all(isinstance(r, dict) for r in records):
        raise SampleError(f"{where}: expected JSON objects, one per sample")
    names = set(records[0])
    for index, record in enumerate(records):
        if set(record) != names:
            raise SampleError(f"{where}: sample {index} has fields {sorted(record)}, the first has {sorted(names)}")
    return {name: [r[name] for r in records] for name in names}


def _csv(text: str, fields: dict[str, SampleField], labelled: bool = True) -> dict[str, list]:
    rows = list(csv.reader(io.StringIO(text)))
    if len(rows) < 2:
        raise SampleError("a CSV file needs a header row and at least one sample")
    header, body = rows[0], rows[1:]
    if LABEL not in header and labelled:
        raise SampleError(f"the CSV header needs a {LABEL!r} column")
    label = header.index(LABEL) if LABEL in header else None
    inputs = [name for name in fields if name != LABEL]
    if len(inputs) != 1:
        raise SampleError(f"CSV carries one input field; this family takes {inputs}")
    if any(len(row) != len(header) for row in body):
        bad = next(i for i, row in enumerate(body) if len(row) != len(header))
        raise SampleError(f"CSV row {bad + 2} has {len(body[bad])} values, the header {len(header)}")
    if fields[inputs[0]].dtype == "text":
        if inputs[0] not in header:
            raise SampleError(f"the CSV header needs a {inputs[0]!r} column")
        column = header.index(inputs[0])
        values = [row[column] for row in body]
    else:
        others = [i for i in range(len(header)) if i != label]
        try:
            values = [[float(row[i]) for i in others] for row in body]
        except ValueError as error:
            raise SampleError(f"CSV: {error}") from None
    if label is None:
        return {inputs[0]: values}
    try:
        labels = [float(row[label]) for row in body]
    except ValueError as error:
        raise SampleError(f"CSV column {LABEL!r}: {error}") from None
    return {inputs[0]: values, LABEL: labels}


def _images(folder: Path, family) -> dict[str, list]:
    field = getattr(family, "image_field", None)
    if field is None:
        raise SampleError(f"{family.name} does not take images; hand it npz, JSON lines or CSV")
    from PIL import Image, UnidentifiedImageError  # only image folders need Pillow

    values, labels = [], []
    for label_dir in sorted(p for p in folder.iterdir() if p.is_dir()):
        if not label_dir.name.isdigit():
            raise SampleError(f"{label_dir.name!r}: image folders are named by their label (0, 1, ...)")
        for path in sorted(p for p in label_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            try:
                with Image.open(path) as image:
                    values.append(family.image_sample(image))
            except (UnidentifiedImageError, OSError) as error:
                raise SampleError(f"{path.relative_to(folder)}: not a readable image ({error})") from None
            labels.append(int(label_dir.name))
    if not labels:
        raise SampleError(f"{folder}: no images in label folders (e.g. {folder}/7/photo.png)")
    return {field: values, LABEL: labels}


def read_samples(path: Path, family, config: dict, *, labelled: bool = True) -> dict[str, np.ndarray]:
    """The samples in ``path`` (a file or an image folder), checked against the family's schema and encoded
    as the model's inputs. ``SampleError`` says why a file is refused."""
    path = Path(path)
    fields = family.sample_fields(config)
    if path.is_dir():
        raw = _images(path, family)
    else:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise SampleError(f"{path.name} is larger than {MAX_FILE_BYTES // 2**20} MiB")
        suffix = path.suffix.lower()
        try:
            if suffix == ".npz":
                with np.load(path, allow_pickle=False) as stored:
                    raw = {name: stored[name] for name in stored.files}
            elif suffix in (".jsonl", ".ndjson"):
                lines = [line for line in path.read_text().splitlines() if line.strip()]
                raw = _columns([json.loads(line) for line in lines], path.name)
            elif suffix == ".json":
                raw = _columns(json.loads(path.read_text()), path.name)
            elif suffix == ".csv":
                raw = _csv(path.read_text(), fields, labelled)
            else:
                raise SampleError(f"{path.name}: unknown format; use .npz, .jsonl, .json, .csv or an image folder")
        except (ValueError, OSError) as error:  # JSON, zip and decoding errors
            if isinstance(error, SampleError):
                raise
            raise SampleError(f"{path.name}: cannot be read ({type(error).__name__}: {error})") from None
    if not labelled:
        raw.pop(LABEL, None)
    return encode(family, config, check(fields, raw, labelled=labelled))


def encode(family, config: dict, checked: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checked fields as the arrays the sample store keeps (the model's inputs and ``y``)."""
    if LABEL not in checked:  # inputs only: encode with placeholder labels, then drop them
        count = len(next(iter(checked.values())))
        encoded = family.encode_samples({**checked, LABEL: np.zeros(count, dtype=np.int64)}, config)
        return {key: np.asarray(value) for key, value in encoded.items() if key != LABEL}
    return {key: np.asarray(value) for key, value in family.encode_samples(checked, config).items()}
