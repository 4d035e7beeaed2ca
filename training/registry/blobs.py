"""Content-addressed blobs (base weights, adapter versions, deltas) through Django's storage API.

A blob is stored once under ``<sha[:2]>/<sha>``; writing the same bytes again is a no-op. The storage is
the ``blobs`` alias: the filesystem by default, S3-compatible storage when configured.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import secrets
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO

import torch
from django.core.files.base import ContentFile, File
from django.core.files.storage import storages
from safetensors.torch import save as save_safetensors

CHUNK = 1024 * 1024


def page_aligned(size: int) -> mmap.mmap:
    """A writable buffer of ``size`` bytes (at least one) starting on a page boundary, for reads from files:
    the kernel copies from the page cache into it twice as fast as into a buffer 16 bytes into a page, where
    Python's ``bytearray`` and numpy's arrays start (bench/README.md, "aggregation.py").

    Private to the process: an anonymous mapping is shared by default, and a buffer made before a fork (the
    verification's, made when Celery's prefork pool imports the tasks) was then the same memory in every pool
    child, each reading its file into it while another hashed it (good deltas rejected as ``hash_mismatch``)."""
    return mmap.mmap(-1, max(1, size), flags=mmap.MAP_PRIVATE)


@dataclass(frozen=True)
class Blob:
    sha256: str
    size: int
    stored: bool = True  # False: the bytes did not hash to what was expected and were not stored


def _storage():
    return storages["blobs"]


def blob_name(sha256: str) -> str:
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise ValueError("not a sha256 hex digest")
    return f"{sha256[:2]}/{sha256}"


def blob_put_bytes(data: bytes, *, expect_sha256: str | None = None) -> Blob:
    """Store ``data`` under its hash; with ``expect_sha256``, only if it hashes to that."""
    sha = hashlib.sha256(data).hexdigest()
    if expect_sha256 is not None and sha != expect_sha256:
        return Blob(sha256=sha, size=len(data), stored=False)
    name = blob_name(sha)
    storage = _storage()
    if not storage.exists(name):
        storage.save(name, ContentFile(data))
    return Blob(sha256=sha, size=len(data))


def blob_put_file(handle: BinaryIO, *, expect_sha256: str | None = None) -> Blob:
    """Hash a file while reading it once, then store it under its hash (streams, never all in memory); with
    ``expect_sha256``, only if it hashes to that (bytes that are not what was signed are never stored)."""
    digest, size = hashlib.sha256(), 0
    handle.seek(0)
    while chunk := handle.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
    sha = digest.hexdigest()
    if expect_sha256 is not None and sha != expect_sha256:
        return Blob(sha256=sha, size=size, stored=False)
    name = blob_name(sha)
    storage = _storage()
    if not storage.exists(name):
        handle.seek(0)
        storage.save(name, File(handle))
    return Blob(sha256=sha, size=size)


# The dtypes ``blob_put_tensors`` writes itself, in the order safetensors lays them out (wider first, then by name).
_STREAMED = {torch.float64: ("F64", 0), torch.float32: ("F32", 1)}


def _safetensors_header(tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[str]]:
    """The framing and header ``safetensors.torch.save(tensors)`` writes (no metadata), and the tensors' order in
    its data section: compact JSON padded with spaces to a multiple of 8 bytes, behind its length."""
    order = sorted(tensors, key=lambda name: (_STREAMED[tensors[name].dtype][1], name))
    entries, at = {}, 0
    for name in order:
        tensor = tensors[name]
        end = at + tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": _STREAMED[tensor.dtype][0], "shape": list(tensor.shape), "data_offsets": [at, end]}
        at = end
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, order


def _folder(storage, path: str) -> None:
    """``path``'s folder made as the storage makes its folders."""
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        os.makedirs(folder, exist_ok=True)
        if storage.directory_permissions_mode is not None:
            os.chmod(folder, storage.directory_permissions_mode)


def blob_put_tensors(tensors: dict[str, torch.Tensor]) -> Blob:
    """Store ``tensors`` as the safetensors file ``save_safetensors`` makes (the same bytes), under its hash.

    On the filesystem, float64 and float32 tensors are written straight from their memory into a new file in the
    blob folder, each piece hashed as it is written, and the file renamed to its hash: one pass over the bytes,
    where the file built in memory, hashed, then copied out in 64 KiB pieces was three passes and a second copy
    (a shard's float64 partial of a 10M adapter is 80 MiB; bench/README.md, "aggregation.py"). Other dtypes, and
    storages without local files (S3), take ``blob_put_bytes``."""
    storage = _storage()
    try:
        root = storage.path("")
    except NotImplementedError:  # no local files (S3)
        root = None
    if root is None or not tensors or any(t.dtype not in _STREAMED for t in tensors.values()):
        return blob_put_bytes(save_safetensors({name: tensor.contiguous() for name, tensor in tensors.items()}))
    head, order = _safetensors_header(tensors)
    temporary = os.path.join(root, f".part-{secrets.token_hex(8)}")  # beside the blobs: one rename
    _folder(storage, temporary)
    digest, size = hashlib.sha256(head), len(head)
    try:
        with open(temporary, "xb") as handle:
            handle.write(head)
            for name in order:
                data = memoryview(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy())
                for start in range(0, len(data), CHUNK):
                    piece = data[start : start + CHUNK]
                    digest.update(piece)
                    handle.write(piece)
                size += len(data)
        sha = digest.hexdigest()
        final = storage.path(blob_name(sha))
        if os.path.exists(final):
            os.unlink(temporary)
        else:
            _folder(storage, final)
            if storage.file_permissions_mode is not None:
                os.chmod(temporary, storage.file_permissions_mode)
            os.replace(temporary, final)  # the same name holds the same bytes, whoever renames first
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return Blob(sha256=sha, size=size)


def blob_delete(sha256: str) -> None:
    """Remove a blob (nothing if it is not there). The caller makes sure nothing refers to it any more
    (``training.federation.verification.rejected_bytes_delete``)."""
    _storage().delete(blob_name(sha256))


def blob_open(sha256: str):
    return _storage().open(blob_name(sha256), "rb")


def blob_path(sha256: str) -> str | None:
    """The blob's local file path when the storage has one (the filesystem), else None (S3)."""
    try:
        return _storage().path(blob_name(sha256))
    except NotImplementedError:
        return None


def blob_read(sha256: str) -> bytes:
    with blob_open(sha256) as handle:
        return handle.read()


@contextmanager
def blob_local_path(sha256: str) -> Iterator[str]:
    """A local file path holding the blob, for readers that need one (``safetensors.safe_open`` maps it).

    The filesystem storage gives its own path; other storages (S3) are copied to a temporary file first."""
    local = blob_path(sha256)
    if local is not None:
        yield local
        return
    with tempfile.NamedTemporaryFile(prefix="blob-", suffix=".safetensors") as copy, blob_open(sha256) as src:
        while chunk := src.read(CHUNK):
            copy.write(chunk)
        copy.flush()
        yield copy.name
