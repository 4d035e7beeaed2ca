"""The device protocol as a contract: what a hostile device client sends to a live server (uvicorn, a real
``websockets`` client) is refused with its exact code, and nothing of it is stored (no delta row, no staging
file, no blob) but the count of refusals operators see on the device.

One uvicorn for the module (``tests/asgi_server.py``), with small per-device limits from its environment;
every test commits its rows (``transactional_db``) so the server sees them, and uses devices of its own.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.utils import timezone
from websockets.sync.client import connect

from devices.models import Device
from edge_agent.delta import encode_delta, envelope_payload, sign_delta
from edge_agent.protocol import PROTOCOL_VERSION, b64encode, encode, encode_chunk_frame, hello_payload, sign
from edge_agent.uploads import upload_metrics
from tests.asgi_server import asgi_server
from tests.training.test_rounds import make_delta_tensors
from training.federation.verification import delta_verify
from training.models import Assignment, Delta
from training.registry.blobs import blob_name
from training.registry.services import version_create_seeded

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

# Blobs are shared by the whole run (content-addressed): each delta here has bytes of its own, so "no blob"
# means this test stored none, whatever other tests stored.
_SEEDS = itertools.count(random.randrange(10**6, 10**9))
BEGINS_PER_MINUTE = 8
REJECTIONS_PER_HOUR = 3


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker, tmp_path_factory, shared_blob_root):
    """uvicorn on the test database, writing blobs where this process (and the suite's worker) reads them."""
    env = {
        "BLOB_ROOT": str(shared_blob_root),
        "DELTA_BEGINS_PER_MINUTE": str(BEGINS_PER_MINUTE),
        "DELTA_REJECTIONS_PER_HOUR": str(REJECTIONS_PER_HOUR),
    }
    with asgi_server("upload-edges", tmp_path_factory.mktemp("upload-edges"), **env) as running:
        yield running


@pytest.fixture(autouse=True)
def _no_verification(monkeypatch):
    """Verification tasks the server queues wait in this run's queue (no worker here); the tests that need a
    verdict run ``delta_verify`` themselves. Nothing in this process queues any."""
    monkeypatch.setattr("training.federation.verify_queue.queue_verification", lambda delta_id: None)


class Agent:
    """A device's socket, as a hostile client drives it: raw messages, answers read one by one."""

    def __init__(self, server, device):
        self.device = device
        self._connection = connect(server.ws_url + "/ws/agent/", open_timeout=10, compression=None)
        self.socket = self._connection.__enter__()
        challenge = self.receive()
        signature = sign(device.key, hello_payload(nonce=challenge["nonce"], device_id=device.id))
        self.send("hello", device_id=device.id, signature=signature, protocol=PROTOCOL_VERSION)
        self.welcome = self.receive()
        assert self.welcome["type"] == "welcome", self.welcome

    def send(self, kind: str, **fields) -> None:
        self.socket.send(encode(kind, **fields))

    def receive(self, timeout: float = 10) -> dict:
        return json.loads(self.socket.recv(timeout=timeout))

    def answer(self) -> dict:
        """The next delta_state or delta_error (commands pushed meanwhile are skipped)."""
        while True:
            message = self.receive()
            if message["type"] in ("delta_state", "delta_error"):
                return message

    def begin(self, signed: dict, **extra) -> dict:
        self.send("delta_begin", envelope=signed["envelope"], signature=signed["signature"], **extra)
        return self.answer()

    def until_barrier(self) -> list[dict]:
        """Every message the server sent before it answered a barrier (an abort of an upload that does not
        exist): the server handles one socket's messages in order, so nothing sent before is still to come."""
        self.send("delta_abort", sha256="f" * 64)
        seen = []
        while (message := self.receive())["type"] != "delta_error":
            seen.append(message)
        assert message["code"] == "unknown_upload"
        return seen

    def close(self) -> None:
        self._connection.__exit__(None, None, None)


@pytest.fixture
def agent(server):
    opened = []

    def open_for(device) -> Agent:
        opened.append(Agent(server, device))
        return opened[-1]

    yield open_for
    for one in opened:
        one.close()


def signed_delta(device, adapter, *, seed: int | None = None, counter: int = 1, **kwargs) -> tuple[bytes, dict]:
    data = encode_delta(make_delta_tensors(adapter, seed=next(_SEEDS) if seed is None else seed))
    signed = sign_delta(
        device.key, data, device_id=device.id, adapter=adapter.name, base_version=1, num_samples=5, counter=counter,
        **kwargs,
    )  # fmt: skip
    return data, signed


def signed_envelope(device, **fields) -> dict:
    """An envelope signed by ``device`` with any field values (no bytes behind it)."""
    values = {"adapter": "digits-lora", "base_version": 1, "sha256": "ab" * 32, "size": 1000, "num_samples": 5}
    values |= {"counter": 1, "created_at": time.time(), **fields}
    envelope = envelope_payload(device_id=device.id, **values)
    return {"envelope": envelope, "signature": sign(device.key, envelope)}


def staged_files(server, device) -> list[Path]:
    folder = server.staging_dir / device.id
    return sorted(folder.iterdir()) if folder.is_dir() else []


def blob_exists(shared_blob_root: Path, sha256: str) -> bool:
    return (shared_blob_root / blob_name(sha256)).exists()


def assert_refused_and_nothing_stored(server, device, error: dict, code: str, shared_blob_root, sha256: str):
    assert error["type"] == "delta_error" and error["code"] == code, error
    assert not Delta.objects.filter(device=device.device).exists()
    assert staged_files(server, device) == []
    assert not blob_exists(shared_blob_root, sha256)
    row = Device.objects.get(pk=device.id)
    assert row.uploads_refused >= 1 and row.upload_refused_code == code and row.upload_refused_at is not None


# --- 1. the envelope's signature at begin ------------------------------------------------------------------


def test_an_envelope_not_signed_by_the_device_is_refused_at_begin_and_the_socket_stays_open(
    server, agent, adapter, enrolled, shared_blob_root
):
    device = enrolled("active")
    data, signed = signed_delta(device, adapter)
    forged = {"envelope": signed["envelope"], "signature": sign(Ed25519PrivateKey.generate(), signed["envelope"])}
    socket = agent(device)
    error = socket.begin(forged)
    sha = signed["envelope"]["sha256"]
    assert_refused_and_nothing_stored(server, device, error, "bad_signature", shared_blob_root, sha)
    tampered = {"envelope": {**signed["envelope"], "num_samples": 10_000}, "signature": signed["signature"]}
    assert socket.begin(tampered)["code"] == "bad_signature"
    # A chunk after the refusal finds no upload: not a byte was taken.
    socket.socket.send(encode_chunk_frame(sha256=signed["envelope"]["sha256"], offset=0, data=data))
    assert socket.answer()["code"] == "unknown_upload"
    assert Device.objects.get(pk=device.id).uploads_refused == 2
    assert not Delta.objects.exists() and staged_files(server, device) == []


def test_a_bad_signature_over_rest_is_refused_before_the_body_and_stores_nothing(
    server, adapter, enrolled, device_token, shared_blob_root
):
    device = enrolled("active")
    data, signed = signed_delta(device, adapter)
    sha = signed["envelope"]["sha256"]
    request = urllib.request.Request(  # noqa: S310 (our own server)
        f"{server.url}/api/v1/device/deltas/{sha}/",
        data=data,
        method="PUT",
        headers={
            "Authorization": f"Device {device_token(device)}",
            "Content-Type": "application/octet-stream",
            "X-Delta-Envelope": b64encode(json.dumps(signed["envelope"]).encode()),
            "X-Delta-Signature": sign(Ed25519PrivateKey.generate(), signed["envelope"]),
        },
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)  # noqa: S310
    assert refused.value.code == 403
    assert json.loads(refused.value.read())["error"]["code"] == "bad_signature"
    assert not Delta.objects.exists() and staged_files(server, device) == []
    assert not blob_exists(shared_blob_root, sha)
    assert Device.objects.get(pk=device.id).upload_refused_code == "bad_signature"


# --- 2. a refused begin stores nothing but a counter --------------------------------------------------------


def test_a_declared_size_over_the_limit_is_a_plain_refusal_with_no_row(server, agent, enrolled, shared_blob_root):
    device = enrolled("active")
    huge = signed_envelope(device, size=64 * 1024 * 1024 + 1)
    error = agent(device).begin(huge)
    assert_refused_and_nothing_stored(server, device, error, "too_large", shared_blob_root, huge["envelope"]["sha256"])
    assert Device.objects.get(pk=device.id).uploads_refused == 1


# --- 3. per-device limits ------------------------------------------------------------------------------------


def test_begins_past_the_per_minute_limit_are_refused_with_retry_after_and_the_socket_stays(
    server, agent, adapter, enrolled
):
    if time.time() % 60 > 50:  # the window is a fixed minute: keep every begin of this test inside one
        time.sleep(61 - time.time() % 60)
    device = enrolled("active")
    _, signed = signed_delta(device, adapter)
    socket = agent(device)
    for _ in range(BEGINS_PER_MINUTE):
        assert socket.begin(signed)["state"] == "uploading"
    error = socket.begin(signed)
    assert error["code"] == "too_many_begins"
    assert isinstance(error["retry_after"], int) and 1 <= error["retry_after"] <= 60
    assert socket.begin(signed)["code"] == "too_many_begins"
    socket.until_barrier()  # still open
    row = Device.objects.get(pk=device.id)
    assert row.upload_refused_code == "too_many_begins" and row.uploads_refused == 1  # the rest: Redis only


def test_a_device_with_many_rejections_this_hour_is_refused_at_begin(server, agent, adapter, enrolled):
    device = enrolled("active")
    for n in range(REJECTIONS_PER_HOUR):
        Delta.objects.create(
            device=device.device, adapter_name=adapter.name, base_version_number=1, sha256=f"{n:064x}", size=10,
            num_samples=1, counter=n, envelope={}, signature="x", channel="ws", state=Delta.State.REJECTED,
            rejection_code="spec_mismatch", received_at=timezone.now() - timedelta(minutes=30 - n),
        )  # fmt: skip
    _, signed = signed_delta(device, adapter, counter=10)
    socket = agent(device)
    error = socket.begin(signed)
    assert error["code"] == "too_many_rejections"
    assert 29 * 60 <= error["retry_after"] <= 31 * 60  # when the oldest of them is an hour old
    socket.until_barrier()
    assert Delta.objects.filter(device=device.device).count() == REJECTIONS_PER_HOUR
    assert staged_files(server, device) == []


# --- 4. delta_abort frees a slot -------------------------------------------------------------------------------


def test_an_aborted_upload_frees_its_slot_at_once(server, agent, adapter, enrolled):
    device = enrolled("active")
    uploads = [signed_delta(device, adapter, counter=n)[1] for n in range(1, 6)]
    socket = agent(device)
    for signed in uploads[:4]:
        assert socket.begin(signed)["state"] == "uploading"
    assert socket.begin(uploads[4])["code"] == "too_many_uploads"
    first = uploads[0]["envelope"]
    socket.send("delta_abort", sha256=first["sha256"])
    assert socket.answer() == {
        "type": "delta_state", "sha256": first["sha256"], "size": first["size"], "offset": 0, "delta_id": None,
        "state": "aborted", "rejection_code": "", "rejection_detail": "",
    }  # fmt: skip
    assert not any(path.name.startswith(first["sha256"]) for path in staged_files(server, device))
    assert socket.begin(uploads[4])["state"] == "uploading"
    socket.send("delta_abort", sha256=first["sha256"])  # gone already
    assert socket.answer()["code"] == "unknown_upload"
    assert not Delta.objects.exists()


# --- 5. created_at within the window of the server's clock ----------------------------------------------------


@pytest.mark.parametrize("created_at", [0.0, time.time() + 10 * 365 * 86400], ids=["1970", "ten-years-ahead"])
def test_a_created_at_outside_the_window_is_refused(server, agent, adapter, enrolled, shared_blob_root, created_at):
    device = enrolled("active")
    _, signed = signed_delta(device, adapter, created_at=created_at)
    error = agent(device).begin(signed)
    assert_refused_and_nothing_stored(
        server, device, error, "bad_created_at", shared_blob_root, signed["envelope"]["sha256"]
    )
    assert "server's time" in error["message"] and "2592000 s before and 300 s after" in error["message"]


# --- 6. metrics against a schema -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metrics", "named"),
    [({"loss": "high"}, "'loss'"), ({"x" * 300: 1.0}, "300 characters"), ({"ok": True}, "'ok'"), ([1], "object")],
    ids=["string-value", "long-name", "bool-value", "not-an-object"],
)
def test_malformed_metrics_are_refused_naming_the_entry(
    server, agent, adapter, enrolled, shared_blob_root, metrics, named
):
    device = enrolled("active")
    _, signed = signed_delta(device, adapter)
    error = agent(device).begin(signed, metrics=metrics)
    assert_refused_and_nothing_stored(
        server, device, error, "malformed_metrics", shared_blob_root, signed["envelope"]["sha256"]
    )
    assert named in error["message"]


def test_the_agents_own_metrics_pass_and_are_stored_as_sent(server, agent, adapter, enrolled):
    device = enrolled("active")
    data, signed = signed_delta(device, adapter)
    # What edge_agent.runtime writes beside a delta (before_/after_ of the training result), as it sends them.
    metrics = upload_metrics({"before_loss": 2.31, "after_loss": 0.42, "before_accuracy": 0.1, "after_samples": 40})
    assert len(metrics) == 4
    socket = agent(device)
    assert socket.begin(signed, metrics=metrics)["state"] == "uploading"
    socket.socket.send(encode_chunk_frame(sha256=signed["envelope"]["sha256"], offset=0, data=data))
    assert socket.answer()["state"] == "received"
    assert Delta.objects.get().metrics == metrics


# --- 7. rejected bytes are not kept ------------------------------------------------------------------------------


def test_bytes_that_are_not_the_signed_ones_keep_a_row_but_no_blob(server, agent, adapter, enrolled, shared_blob_root):
    device = enrolled("active")
    data, signed = signed_delta(device, adapter)
    torn = data[:-1] + bytes([data[-1] ^ 0xFF])
    socket = agent(device)
    assert socket.begin(signed)["offset"] == 0
    socket.socket.send(encode_chunk_frame(sha256=signed["envelope"]["sha256"], offset=0, data=torn))
    state = socket.answer()
    assert state["state"] == "rejected" and state["rejection_code"] == "hash_mismatch"
    delta = Delta.objects.get()
    assert delta.blob_sha256 == "" and delta.rejection_code == "hash_mismatch"
    assert not blob_exists(shared_blob_root, signed["envelope"]["sha256"])
    assert not blob_exists(shared_blob_root, hashlib.sha256(torn).hexdigest())
    assert staged_files(server, device) == [] or all(p.suffix == ".lock" for p in staged_files(server, device))

    # More bytes than declared: a row (too_large), nothing stored.
    data2, signed2 = signed_delta(device, adapter, counter=2)
    assert socket.begin(signed2)["offset"] == 0
    socket.socket.send(encode_chunk_frame(sha256=signed2["envelope"]["sha256"], offset=0, data=data2 + b"extra"))
    assert socket.answer()["rejection_code"] == "too_large"
    assert Delta.objects.get(sha256=signed2["envelope"]["sha256"]).blob_sha256 == ""
    assert not blob_exists(shared_blob_root, signed2["envelope"]["sha256"])


def test_a_delta_rejected_by_verification_leaves_no_blob(server, agent, adapter, cohort, enrolled, shared_blob_root):
    adapter.cohorts.add(cohort)
    version_create_seeded(adapter=adapter, seed=3)
    device = enrolled("active")
    tensors = make_delta_tensors(adapter, seed=next(_SEEDS))
    tensors["base_model.model.not_in_the_spec.lora_A.weight"] = tensors[next(iter(tensors))].clone()
    data = encode_delta(tensors)
    signed = sign_delta(device.key, data, device_id=device.id, adapter=adapter.name, base_version=1, num_samples=3,
                        counter=1)  # fmt: skip
    sha = signed["envelope"]["sha256"]
    socket = agent(device)
    assert socket.begin(signed)["offset"] == 0
    socket.socket.send(encode_chunk_frame(sha256=sha, offset=0, data=data))
    assert socket.answer()["state"] == "received"
    # Stored whole (unless a Celery worker of this test run has verified it already, as it may under xdist).
    assert blob_exists(shared_blob_root, sha) or Delta.objects.get().state == "rejected"
    # Verified here, unless a Celery worker of this test run took the queued task first: either way, once.
    delta_verify(delta_id=Delta.objects.get().pk)
    deadline = time.monotonic() + 30
    # The bytes go first, then the row's blob_sha256 is blanked (rejected_bytes_delete): wait for both.
    while (
        Delta.objects.get().state == "received" or blob_exists(shared_blob_root, sha) or Delta.objects.get().blob_sha256
    ):
        assert time.monotonic() < deadline, "the delta was not verified, or its bytes were kept"
        time.sleep(0.1)
    delta = Delta.objects.get()
    assert delta.state == "rejected" and delta.rejection_code == "spec_mismatch"
    assert delta.blob_sha256 == ""


# --- 8. delta_result after a reconnect; acks ---------------------------------------------------------------------


def test_a_delta_result_missed_offline_comes_at_the_next_hello_until_acknowledged(server, agent, adapter, enrolled):
    device = enrolled("active")
    delta = Delta.objects.create(
        device=device.device, adapter_name=adapter.name, base_version_number=1, sha256="cd" * 32, size=10,
        num_samples=1, counter=1, envelope={}, signature="x", channel="ws", state=Delta.State.ACCEPTED,
    )  # fmt: skip
    other = enrolled("active", name="other")

    socket = agent(device)
    results = [m for m in socket.until_barrier() if m.get("command") == "delta_result"]
    assert [(m["id"], m["args"]["state"], m["args"]["delta_id"]) for m in results] == [
        (f"delta-{delta.pk}", "accepted", delta.pk)
    ]
    socket.send("ack", id=f"delta-{delta.pk}", ok=False, detail="not now")  # changes nothing
    socket.until_barrier()
    socket.close()
    assert Delta.objects.get(pk=delta.pk).result_acked_at is None

    intruder = agent(other)  # another device's ack of it changes nothing either
    intruder.send("ack", id=f"delta-{delta.pk}", ok=True, detail=None)
    intruder.until_barrier()
    assert Delta.objects.get(pk=delta.pk).result_acked_at is None

    socket = agent(device)
    assert [m["id"] for m in socket.until_barrier() if m["type"] == "command"] == [f"delta-{delta.pk}"]
    socket.send("ack", id=f"delta-{delta.pk}", ok=True, detail=None)
    socket.until_barrier()
    socket.close()
    assert Delta.objects.get(pk=delta.pk).result_acked_at is not None

    socket = agent(device)
    assert [m for m in socket.until_barrier() if m["type"] == "command"] == []


def test_an_acknowledged_assignment_is_not_sent_again_at_hello(server, agent, adapter, cohort, enrolled):
    adapter.cohorts.add(cohort)
    version = version_create_seeded(adapter=adapter, seed=3)
    device = enrolled("active")
    assignment = Assignment.objects.create(device=device.device, version=version, seq=1)

    socket = agent(device)
    commands = [m for m in socket.until_barrier() if m["type"] == "command"]
    assert [(m["id"], m["command"]) for m in commands] == [(f"assignment-{assignment.pk}", "assignment")]
    socket.send("ack", id=f"assignment-{assignment.pk}", ok=True, detail="installed")
    socket.until_barrier()
    socket.close()
    assert Assignment.objects.get(pk=assignment.pk).acked_at is not None

    socket = agent(device)
    assert [m for m in socket.until_barrier() if m["type"] == "command"] == []
    # A new assignment is a new row: sent.
    newer = Assignment.objects.create(device=device.device, version=version, seq=2)
    socket.close()
    socket = agent(device)
    assert [m["id"] for m in socket.until_barrier() if m["type"] == "command"] == [f"assignment-{newer.pk}"]


@pytest.mark.parametrize(
    "ack",
    [{"id": 5, "ok": True}, {"id": "x" * 65, "ok": True}, {"id": "delta-1", "ok": "yes"}, {"id": "a", "ok": True,
     "detail": "d" * 501}, {"id": "a", "ok": True, "detail": 3}],
    ids=["id-not-string", "id-too-long", "ok-not-bool", "detail-too-long", "detail-not-string"],
)  # fmt: skip
def test_a_malformed_ack_closes_the_socket_with_4400(server, agent, enrolled, ack):
    from websockets.exceptions import ConnectionClosed

    socket = agent(enrolled("active"))
    socket.send("ack", **ack)
    assert socket.receive()["code"] == "malformed"
    with pytest.raises(ConnectionClosed) as closed:
        socket.receive()
    assert closed.value.rcvd.code == 4400
