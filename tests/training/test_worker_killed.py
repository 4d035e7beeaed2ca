"""A worker killed with SIGKILL in the middle of aggregating, then started again: the round still makes
exactly one version, and every delta is counted once (``acks_late`` redelivers the task; state guards and
``UNIQUE(round)`` make the second run finish the job, not repeat it)."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import torch

from edge_agent.delta import encode_delta, sign_delta
from tests.conftest import start_worker, stop_worker
from training.federation.intake import upload_append, upload_begin
from training.federation.verification import delta_verify
from training.models import AdapterVersion, Delta, Round
from training.registry.services import adapter_create, adapter_set_aggregation, base_model_create, version_create_seeded


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_killed_mid_aggregation_and_restarted_makes_exactly_one_version(
    cohort, enrolled, shared_blob_root, settings
):
    settings.STORAGES = {
        **settings.STORAGES,
        "blobs": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(shared_blob_root)},
        },
    }
    base = base_model_create(name="wide", family="tests.training.wide_family:Wide", family_config={"width": 1024})
    adapter = adapter_create(name="wide-lora", base_model=base, rank=256, alpha=256.0)
    adapter.cohorts.add(cohort)
    version_create_seeded(adapter=adapter, seed=1)
    # Median in small coordinate blocks (64 coordinates: 8,192 blocks, 24 reads each) over 24 deltas of 0.5M
    # parameters: seconds of work to interrupt.
    adapter_set_aggregation(
        adapter=adapter,
        actor=None,
        aggregation={"strategy": "median", "buffer_size": 1000, "min_deltas": 1, "auto_rounds": True},
    )
    adapter.refresh_from_db()
    devices = [enrolled("active", name=f"w{i}") for i in range(24)]
    for i, device in enumerate(devices):
        generator = torch.Generator().manual_seed(i)
        tensors = {
            n: torch.randn(tuple(e["shape"]), generator=generator) * 1e-3 for n, e in adapter.tensor_spec.items()
        }
        data = encode_delta(tensors)
        signed = sign_delta(
            device.key, data, device_id=device.id, adapter=adapter.name, base_version=1, num_samples=10, counter=1
        )
        upload_begin(device=device.device, envelope=signed["envelope"], signature=signed["signature"], channel="rest")
        delta = upload_append(
            device=device.device, sha256=signed["envelope"]["sha256"], offset=0, data=data, channel="rest"
        ).delta
        delta_verify(delta_id=delta.pk)
    round_ = Round.objects.get()
    assert round_.deltas.count() == 24
    Round.objects.filter(pk=round_.pk).update(
        state=Round.State.AGGREGATING, params={**round_.params, "chunk_elements": 64}
    )

    queue = f"kill-{uuid.uuid4().hex[:6]}"
    overrides = {"CELERY_QUEUE": queue, "CELERY_TASK_TIME_LIMIT": "10", "WORKER_CONCURRENCY": "1"}
    worker, log = start_worker(name=f"victim-{queue}", blob_root=shared_blob_root, **overrides)
    from training.tasks import aggregate_round

    try:
        aggregate_round.apply_async((round_.pk,), queue=queue)
        deadline = time.monotonic() + 60
        while Round.objects.get(pk=round_.pk).attempts == 0:
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        time.sleep(0.05)  # inside the aggregation: it has begun (attempts) and takes a few seconds
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        assert not AdapterVersion.objects.filter(round=round_).exists(), "the kill came too late to prove anything"
        assert Round.objects.get(pk=round_.pk).state == Round.State.AGGREGATING
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)

    # Restarted: the unacknowledged task comes back once its visibility timeout (2 x 10 s) has passed.
    worker, log = start_worker(name=f"again-{queue}", blob_root=shared_blob_root, **overrides)
    try:
        deadline = time.monotonic() + 120
        while Round.objects.get(pk=round_.pk).state != Round.State.COMPLETED:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
    finally:
        stop_worker(worker)
    round_.refresh_from_db()
    assert AdapterVersion.objects.filter(round=round_).count() == 1
    assert AdapterVersion.objects.filter(adapter=adapter).count() == 2
    assert round_.attempts >= 2
    assert Delta.objects.filter(round=round_, state="aggregated").count() == 24
    print(f"aggregation after the restart took {round_.stats['seconds']} s")
