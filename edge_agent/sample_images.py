"""An image folder read within bounds: label folders named in ASCII digits (``7/photo.png``), and images without
a label directly in the folder or in ``unlabeled/``, each image a regular file whose size, read from its header, is
at most ``MAX_IMAGE_PIXELS`` before a pixel is decoded, the folder's images at most ``MAX_FILE_BYTES`` together,
and at most ``MAX_SAMPLES`` entries a folder."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import BinaryIO

import numpy as np

from edge_agent.families.common import LABEL
from edge_agent.sample_bounds import (
    LINK,
    MAX_FILE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_SAMPLES,
    SampleError,
    mib,
    open_regular,
)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".pgm")
IMAGE_FORMATS = ("PNG", "JPEG", "BMP", "GIF", "PPM")  # the decoders those suffixes need, and no other
UNLABELED = "unlabeled"  # the folder of images without a label


def _entries(folder: Path, where: str) -> list[os.DirEntry]:
    """A folder's entries by name, at most ``MAX_SAMPLES`` of them."""
    found = []
    with os.scandir(folder) as scan:
        for entry in scan:
            found.append(entry)
            if len(found) > MAX_SAMPLES:
                raise SampleError(f"{where}: more than {MAX_SAMPLES} entries; hand them over in several folders")
    return sorted(found, key=lambda entry: entry.name)


def _image(file: BinaryIO, family, where: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError  # only image folders need Pillow

    too_many = f"{where}: more than the {MAX_IMAGE_PIXELS / 1e6:.1f} megapixels an image may have (resize it first)"
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)  # Pillow's own, larger, bound
        try:
            with Image.open(file, formats=IMAGE_FORMATS) as image:  # the header only: no pixel decoded yet
                width, height = image.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise SampleError(f"{too_many} ({width} x {height})")
                return family.image_sample(image)
        except SampleError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
            raise SampleError(f"{too_many} ({error})") from None
        except (UnidentifiedImageError, OSError, ValueError, EOFError, SyntaxError) as error:
            raise SampleError(f"{where}: not a readable image ({error})") from None


def read_image_folder(folder: Path, family, *, labelled: bool | None) -> dict:
    """A folder of label folders (``7/photo.png``), each named by its label in ASCII digits. Where samples may be
    unlabeled (``labelled`` None) or labels are not read (False), images directly in the folder and in a folder
    named ``unlabeled`` are unlabeled (label None, or no labels when none has one)."""
    field = getattr(family, "image_field", None)
    if field is None:
        raise SampleError(f"{family.name} does not take images; hand it npz, JSON lines or CSV")
    values, labels, total = [], [], 0

    def take(entry: os.DirEntry, where: str, label: int | None) -> None:
        nonlocal total
        if len(labels) >= MAX_SAMPLES:
            raise SampleError(f"{folder.name}: more than {MAX_SAMPLES} images; hand them over in several folders")
        with open_regular(Path(entry.path)) as file:
            total += os.fstat(file.fileno()).st_size
            if total > MAX_FILE_BYTES:
                raise SampleError(f"{folder.name}: its images come to more than {mib(MAX_FILE_BYTES)}")
            values.append(_image(file, family, where))
        labels.append(label)

    for label_dir in _entries(folder, folder.name):
        if label_dir.is_symlink():
            raise SampleError(f"{folder.name}/{label_dir.name}: {LINK}")
        if not label_dir.is_dir(follow_symlinks=False):
            if labelled is not True and label_dir.name.lower().endswith(IMAGE_SUFFIXES):
                take(label_dir, label_dir.name, None)
            continue
        unlabeled = labelled is not True and label_dir.name == UNLABELED
        if not unlabeled and not (label_dir.name.isascii() and label_dir.name.isdigit()):
            named = "" if labelled is True else f", or {UNLABELED!r} for images without one"
            raise SampleError(
                f"{label_dir.name!r}: image folders are named by their label in ASCII digits (0, 1, ...){named}"
            )
        for entry in _entries(Path(label_dir.path), f"{folder.name}/{label_dir.name}"):
            if entry.name.lower().endswith(IMAGE_SUFFIXES):
                take(entry, f"{label_dir.name}/{entry.name}", None if unlabeled else int(label_dir.name))
    if not labels:
        raise SampleError(f"{folder}: no images in label folders (e.g. {folder}/7/photo.png)")
    if labelled is False or all(label is None for label in labels):
        return {field: values}
    return {field: values, LABEL: labels}
