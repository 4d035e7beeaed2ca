"""What the delta upload and verification tests share: an adapter with a seeded version, an active device and
its REST client (the ``setup`` fixture), a small delta of the adapter's shape, its signed upload over REST,
verified as the worker would, and the check that a delta was rejected with a given code and nothing of it
aggregated (tests/training/test_delta_verification.py, test_delta_file_checks.py)."""

import json

import pytest
import torch
from rest_framework.test import APIClient

from edge_agent.delta import sign_delta
from edge_agent.protocol import b64encode
from training.federation.verification import delta_verify
from training.models import Delta
from training.registry.services import version_create_seeded


@pytest.fixture
def setup(adapter, cohort, enrolled, device_token):
    adapter.cohorts.add(cohort)
    version = version_create_seeded(adapter=adapter, seed=3)
    device = enrolled("active")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Device {device_token(device)}")
    return adapter, version, device, client


def small_delta(adapter, *, scale=0.01, seed=0, **overrides):
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: torch.randn(tuple(entry["shape"]), generator=generator) * scale
        for name, entry in adapter.tensor_spec.items()
    }
    tensors.update(overrides)
    return tensors


def upload(client, data: bytes, signed: dict, **headers):
    envelope = b64encode(json.dumps(signed["envelope"]).encode())
    return client.put(
        f"/api/v1/device/deltas/{signed['envelope']['sha256']}/",
        data=data,
        content_type="application/octet-stream",
        HTTP_X_DELTA_ENVELOPE=envelope,
        HTTP_X_DELTA_SIGNATURE=signed["signature"],
        **headers,
    )


def send(setup, data: bytes, *, key=None, counter=1, base_version=1, adapter_name=None, verify=True):
    adapter, _, device, client = setup
    signed = sign_delta(
        key or device.key,
        data,
        device_id=device.id,
        adapter=adapter_name or adapter.name,
        base_version=base_version,
        num_samples=32,
        counter=counter,
    )
    response = upload(client, data, signed)
    assert response.status_code in (200, 201), response.content
    delta = Delta.objects.get(pk=response.json()["delta_id"])
    if verify and delta.state == Delta.State.RECEIVED:
        delta = delta_verify(delta_id=delta.pk)
    return delta


def rejected(delta, code):
    assert delta.state == Delta.State.REJECTED, (delta.state, delta.rejection_code, delta.rejection_detail)
    assert delta.rejection_code == code, delta.rejection_detail
    assert delta.rejection_detail
    assert delta.round_id is None
    return delta
