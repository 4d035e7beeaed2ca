"""Every way a delta's safetensors file can be wrong, through the real REST upload and the verification
service: a header bomb, a malformed file, a tensor named twice, stored bytes changed after the upload, wrong
names, shapes and dtypes, NaN, Inf and an update over the norm bound; each gets its stored rejection code
and a readable detail, and nothing of it is ever aggregated. The encodings a device may use are accepted."""

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from devices.models import Device
from edge_agent.delta import encode_delta
from tests.training.delta_support import rejected, send, small_delta
from training.federation.verification import delta_verify
from training.models import Delta, Round
from training.registry.artifacts import ArtifactRejected, read_header
from training.registry.blobs import blob_path


def _with_header(header: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


@pytest.mark.django_db
def test_header_bombs_and_malformed_files_are_rejected(setup, settings):
    adapter, _, _, _ = setup
    bomb = _with_header({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "pad": "a" * (2 * 1024 * 1024)})
    rejected(send(setup, bomb + b"\0" * 4, counter=1), "header_too_large")
    lying = struct.pack("<Q", 10**12) + b"{}"
    rejected(send(setup, lying, counter=2), "malformed")
    rejected(send(setup, b"not safetensors at all", counter=3), "malformed")


def _named_twice(data: bytes, name: str, entry: dict | None = None) -> bytes:
    """The safetensors file ``data`` with ``name`` given a second entry at the end of its header (its own entry
    again unless ``entry``), written by hand: no library writes a repeated key."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    text = json.dumps(header)[:-1] + f", {json.dumps(name)}: {json.dumps(entry or header[name])}}}"
    return struct.pack("<Q", len(text)) + text.encode() + data[8 + size :]


@pytest.mark.django_db
def test_a_signed_delta_whose_header_names_a_tensor_twice_is_rejected_and_changes_nothing_else(setup):
    """JSON leaves a repeated key to the reader: Python's json and the safetensors library keep the last entry,
    others the first, so a header naming a tensor twice could show the server one tensor and a device another.
    Such a file, with both entries the tensor's own, was accepted before (every reader here loads it)."""
    adapter, _, device, _ = setup
    good = encode_delta(small_delta(adapter, seed=21))
    name = sorted(adapter.tensor_spec)[0]
    twice = _named_twice(good, name)
    assert set(load_safetensors(twice)) == set(adapter.tensor_spec)  # a valid delta to a reader keeping one entry
    status = Device.objects.get(pk=device.device.pk).status

    delta = rejected(send(setup, twice, counter=5), "duplicate_tensor")
    assert repr(name) in delta.rejection_detail and delta.norm is None and delta.encoding == ""
    assert not Round.objects.exists() and Device.objects.get(pk=device.device.pk).status == status
    # A contents check, after the counter in the documented order: the signed file used up its counter, as any
    # other signed file refused for its contents does (the device sends the next one with the next counter).
    assert delta.counter_claimed
    assert send(setup, good, counter=6).state == Delta.State.ACCEPTED

    # Another tensor's entry under the name, and a metadata key given twice: refused too.
    other = sorted(adapter.tensor_spec)[1]
    size = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + size])
    rejected(send(setup, _named_twice(good, name, header[other]), counter=7), "duplicate_tensor")
    metadata_twice = good.replace(b'"__metadata__":{', b'"__metadata__":{"encoding":"int8",', 1)
    metadata_twice = struct.pack("<Q", size + 18) + metadata_twice[8:]
    assert "metadata" in rejected(send(setup, metadata_twice, counter=8), "malformed").rejection_detail


@pytest.mark.django_db
def test_stored_bytes_that_are_not_the_signed_ones_are_found_while_reading_and_claim_no_counter(setup):
    """Verification hashes and counts the stored file in the same pass that checks its contents: a blob changed
    on disk after the upload is a ``hash_mismatch`` (not the device's doing: its counter stays free)."""
    adapter, _, _, _ = setup
    data = encode_delta(small_delta(adapter, seed=22))
    delta = send(setup, data, counter=3, verify=False)
    stored = Path(blob_path(delta.blob_sha256))
    stored.chmod(0o644)
    stored.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    flipped = rejected(delta_verify(delta_id=delta.pk), "hash_mismatch")
    assert not flipped.counter_claimed and "hash" in flipped.rejection_detail
    stored.write_bytes(data)  # the blob is shared by content: put it back for any later upload of these bytes


def test_stored_bytes_that_are_gone_are_a_hash_mismatch_not_a_crash(setup):
    """A run that loaded the delta while another rejected it and deleted its bytes (or bytes lost from storage)
    finds nothing to read: a verdict, claiming no counter, not a FileNotFoundError on every try."""
    adapter, _, _, _ = setup
    delta = send(setup, encode_delta(small_delta(adapter, seed=23)), counter=4, verify=False)
    Path(blob_path(delta.blob_sha256)).unlink()
    gone = rejected(delta_verify(delta_id=delta.pk), "hash_mismatch")
    assert not gone.counter_claimed and "gone" in gone.rejection_detail


def test_every_header_reader_of_the_server_refuses_a_tensor_named_twice():
    """Imported adapter versions and base weights go through ``read_header`` too."""
    data = save_safetensors({"a": torch.zeros(2), "b": torch.ones(3)})
    assert set(read_header(data)) == {"a", "b"}
    with pytest.raises(ArtifactRejected) as refused:
        read_header(_named_twice(data, "a"))
    assert refused.value.code == "duplicate_tensor"


@pytest.mark.django_db
def test_wrong_names_shapes_and_dtypes_are_rejected(setup):
    adapter, _, _, _ = setup
    good = small_delta(adapter)
    name = sorted(good)[0]
    missing = {k: v for k, v in good.items() if k != name}
    rejected(send(setup, encode_delta(missing), counter=1), "spec_mismatch")
    extra = {**good, "base_model.model.evil.weight": torch.zeros(3)}
    rejected(send(setup, encode_delta(extra), counter=2), "spec_mismatch")
    reshaped = {**good, name: torch.zeros(tuple(good[name].shape) + (1,))}
    assert "shape" in rejected(send(setup, encode_delta(reshaped), counter=3), "spec_mismatch").rejection_detail
    as_f64 = save_safetensors({k: v.double() for k, v in good.items()}, metadata={"encoding": "f32"})
    rejected(send(setup, as_f64, counter=4), "spec_mismatch")


@pytest.mark.django_db
def test_nan_inf_and_an_update_over_the_norm_bound_are_rejected(setup):
    adapter, _, _, _ = setup
    name = sorted(adapter.tensor_spec)[0]
    shape = tuple(adapter.tensor_spec[name]["shape"])
    rejected(
        send(setup, encode_delta(small_delta(adapter, **{name: torch.full(shape, float("nan"))})), counter=1),
        "not_finite",
    )
    rejected(
        send(setup, encode_delta(small_delta(adapter, **{name: torch.full(shape, float("inf"))})), counter=2),
        "not_finite",
    )
    huge = rejected(send(setup, encode_delta(small_delta(adapter, scale=1e4)), counter=3), "norm_too_large")
    assert "bound" in huge.rejection_detail


@pytest.mark.django_db
def test_f16_and_int8_deltas_are_accepted(setup):
    adapter, _, _, _ = setup
    assert send(setup, encode_delta(small_delta(adapter), encoding="f16"), counter=1).encoding == "f16"
    assert send(setup, encode_delta(small_delta(adapter, seed=2), encoding="int8"), counter=2).encoding == "int8"
