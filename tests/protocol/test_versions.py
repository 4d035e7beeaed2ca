"""Protocol 1 beside protocol 2: a delta envelope signed in protocol 1's canonical form counts while protocol 1
is accepted (PROTOCOL_1_ACCEPTED_UNTIL), at the door and in the worker's verification, and is refused after."""

from __future__ import annotations

import math
import time

import pytest

from edge_agent.delta import encode_delta, envelope_payload
from edge_agent.protocol import canonical_json, sign
from tests.training.delta_support import setup, small_delta, upload  # noqa: F401  (fixture)
from training.federation.verification import delta_verify
from training.models import Delta

pytestmark = pytest.mark.django_db


def _legacy_signed(device, adapter, data: bytes, counter: int) -> dict:
    import hashlib

    # A whole number of seconds as a float: protocol 1 writes 1764040000.0, RFC 8785 writes 1764040000.
    envelope = envelope_payload(
        device_id=device.id, adapter=adapter.name, base_version=1, sha256=hashlib.sha256(data).hexdigest(),
        size=len(data), num_samples=16, counter=counter, created_at=float(math.floor(time.time())),
    )  # fmt: skip
    assert canonical_json(envelope, protocol=1) != canonical_json(envelope, protocol=2)
    return {"envelope": envelope, "signature": sign(device.key, envelope, protocol=1)}


def test_a_protocol_1_envelope_counts_until_the_sunset_and_is_refused_after_it(setup, settings):  # noqa: F811
    adapter, _, device, client = setup
    data = encode_delta(small_delta(adapter, seed=8))
    response = upload(client, data, _legacy_signed(device, adapter, data, counter=1))
    assert response.status_code in (200, 201), response.content
    delta = delta_verify(delta_id=response.json()["delta_id"])
    assert delta.state == Delta.State.ACCEPTED, delta.rejection_detail

    # Received while protocol 1 was accepted, verified after its sunset: the worker refuses it too.
    other = encode_delta(small_delta(adapter, seed=9))
    response = upload(client, other, _legacy_signed(device, adapter, other, counter=2))
    settings.PROTOCOL_1_ACCEPTED_UNTIL = "2020-01-01"
    late = delta_verify(delta_id=response.json()["delta_id"])
    assert (late.state, late.rejection_code) == (Delta.State.REJECTED, "bad_signature")

    third = encode_delta(small_delta(adapter, seed=10))
    refused = upload(client, third, _legacy_signed(device, adapter, third, counter=3))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "bad_signature"
    assert Delta.objects.filter(sha256=_legacy_signed(device, adapter, third, 3)["envelope"]["sha256"]).count() == 0
