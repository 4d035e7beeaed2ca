"""Verification in batches (``training.verify_queue``): an upload wakes its shard's drainer only when it is not
awake already, a drainer verifies every received delta of its shard (also one that arrives while it finishes),
one delta failing does not stop the others, and a shard whose drainer died is looked at again.

The drains run in this process, against the real PostgreSQL and Redis; the task queue is replaced by a list,
so no worker takes part and every figure here is exact."""

from __future__ import annotations

import pytest
from django.core.cache import cache

from tests.training.test_rounds import make_delta_tensors, receive
from training import verify_queue
from training.models import Delta
from training.services import adapter_set_aggregation, version_create_seeded

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def wakes(monkeypatch, settings):
    """The shards whose drain task was queued, in order (``verify_shard.delay``), and the delayed looks again
    (``apply_async``); every flag, lock and look-again mark starts down."""
    from training.tasks import verify_shard

    settings.DELTA_VERIFY_SHARDS = 4
    for shard in range(settings.DELTA_VERIFY_SHARDS):
        cache.delete_many([verify_queue._flag(shard), verify_queue._lock(shard), f"verify:recheck:{shard}"])
    queued: dict[str, list] = {"delay": [], "later": []}
    monkeypatch.setattr(verify_shard, "delay", lambda shard: queued["delay"].append(shard))
    monkeypatch.setattr(verify_shard, "apply_async", lambda args, countdown: queued["later"].append((args, countdown)))
    return queued


@pytest.fixture
def fleet(adapter, cohort, enrolled):
    adapter.cohorts.add(cohort)
    version_create_seeded(adapter=adapter, seed=3)
    devices = [enrolled("active", name=f"d{i}") for i in range(5)]
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation={"buffer_size": 100, "min_deltas": 1})
    adapter.refresh_from_db()
    return adapter, devices


def _upload(fleet, count: int, first: int = 0) -> list[Delta]:
    adapter, devices = fleet
    return [
        receive(devices[i % len(devices)], adapter, make_delta_tensors(adapter, seed=i), counter=i)
        for i in range(first, first + count)
    ]


def test_a_burst_of_uploads_wakes_each_shard_once_and_one_drain_per_shard_verifies_them_all(wakes, fleet):
    deltas = _upload(fleet, 40)
    shards = {verify_queue.shard_of(delta.pk) for delta in deltas}
    # 40 uploads, one task per shard (each raised its shard's flag; the rest found it up).
    assert sorted(wakes["delay"]) == sorted(shards)

    done = {shard: verify_queue.shard_drain(shard) for shard in wakes["delay"]}

    assert sum(done.values()) == 40
    assert all(done[shard] == sum(verify_queue.shard_of(d.pk) == shard for d in deltas) for shard in done)
    states = Delta.objects.filter(pk__in=[d.pk for d in deltas])
    assert set(states.values_list("state", flat=True)) == {Delta.State.ACCEPTED}
    assert not states.filter(round__isnull=True).exists()
    # Nothing left up: the next upload wakes its shard again, and a drain finding nothing does nothing.
    assert all(cache.get(verify_queue._flag(shard)) is None for shard in range(4))
    assert all(cache.get(verify_queue._lock(shard)) is None for shard in range(4))
    assert verify_queue.shard_drain(wakes["delay"][0]) == 0
    (late,) = _upload(fleet, 1, first=40)
    assert wakes["delay"][-1] == verify_queue.shard_of(late.pk) and len(wakes["delay"]) == len(shards) + 1


def test_a_delta_arriving_while_the_drainer_finishes_is_verified_by_it(wakes, fleet, monkeypatch, settings):
    settings.DELTA_VERIFY_SHARDS = 1  # every delta in shard 0
    (first,) = _upload(fleet, 1)
    assert wakes["delay"] == [0]
    real_received, arrivals = verify_queue._received, []

    def received_then_an_upload(shard, failed):
        batch = real_received(shard, failed)
        if not arrivals:  # after the drainer's look: a new delta commits and wakes the shard (its task is queued)
            arrivals.extend(_upload(fleet, 1, first=1))
        return batch

    monkeypatch.setattr(verify_queue, "_received", received_then_an_upload)

    assert verify_queue.shard_drain(0) == 2
    assert wakes["delay"] == [0, 0]  # the second wake was queued, and will find nothing left
    assert {d.state for d in Delta.objects.filter(pk__in=[first.pk, arrivals[0].pk])} == {Delta.State.ACCEPTED}
    monkeypatch.setattr(verify_queue, "_received", real_received)
    assert verify_queue.shard_drain(0) == 0


def test_a_delta_whose_verification_breaks_is_left_for_the_rescue_and_the_batch_goes_on(
    wakes, fleet, monkeypatch, settings, caplog
):
    import training.verification

    settings.DELTA_VERIFY_SHARDS = 1
    deltas = _upload(fleet, 5)
    broken = deltas[2].pk
    real_verify = training.verification.delta_verify_loaded

    def verify_unless_broken(delta, memo=None):
        if delta.pk == broken:
            raise RuntimeError("a bug in a check")
        return real_verify(delta, memo)

    monkeypatch.setattr(training.verification, "delta_verify_loaded", verify_unless_broken)

    assert verify_queue.shard_drain(0) == 5  # looked at five, one of them failed; the drain did not loop on it
    states = dict(Delta.objects.filter(pk__in=[d.pk for d in deltas]).values_list("pk", "state"))
    assert states.pop(broken) == Delta.State.RECEIVED
    assert set(states.values()) == {Delta.State.ACCEPTED}
    assert f"verifying delta {broken} failed" in caplog.text
    assert cache.get(verify_queue._lock(0)) is None

    # Beat's rescue (``verify_delta``, one by one) verifies it once the trouble is gone.
    monkeypatch.setattr(training.verification, "delta_verify_loaded", real_verify)
    from training.verification import delta_verify

    assert delta_verify(delta_id=broken).state == Delta.State.ACCEPTED


def test_a_shard_held_by_a_drainer_that_died_is_looked_at_again_once_its_lock_runs_out(wakes, fleet, settings):
    settings.DELTA_VERIFY_SHARDS = 1
    deltas = _upload(fleet, 3)
    cache.add(verify_queue._lock(0), 1, timeout=verify_queue.LOCK_SECONDS)  # a drainer killed mid-batch

    assert verify_queue.shard_drain(0) == 0
    assert verify_queue.shard_drain(0) == 0  # the redelivered task, say: one look again is queued, not two
    assert wakes["later"] == [((0,), verify_queue.LOCK_SECONDS + 1)]
    assert set(Delta.objects.filter(pk__in=[d.pk for d in deltas]).values_list("state", flat=True)) == {"received"}

    cache.delete(verify_queue._lock(0))  # the lock ran out
    assert verify_queue.shard_drain(0) == 3
    assert set(Delta.objects.filter(pk__in=[d.pk for d in deltas]).values_list("state", flat=True)) == {"accepted"}


def test_an_upload_is_kept_when_redis_is_away_to_queue_its_verification(wakes, fleet, monkeypatch, settings, caplog):
    from redis.exceptions import ConnectionError as RedisConnectionError

    def refuse(*args, **kwargs):
        raise RedisConnectionError("Connection refused")

    monkeypatch.setattr(cache, "add", refuse)
    (delta,) = _upload(fleet, 1)

    assert Delta.objects.get(pk=delta.pk).state == Delta.State.RECEIVED  # stored; beat's rescue verifies it
    assert wakes["delay"] == []
    assert f"could not queue verification of delta {delta.pk}" in caplog.text
