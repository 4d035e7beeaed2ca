"""The outbox: signed deltas kept across restarts, each stored once, counters never reused."""

import sqlite3
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors import safe_open
from safetensors.torch import load as load_safetensors

from edge_agent.delta import parse_envelope
from edge_agent.packaging import Outbox, package_delta
from edge_agent.protocol import verify

KEY = Ed25519PrivateKey.generate()
BASE = {
    "base_model.model.fc1.lora_A.weight": torch.zeros(2, 3),
    "base_model.model.fc1.lora_B.weight": torch.zeros(4, 2),
}


@contextmanager
def safe_open_bytes(data: bytes):
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "delta.safetensors"
        path.write_bytes(data)
        with safe_open(path, framework="pt") as opened:
            yield opened


def trained(value: float) -> dict[str, torch.Tensor]:
    return {key: torch.full_like(tensor, value) for key, tensor in BASE.items()}


def put(outbox: Outbox, value: float, **overrides):
    kwargs = {"key": KEY, "device_id": "dev-1", "adapter": "digits", "base_version": 3, "num_samples": 40}
    return outbox.put_delta(trained(value), BASE, **{**kwargs, **overrides})


def test_package_delta_signs_an_envelope_for_the_bytes():
    data, signed = package_delta(
        trained(0.5), BASE, key=KEY, device_id="6f1c2b9e-8d4a-4e3b-9c1f-2a7b5d0e8f13", adapter="digits", base_version=3,
        num_samples=40,
        counter=7, only_b=True, encoding="f16",
    )  # fmt: skip
    envelope = parse_envelope(signed["envelope"])
    assert envelope["counter"] == 7 and envelope["size"] == len(data) and envelope["num_samples"] == 40
    assert verify(KEY.public_key(), envelope, signed["signature"])
    assert set(load_safetensors(data)) == {"base_model.model.fc1.lora_B.weight"}  # FFA-LoRA: B only
    with safe_open_bytes(data) as opened:
        assert opened.metadata() == {"format": "fleet-delta", "encoding": "f16"}


def test_package_delta_gives_the_same_bytes_for_the_same_tensors():
    kwargs = {"key": KEY, "device_id": "d", "adapter": "a", "base_version": 1, "num_samples": 1, "counter": 1}
    for encoding in ("f32", "int8"):
        assert len({package_delta(trained(0.25), BASE, encoding=encoding, **kwargs)[0] for _ in range(20)}) == 1


def test_counters_are_monotonic_across_reopen_and_rows_survive(tmp_path):
    outbox = Outbox(tmp_path)
    first, created = put(outbox, 0.1)
    assert created and first.counter == 0 and first.state == "queued"
    reserved = outbox.next_counter()  # e.g. a crash after reserving: that counter is never handed out again
    second, _ = put(outbox, 0.2)
    assert (reserved, second.counter) == (1, 2)

    reopened = Outbox(tmp_path)
    third, _ = put(reopened, 0.3)
    assert third.counter == 3
    assert [i.counter for i in reopened.pending()] == [0, 2, 3]
    stored = reopened.get(second.sha256)
    assert stored.read() == second.read() and stored.envelope == second.envelope
    assert verify(KEY.public_key(), stored.envelope["envelope"], stored.envelope["signature"])


def test_the_same_delta_put_twice_is_stored_once_and_uses_no_counter(tmp_path):
    outbox = Outbox(tmp_path)
    item, created = put(outbox, 0.4)
    again, created_again = put(Outbox(tmp_path), 0.4)
    assert created and not created_again and again == item
    assert len(outbox.items()) == 1 and len(list((tmp_path / "outbox").iterdir())) == 1
    assert put(outbox, 0.5)[0].counter == item.counter + 1


def test_a_failure_while_packaging_uses_no_counter_and_stores_nothing(tmp_path):
    outbox = Outbox(tmp_path)

    def broken(counter):
        raise RuntimeError("power cut while signing")

    with pytest.raises(RuntimeError):
        outbox.put(broken)
    with pytest.raises(ValueError, match="allocated counter"):
        outbox.put(lambda counter: package_delta(
            trained(1.0), BASE, key=KEY, device_id="d", adapter="a", base_version=1, num_samples=1, counter=99
        ))  # fmt: skip
    assert outbox.items() == [] and put(outbox, 0.6)[0].counter == 0


def test_states_move_forward_and_what_was_sent_is_not_pending(tmp_path):
    outbox = Outbox(tmp_path)
    a, _ = put(outbox, 1.0)
    b, _ = put(outbox, 2.0)
    outbox.mark(a.sha256, "uploading", bytes_acknowledged=100)
    assert [i.sha256 for i in Outbox(tmp_path).pending()] == [a.sha256, b.sha256]
    assert Outbox(tmp_path).get(a.sha256).bytes_acknowledged == 100  # resumable after a restart
    outbox.mark(a.sha256, "sent", bytes_acknowledged=a.size)
    assert [i.sha256 for i in outbox.pending()] == [b.sha256]
    done = outbox.mark(a.sha256, "rejected", detail="counter_reused: seen before")
    assert done.state == "rejected" and done.detail.startswith("counter_reused")
    with pytest.raises(ValueError, match="cannot become"):
        outbox.mark(a.sha256, "queued")
    with pytest.raises(ValueError, match="bytes_acknowledged"):
        outbox.mark(b.sha256, "uploading", bytes_acknowledged=b.size + 1)
    with pytest.raises(KeyError):
        outbox.mark("0" * 64, "sent")
    assert outbox.purge_finished() == 1 and not a.path.exists() and b.path.exists()
    with sqlite3.connect(tmp_path / "outbox.sqlite3") as db:
        assert db.execute("SELECT COUNT(*) FROM deltas").fetchone()[0] == 2
