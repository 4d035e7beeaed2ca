"""A downloaded adapter or base file whose safetensors header names a key twice is refused by the agent, as the
server refuses such a delta: JSON leaves the choice of entry to the reader, so the two ends could see different
tensors."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

from edge_agent.manifest import ManifestRefused, verify_file


def _with_text(data: bytes, text: str) -> bytes:
    size = int.from_bytes(data[:8], "little")
    return struct.pack("<Q", len(text)) + text.encode() + data[8 + size :]


def _verify(tmp_path, data: bytes) -> None:
    path = tmp_path / "v2.safetensors"
    path.write_bytes(data)
    verify_file(path, sha256=hashlib.sha256(data).hexdigest(), size=len(data))


def test_a_downloaded_file_naming_a_tensor_or_a_metadata_key_twice_is_refused(tmp_path):
    data = save_safetensors({"a": torch.zeros(2), "b": torch.ones(3)}, metadata={"format": "pt"})
    _verify(tmp_path, data)  # the file as written passes
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    text = json.dumps(header)

    with pytest.raises(ManifestRefused) as refused:
        _verify(tmp_path, _with_text(data, text[:-1] + f', "a": {json.dumps(header["a"])}}}'))
    assert refused.value.code == "duplicate_tensor" and "'a'" in str(refused.value)

    with pytest.raises(ManifestRefused) as refused:
        _verify(tmp_path, _with_text(data, text.replace('"__metadata__": {', '"__metadata__": {"format": "np", ', 1)))
    assert refused.value.code == "malformed"

    # A field of a tensor's entry twice is the safetensors library's own "duplicate field" refusal at load.
    twice = _with_text(data, text.replace('"dtype": "F32"', '"dtype": "F32", "dtype": "F32"', 1))
    _verify(tmp_path, twice)
    with pytest.raises(Exception, match="duplicate field"):
        load_file(str(tmp_path / "v2.safetensors"))
