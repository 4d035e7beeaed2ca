"""Blobs on the filesystem (training/registry/blobs.py). ``blob_put_tensors``: a shard's partial, a span's part
and the combined Gram matrix are written from the tensors' memory, hashed on the way, and renamed to their hash;
the file is the one ``safetensors.torch.save`` makes, byte for byte, so readers and hashes are unchanged. Every
store (tensors, bytes, an uploaded file) writes a new file and renames it: a failure part way leaves nothing,
and no blob's name ever holds part of its bytes."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import resource
import signal
import stat
import time

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from training.registry.blobs import (
    CHUNK,
    PART_MAX_AGE_SECONDS,
    blob_parts_sweep,
    blob_path,
    blob_put_bytes,
    blob_put_file,
    blob_put_tensors,
    blob_read,
)
from training.tasks import expire_staged_uploads


@pytest.fixture
def root(settings, tmp_path):
    """A blob folder of this test's own (not the suite's shared one), to see every file the writer leaves."""
    storages = dict(settings.STORAGES)
    storages["blobs"] = {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path / "blobs")},
    }
    settings.STORAGES = storages
    return tmp_path / "blobs"


def _files(root) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


CASES = {
    "a shard's float64 sums": lambda g: {
        f"layers.{i}.lora_{ab}.weight": torch.randn(8, 64, generator=g, dtype=torch.float64)
        for i in range(3)
        for ab in "BA"
    },
    "float64 and float32, names against their order": lambda g: {
        "a": torch.randn(3, generator=g),
        "z": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "m": torch.randn(5, generator=g, dtype=torch.float64),
    },
    "empty, a scalar, a transposed view, a name outside ASCII": lambda g: {
        "empty": torch.zeros(0),
        "scalar": torch.tensor(1.5, dtype=torch.float64),
        "transposed": torch.randn(4, 3, generator=g).t(),
        "größe": torch.randn(7, generator=g),
    },
    "dtypes it does not write itself (stored as before)": lambda g: {
        "half": torch.randn(6, generator=g).half(),
        "int8": torch.arange(5, dtype=torch.int8),
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_stored_file_is_the_one_safetensors_makes_and_is_named_by_its_hash(root, case):
    tensors = CASES[case](torch.Generator().manual_seed(3))
    expected = save_safetensors({name: tensor.contiguous() for name, tensor in tensors.items()})
    blob = blob_put_tensors(tensors)
    assert blob_read(blob.sha256) == expected
    assert blob.sha256 == hashlib.sha256(expected).hexdigest() and blob.size == len(expected)
    loaded = load_safetensors(blob_read(blob.sha256))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert _files(root) == [f"{blob.sha256[:2]}/{blob.sha256}"]  # nothing else left in the folder
    mode = stat.S_IMODE(os.stat(blob_path(blob.sha256)).st_mode)
    assert mode == 0o644  # the storage's file mode (Django's FILE_UPLOAD_PERMISSIONS), as its own saves


def test_the_same_tensors_twice_are_one_blob(root):
    tensors = CASES["a shard's float64 sums"](torch.Generator().manual_seed(4))
    first, again = blob_put_tensors(tensors), blob_put_tensors({k: v.clone() for k, v in tensors.items()})
    assert first == again and _files(root) == [f"{first.sha256[:2]}/{first.sha256}"]


def test_a_tensor_that_cannot_be_written_leaves_no_file_and_says_why(root):
    """The header is written before the values: a failure part-way removes the part file, and no blob has the
    name of bytes that were never all written."""
    tensors = {"a": torch.randn(4, dtype=torch.float64), "b": torch.empty(4, dtype=torch.float64, device="meta")}
    with pytest.raises(TypeError, match="meta"):  # a tensor with no memory to write from
        blob_put_tensors(tensors)
    assert _files(root) == []


@contextlib.contextmanager
def files_limited_to(size: int):
    """Writes past ``size`` bytes of any file fail (EFBIG, "File too large"), as on a full disk: the process's
    RLIMIT_FSIZE, SIGXFSZ ignored so that the write fails rather than the process being stopped."""
    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("store", ["file", "bytes", "tensors"])
def test_a_store_that_fails_part_way_leaves_no_blob_and_stores_whole_the_next_time(root, store):
    """Django's storage wrote into the blob's own name: a write that failed part way left the first bytes there,
    and every later store of the same bytes took them for the blob (an upload sent again was then refused as
    not hashing to its signature, forever)."""
    tensors = {"sums": torch.randn(3 * CHUNK // 8 + 5, generator=torch.Generator().manual_seed(5), dtype=torch.float64)}
    data = save_safetensors(tensors)
    sha = hashlib.sha256(data).hexdigest()
    put = {
        "file": lambda: blob_put_file(io.BytesIO(data), expect_sha256=sha),
        "bytes": lambda: blob_put_bytes(data, expect_sha256=sha),
        "tensors": lambda: blob_put_tensors(tensors),
    }[store]
    with files_limited_to(2 * CHUNK), pytest.raises(OSError, match="File too large"):
        put()
    assert _files(root) == []
    blob = put()
    assert blob.stored and blob.sha256 == sha and blob.size == len(data)
    assert blob_read(sha) == data and _files(root) == [f"{sha[:2]}/{sha}"]
    assert stat.S_IMODE(os.stat(blob_path(sha)).st_mode) == 0o644


def test_bytes_that_are_not_the_signed_ones_are_not_stored(root):
    data = os.urandom(CHUNK + 1)
    signed = hashlib.sha256(b"what was signed").hexdigest()
    for blob in (blob_put_file(io.BytesIO(data), expect_sha256=signed), blob_put_bytes(data, expect_sha256=signed)):
        assert not blob.stored and blob.sha256 == hashlib.sha256(data).hexdigest() and blob.size == len(data)
    assert _files(root) == []


def test_bytes_and_files_are_stored_once_under_their_hash(root):
    data = os.urandom(2 * CHUNK)
    first, again = blob_put_bytes(data), blob_put_file(io.BytesIO(data))
    empty = blob_put_bytes(b"")
    assert first == again and blob_read(first.sha256) == data and blob_read(empty.sha256) == b""
    assert _files(root) == sorted(f"{b.sha256[:2]}/{b.sha256}" for b in (first, empty))


def test_the_sweep_removes_the_files_of_stores_a_dead_process_left_and_nothing_else(root):
    """A process killed while it writes (SIGKILL: no handler runs) leaves its ``.part-*`` file; beat's hourly
    sweep (``expire_staged_uploads``) removes such files once an hour old, never a blob or a store in progress."""
    blob = blob_put_bytes(b"a version")
    old, fresh = root / ".part-0123456789abcdef", root / ".part-fedcba9876543210"
    for path in (old, fresh):
        path.write_bytes(b"the first bytes of a blob")
    hour_ago = time.time() - PART_MAX_AGE_SECONDS - 1
    os.utime(old, (hour_ago, hour_ago))
    expire_staged_uploads()  # as beat runs it, with the staging folder's sweep
    assert _files(root) == sorted([fresh.name, f"{blob.sha256[:2]}/{blob.sha256}"])
    assert blob_parts_sweep(now=time.time() + PART_MAX_AGE_SECONDS) == 1  # the other, an hour on
    assert _files(root) == [f"{blob.sha256[:2]}/{blob.sha256}"] and blob_read(blob.sha256) == b"a version"
