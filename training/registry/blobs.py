"""Content-addressed blobs (base weights, adapter versions, deltas) through Django's storage API.

A blob is stored once under ``<sha[:2]>/<sha>``; writing the same bytes again is a no-op. The storage is
the ``blobs`` alias: the filesystem by default, S3-compatible storage when configured.
"""

from __future__ import annotations

import hashlib
import mmap
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO

from django.core.files.base import ContentFile, File
from django.core.files.storage import storages

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
