"""``blob_put_tensors`` (training/registry/blobs.py): a shard's partial, a span's part and the combined Gram
matrix are written from the tensors' memory, hashed on the way, and renamed to their hash. The file is the one
``safetensors.torch.save`` makes, byte for byte, so readers and hashes are unchanged; a failure leaves nothing."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from training.registry.blobs import blob_path, blob_put_tensors, blob_read


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
