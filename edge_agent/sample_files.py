"""Samples handed to the agent by the device's application: checked against the family's schema, then stored.

A family declares what it takes (``sample_fields(config)``: per field a shape, a dtype and a range; the label
is ``y``) and how those fields become the model's inputs (``encode_samples``). ``check`` holds a batch to the
schema and refuses it whole with a ``SampleError`` naming the first field and sample that does not fit, so a
bad batch stores nothing: numbers must be real numbers (not booleans, text or complex numbers), finite, within the
field's range, whole numbers for an integer field. Files (``read_samples``, read within the bounds of
``edge_agent.sample_bounds``: regular files only, sizes known before memory is taken):

- ``.npz``: one array per field, samples along the first axis (an image field may come flattened, 64 values);
- ``.jsonl`` / ``.ndjson``: one JSON object per line, ``{"x": [[...]], "y": 3}`` or ``{"text": "...", "y": 1}``;
- ``.json``: a list of such objects (at most 4 MiB: larger sets as JSON lines);
- ``.csv``: a header row; ``y`` is the label column, a text family's ``text`` column is the text, otherwise the
  other columns, in order, are the one input field's values (64 pixels for the digits); UTF-8, with or without
  a byte order mark;
- a folder of image folders named by label (``7/photo.png``), for families that take images.

A sample without its label is unlabeled (``read_samples_split``, ``edge_agent.unlabeled``): a JSON object without
``y`` (or with ``y`` null), a CSV file without a ``y`` column or a row whose ``y`` cell is empty, an ``.npz``
without ``y``, an image directly in the folder or in ``unlabeled/``. Its fields are checked as predict's inputs
are, with every bound above; a file that mixes both kinds is split, and one bad sample of either kind refuses the
whole file.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from edge_agent.families.common import LABEL, SampleField
from edge_agent.sample_bounds import (  # noqa: F401  (SampleError and the limits are this module's API too)
    MAX_FILE_BYTES,
    MAX_SAMPLES,
    SampleError,
    field_size,
    numeric_dtype,
    real_numbers,
)
from edge_agent.sample_formats import read_fields


def _numbers(name: str, field: SampleField, values, count: int) -> np.ndarray:
    array = real_numbers(name, field, values)
    if array.shape[:1] != (count,) or array[0:1].size not in (0, field_size(field)):
        raise SampleError(f"field {name!r} has shape {list(array.shape)}; each sample needs {field.describe()}")
    with np.errstate(over="ignore"):  # a float64 beyond float32 becomes inf, refused below as not finite
        array = array.reshape((count, *field.shape)).astype(numeric_dtype(field, array.dtype), copy=False)
    bad = ~np.isfinite(array) if array.dtype.kind == "f" else np.zeros(array.shape, dtype=bool)
    if field.low is not None:
        bad |= array < field.low
    if field.high is not None:
        bad |= array > field.high
    if field.dtype == "int64" and array.dtype.kind == "f":
        bad |= array != np.round(array)
    if bad.any():
        sample = int(np.argwhere(bad)[0][0])
        values = array[sample].astype(np.float64)
        raise SampleError(
            f"sample {sample}: field {name!r} holds {values.ravel()[:4].tolist()}..., outside {field.describe()}"
            if values.size > 1
            else f"sample {sample}: field {name!r} is {float(values.item())!r}, outside {field.describe()}"
        )
    return array.astype(np.float32 if field.dtype == "float32" else np.int64, copy=False)


def _length(values) -> int:
    try:
        return len(values)
    except TypeError:  # a number, or a 0-d array
        return -1


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
    counts = {name: _length(values) for name, values in samples.items()}
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


def read_samples(path: Path, family, config: dict, *, labelled: bool = True) -> dict[str, np.ndarray]:
    """The samples in ``path`` (a file or an image folder), checked against the family's schema and encoded
    as the model's inputs. ``SampleError`` says why a file is refused."""
    fields = family.sample_fields(config)
    raw = read_fields(Path(path), family, fields, labelled=labelled)
    return encode(family, config, check(fields, raw, labelled=labelled))


def _rows(values, positions: list[int]):
    return values[positions] if isinstance(values, np.ndarray) else [values[i] for i in positions]


def check_split(family, config: dict, raw: dict) -> tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray] | None]:
    """Samples some of which may be unlabeled (``read_fields(..., labelled=None)``: no ``y``, or ``y`` with None
    for those without a label) as ``(labelled, unlabeled)``, each checked against the schema (the unlabeled ones
    as predict's inputs are) and encoded, None when there are none. A sample of either part that does not fit
    refuses both, the ``SampleError`` naming it by its place among all of them."""
    fields = family.sample_fields(config)
    labels = raw.get(LABEL) if isinstance(raw, dict) else None
    count = _length(labels) if labels is not None else 0
    known = [i for i in range(count) if labels[i] is not None]
    unknown = [i for i in range(count) if labels[i] is None]
    parts = []
    if labels is None:
        parts.append((False, None, {k: v for k, v in raw.items() if k != LABEL}))
    else:
        if known:
            parts.append((True, known, raw if not unknown else {k: _rows(v, known) for k, v in raw.items()}))
        if unknown:
            parts.append((False, unknown, {k: _rows(v, unknown) for k, v in raw.items() if k != LABEL}))
    checked: dict[bool, dict[str, np.ndarray]] = {}
    for labelled, positions, samples in parts:
        try:
            checked[labelled] = encode(family, config, check(fields, samples, labelled=labelled))
        except SampleError as error:  # "sample 3: ..." of this part: its place among all the file's samples
            found = re.match(r"sample (\d+): (.*)", str(error), re.S)
            if positions is None or not found or len(known) * len(unknown) == 0:
                raise
            kind = "labelled" if labelled else "unlabeled"
            raise SampleError(f"sample {positions[int(found[1])]} ({kind}): {found[2]}") from None
    return checked.get(True), checked.get(False)


def read_samples_split(
    path: Path, family, config: dict
) -> tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray] | None]:
    """The samples in ``path`` as ``(labelled, unlabeled)`` (``check_split``): a record, row, ``.npz`` or image
    without a label is unlabeled."""
    raw = read_fields(Path(path), family, family.sample_fields(config), labelled=None)
    return check_split(family, config, raw)


def encode(family, config: dict, checked: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checked fields as the arrays the sample store keeps (the model's inputs and ``y``)."""
    if LABEL not in checked:  # inputs only: encode with placeholder labels, then drop them
        count = len(next(iter(checked.values())))
        encoded = family.encode_samples({**checked, LABEL: np.zeros(count, dtype=np.int64)}, config)
        return {key: np.asarray(value) for key, value in encoded.items() if key != LABEL}
    return {key: np.asarray(value) for key, value in family.encode_samples(checked, config).items()}
