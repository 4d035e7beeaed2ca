"""Hostile sample files, written for real on disk: what anything that can write to the inbox might drop there, by
mistake or on purpose. Each is small on disk (or cheap to write) and asks the reader for far more memory, time or
trust than it is worth. The digits family's schema: ``x`` 8x8 floats in [0, 1], ``y`` a digit."""

from __future__ import annotations

import io
import json
import os
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

MIB = 2**20


def good_samples(count: int = 20, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.random((count, 1, 8, 8), dtype=np.float32),
        "y": rng.integers(0, 10, count).astype(np.int64),
    }


def good_npz(path: Path, count: int = 20, seed: int = 0) -> Path:
    np.savez(path, **good_samples(count, seed))
    return path


def image_folder(path: Path, labels=(3, 7)) -> Path:
    """A folder of label folders, one small grey PNG in each."""
    for index, label in enumerate(labels):
        (path / str(label)).mkdir(parents=True)
        Image.fromarray(np.full((16, 16), 40 + 20 * index, dtype=np.uint8)).save(path / str(label) / "one.png")
    return path


def _npy_header(shape: tuple, descr: str) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def npz_declaring(path: Path, *, count: int, descr: str = "<f8") -> Path:
    """An .npz whose ``x.npy`` declares ``count`` 8x8 samples of ``descr`` and holds 64 bytes of them: a reader
    that trusts the header takes ``count * 64 * itemsize`` bytes before it finds the data missing."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("x.npy", _npy_header((count, 1, 8, 8), descr) + bytes(64))
        archive.writestr("y.npy", _npy(np.zeros(count % 1000, dtype=np.int64)))
    return path


def npz_bomb(path: Path, *, count: int = 2_000_000) -> Path:
    """An .npz of about half a megabyte that unpacks to ``count`` 8x8 float32 samples of zeros (512 MB for 2
    million): a valid file, every byte of it there, compressed 1000 to 1."""
    block = bytes(16 * MIB)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        with archive.open("x.npy", "w", force_zip64=True) as member:
            member.write(_npy_header((count, 1, 8, 8), "<f4"))
            left = count * 64 * 4
            while left:
                member.write(block[: min(left, len(block))])
                left -= min(left, len(block))
        archive.writestr("y.npy", _npy(np.zeros(count, dtype=np.int64)))
    return path


def zip_directory_bomb(path: Path, *, size: int = 250 * MIB) -> Path:
    """A zip of ``size`` bytes that is nearly all central directory: about five million entries naming one small
    member, each of which a zip reader turns into an object of a few hundred bytes before reading any member."""
    data = _npy(np.zeros(1, dtype=np.int64))
    name = b"y.npy"
    crc = zlib.crc32(data)
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, crc, len(data), len(data), len(name), 0)
    entry = struct.pack(
        "<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0, crc, len(data), len(data), len(name), 0, 0, 0, 0, 0, 0
    )
    entry += name
    head = local + name + data
    count = (size - len(head) - 22) // len(entry)
    directory = entry * count
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, len(directory), len(head), 0)
    path.write_bytes(head + directory + end)
    return path


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(path: Path, width: int, height: int, *, rows: bool = True) -> Path:
    """A grey PNG of ``width`` x ``height`` black pixels, its rows streamed through zlib (169 megapixels take
    half a megabyte). Without ``rows`` the header alone declares the size and the data is cut short."""
    compressor = zlib.compressobj(9)
    parts, block_rows = [], max(1, (8 * MIB) // (width + 1))
    block = bytes((width + 1) * block_rows)
    done = 0
    while rows and done < height:
        step = min(block_rows, height - done)
        parts.append(compressor.compress(block[: (width + 1) * step]))
        done += step
    parts.append(compressor.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", b"".join(parts))
        + _png_chunk(b"IEND", b"")
    )
    return path


def huge_photo_folder(path: Path, width: int, height: int) -> Path:
    """An image folder whose one photo declares ``width`` x ``height`` pixels (its data cut short)."""
    (path / "3").mkdir(parents=True)
    png(path / "3" / "photo.png", width, height, rows=False)
    return path


def long_json_line(path: Path, size: int) -> Path:
    """One JSON line of about ``size`` bytes: a sample whose ``x`` holds millions of numbers."""
    numbers = (size - 32) // 5
    with path.open("w") as out:
        out.write('{"y": 1, "x": [')
        chunk = "0.25," * 100_000
        for _ in range(numbers // 100_000):
            out.write(chunk)
        out.write("0.25]}\n")
    return path


def deep_json_line(path: Path, depth: int = 100_000) -> Path:
    """A JSON line a few hundred kilobytes long that nests ``depth`` arrays."""
    path.write_text('{"y": 1, "x": ' + "[" * depth + "]" * depth + "}\n")
    return path


def jsonl(path: Path, samples: dict[str, np.ndarray]) -> Path:
    lines = (json.dumps({"x": x.tolist(), "y": int(y)}) for x, y in zip(samples["x"], samples["y"], strict=True))
    path.write_text("\n".join(lines) + "\n")
    return path


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def csv_rows(path: Path, rows: int) -> Path:
    """A CSV of ``rows`` digits samples (64 pixel columns and ``y``), every row the same."""
    header = ",".join(f"p{i}" for i in range(64)) + ",y\n"
    row = ",".join(["0.25"] * 64) + ",3\n"
    with path.open("w") as out:
        out.write(header)
        for _ in range(rows // 10_000):
            out.write(row * 10_000)
        out.write(row * (rows % 10_000))
    return path


def empty_lists_json(path: Path, size: int) -> Path:
    """A .json document of ``size`` bytes that is a list of empty lists: the most Python objects its bytes make."""
    count = (size - 2) // 3
    path.write_text("[" + "[]," * (count - 1) + "[]]")
    return path
