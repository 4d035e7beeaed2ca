"""Content-addressed blobs (base weights, adapter versions, deltas) through Django's storage API.

A blob is stored once under ``<sha[:2]>/<sha>``; writing the same bytes again is a no-op. The storage is
the ``blobs`` alias: the filesystem by default, S3-compatible storage when configured. On the filesystem a blob
is written to a new file beside the blobs and renamed to its hash once all of it is there (``_put_local``), so a
blob's name never holds part of its bytes, whatever stops the write.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import secrets
import tempfile
import time
from collections.abc import Iterable, Iterator
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


def _local_root(storage) -> str | None:
    """The storage's folder when it keeps local files (the filesystem), else None (S3)."""
    try:
        return storage.path("")
    except NotImplementedError:
        return None


def _folder(storage, path: str) -> None:
    """``path``'s folder made as the storage makes its folders."""
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        os.makedirs(folder, exist_ok=True)
        if storage.directory_permissions_mode is not None:
            os.chmod(folder, storage.directory_permissions_mode)


def _put_local(
    storage, root: str, pieces: Iterable, *, expect_sha256: str | None = None, sha256: str | None = None
) -> Blob:
    """Write ``pieces`` (bytes-like, in order) into a new file in the blob folder, hashing each as it is written
    (unless their ``sha256`` is known already), then rename the file to its hash: a blob's name only ever holds all
    of its bytes. Where the write fails part way (a full disk, an I/O error, a reader that raises), or the bytes do
    not hash to ``expect_sha256``, the file is removed and no blob is stored. Django's storage wrote into the
    blob's own name, so a failure left a truncated file there, which every later store of the same bytes took for
    the blob."""
    temporary = os.path.join(root, f".part-{secrets.token_hex(8)}")  # beside the blobs: one rename
    _folder(storage, temporary)
    digest, size = (None if sha256 else hashlib.sha256()), 0
    try:
        with open(temporary, "xb") as handle:
            for piece in pieces:
                if digest is not None:
                    digest.update(piece)
                handle.write(piece)
                size += len(piece)
        sha = sha256 or digest.hexdigest()
        if expect_sha256 is not None and sha != expect_sha256:
            os.unlink(temporary)
            return Blob(sha256=sha, size=size, stored=False)
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


def _pieces(data) -> Iterator[memoryview]:
    view = memoryview(data).cast("B")
    for start in range(0, len(view), CHUNK):
        yield view[start : start + CHUNK]


def blob_put_bytes(data: bytes, *, expect_sha256: str | None = None) -> Blob:
    """Store ``data`` under its hash; with ``expect_sha256``, only if it hashes to that."""
    sha = hashlib.sha256(data).hexdigest()
    if expect_sha256 is not None and sha != expect_sha256:
        return Blob(sha256=sha, size=len(data), stored=False)
    name = blob_name(sha)
    storage = _storage()
    if not storage.exists(name):
        root = _local_root(storage)
        if root is not None:
            return _put_local(storage, root, _pieces(data), sha256=sha)  # hashed above: not again
        storage.save(name, ContentFile(data))
    return Blob(sha256=sha, size=len(data))


def blob_put_file(handle: BinaryIO, *, expect_sha256: str | None = None) -> Blob:
    """Store a file under its hash, reading it once (streams, never all in memory); with ``expect_sha256``,
    only if it hashes to that (bytes that are not what was signed are never stored). On the filesystem it is
    hashed while it is copied; elsewhere (S3) hashed first, then sent."""
    storage = _storage()
    root = _local_root(storage)
    handle.seek(0)
    if root is not None:
        return _put_local(storage, root, iter(lambda: handle.read(CHUNK), b""), expect_sha256=expect_sha256)
    digest, size = hashlib.sha256(), 0
    while chunk := handle.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
    sha = digest.hexdigest()
    if expect_sha256 is not None and sha != expect_sha256:
        return Blob(sha256=sha, size=size, stored=False)
    name = blob_name(sha)
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


def _tensor_pieces(head: bytes, tensors: dict[str, torch.Tensor], order: list[str]) -> Iterator:
    yield head
    for name in order:
        yield from _pieces(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy())


def blob_put_tensors(tensors: dict[str, torch.Tensor]) -> Blob:
    """Store ``tensors`` as the safetensors file ``save_safetensors`` makes (the same bytes), under its hash.

    On the filesystem, float64 and float32 tensors are written straight from their memory into a new file in the
    blob folder, each piece hashed as it is written, and the file renamed to its hash: one pass over the bytes,
    where the file built in memory, hashed, then copied out in 64 KiB pieces was three passes and a second copy
    (a shard's float64 partial of a 10M adapter is 80 MiB; bench/README.md, "aggregation.py"). Other dtypes, and
    storages without local files (S3), take ``blob_put_bytes``."""
    storage = _storage()
    root = _local_root(storage)
    if root is None or not tensors or any(t.dtype not in _STREAMED for t in tensors.values()):
        return blob_put_bytes(save_safetensors({name: tensor.contiguous() for name, tensor in tensors.items()}))
    head, order = _safetensors_header(tensors)
    return _put_local(storage, root, _tensor_pieces(head, tensors, order))


# A store writes its file without pause (seconds for the largest blob); one this old was left by a process that
# died while writing (SIGKILL, a machine that stopped), which no error handler could remove.
PART_MAX_AGE_SECONDS = 3600


def blob_parts_sweep(now: float | None = None) -> int:
    """Remove the files of stores left unfinished (``.part-*`` in the blob folder, older than
    PART_MAX_AGE_SECONDS); how many. Beat runs it with the staging folder's sweep. Nothing on S3."""
    root = _local_root(_storage())
    if root is None or not os.path.isdir(root):
        return 0
    now, removed = now or time.time(), 0
    for entry in os.scandir(root):
        if entry.name.startswith(".part-") and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                if now - entry.stat(follow_symlinks=False).st_mtime >= PART_MAX_AGE_SECONDS:
                    os.unlink(entry.path)
                    removed += 1
    return removed


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
