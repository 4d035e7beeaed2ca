"""Verification in batches (``training.federation.verify_queue``):
an upload wakes its shard's drainer only when it is not
awake already, a drainer verifies every received delta of its shard (also one that arrives while it finishes),
one delta failing does not stop the others, and a shard whose drainer died is looked at again. A batch's
outcomes, written together, are the ones each delta gets on its own: replays, rejections, full rounds.

The drains run in this process, against the real PostgreSQL and Redis; the task queue is replaced by a list,
so no worker takes part and every figure here is exact."""

from __future__ import annotations

import pytest
from django.core.cache import cache

from tests.training.test_rounds import make_delta_tensors, receive
from training.federation import verify_queue
from training.models import Delta
from training.registry.services import adapter_set_aggregation, version_create_seeded

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def wakes(monkeypatch, settings):
    """The shards whose drain task was queued, in order (``dispatch.verify_shard``), the delayed looks again
    (with a countdown) and the closed rounds handed to aggregation (``dispatch.aggregate_round``, kept from the
    test session's Celery worker, whose aggregation would race the teardown's flush); every flag, lock and
    look-again mark starts down, and is lowered again after the test."""
    from training import dispatch

    settings.DELTA_VERIFY_SHARDS = shards = 4  # a test may lower it; its shards are among these

    def lower_everything():
        for shard in range(shards):
            cache.delete_many([verify_queue._flag(shard), verify_queue._lock(shard), verify_queue._recheck(shard)])

    lower_everything()
    queued: dict[str, list] = {"delay": [], "later": [], "aggregate": []}

    def verify_shard(shard, *, countdown=None):
        if countdown is None:
            queued["delay"].append(shard)
        else:
            queued["later"].append(((shard,), countdown))

    monkeypatch.setattr(dispatch, "verify_shard", verify_shard)
    monkeypatch.setattr(dispatch, "aggregate_round", lambda round_id: queued["aggregate"].append(round_id))
    yield queued
    lower_everything()  # a flag raised here has no task behind it: it must not hold back a later test's wake


@pytest.fixture
def fleet(adapter, cohort, enrolled):
    adapter.cohorts.add(cohort)
    version_create_seeded(adapter=adapter, seed=3)
    devices = [enrolled("active", name=f"d{i}") for i in range(5)]
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation={"buffer_size": 100, "min_deltas": 1})
    adapter.refresh_from_db()
    return adapter, devices


@pytest.fixture
def batch_only(monkeypatch):
    """Fail any delta the batch path does not record itself: the one-by-one fallbacks (``delta_verify``, and
    ``_record_one_by_one`` after a replay) raise, and a delta they would have verified stays ``received``."""
    import training.federation.verification

    def fell_back(*args, **kwargs):
        raise AssertionError("the batch fell back to one by one")

    monkeypatch.setattr(training.federation.verification, "delta_verify", fell_back)
    monkeypatch.setattr(training.federation.verification, "_record_one_by_one", fell_back)


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


@pytest.fixture
def broken_checks(monkeypatch) -> set[int]:
    """The ids of deltas whose checks raise (a bug in a check, say): a set the test fills, and may clear."""
    import training.federation.verification

    broken: set[int] = set()
    real_judge = training.federation.verification.delta_judge

    def judge_unless_broken(delta, memo=None):
        if delta.pk in broken:
            raise RuntimeError("a bug in a check")
        return real_judge(delta, memo)

    monkeypatch.setattr(training.federation.verification, "delta_judge", judge_unless_broken)
    return broken


def test_a_delta_whose_verification_breaks_is_left_for_the_rescue_and_the_batch_goes_on(
    wakes, fleet, broken_checks, settings, caplog
):
    settings.DELTA_VERIFY_SHARDS = 1
    deltas = _upload(fleet, 5)
    broken = deltas[2].pk
    broken_checks.add(broken)

    assert verify_queue.shard_drain(0) == 5  # looked at five, one of them failed; the drain did not loop on it
    states = dict(Delta.objects.filter(pk__in=[d.pk for d in deltas]).values_list("pk", "state"))
    assert states.pop(broken) == Delta.State.RECEIVED
    assert set(states.values()) == {Delta.State.ACCEPTED}
    assert f"verifying delta {broken} failed" in caplog.text
    assert cache.get(verify_queue._lock(0)) is None

    # Beat's rescue (``verify_delta``, one by one) verifies it once the trouble is gone.
    broken_checks.clear()
    from training.federation.verification import delta_verify

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


def test_a_drainer_that_outlived_its_lock_neither_renews_nor_frees_its_successor_s_and_stops(
    wakes, fleet, monkeypatch, settings, caplog
):
    settings.DELTA_VERIFY_SHARDS = 1
    deltas = _upload(fleet, verify_queue.BATCH + 4)
    real_batch, successor = verify_queue._verify_batch, []

    def slow_batch(batch, failed):
        real_batch(batch, failed)
        if not successor:  # the batch outlasted LOCK_SECONDS: the lock ran out and another drainer took it
            cache.delete(verify_queue._lock(0))
            successor.append(12345)
            assert cache.add(verify_queue._lock(0), 12345, timeout=5)  # (5 s: a renewal would show)

    monkeypatch.setattr(verify_queue, "_verify_batch", slow_batch)

    assert verify_queue.shard_drain(0) == verify_queue.BATCH  # it stopped after that batch
    key = cache.make_and_validate_key(verify_queue._lock(0))
    assert cache.get(verify_queue._lock(0)) == 12345  # the successor's lock, kept ...
    assert 0 < cache._cache.get_client(key).ttl(key) <= 5  # ... and not renewed by the drainer that lost it
    assert "drain lock ran out" in caplog.text
    assert wakes["later"] == [((0,), 1)]  # a look again soon, in case the successor is gone
    assert Delta.objects.filter(pk__in=[d.pk for d in deltas], state="received").count() == 4

    cache.delete(verify_queue._lock(0))  # the successor finished; the look again drains the rest
    cache.delete(verify_queue._recheck(0))
    assert verify_queue.shard_drain(0) == 4
    assert set(Delta.objects.filter(pk__in=[d.pk for d in deltas]).values_list("state", flat=True)) == {"accepted"}
    assert cache.get(verify_queue._lock(0)) is None  # its own lock freed


def test_an_upload_is_kept_when_redis_is_away_to_queue_its_verification(wakes, fleet, monkeypatch, settings, caplog):
    from redis.exceptions import ConnectionError as RedisConnectionError

    def refuse(*args, **kwargs):
        raise RedisConnectionError("Connection refused")

    monkeypatch.setattr(cache, "add", refuse)
    (delta,) = _upload(fleet, 1)

    assert Delta.objects.get(pk=delta.pk).state == Delta.State.RECEIVED  # stored; beat's rescue verifies it
    assert wakes["delay"] == []
    assert f"could not queue verification of delta {delta.pk}" in caplog.text


def _rounds_of(deltas) -> dict[int, int]:
    """How many of these accepted deltas each round holds."""
    rows = Delta.objects.filter(pk__in=[d.pk for d in deltas], state=Delta.State.ACCEPTED).values_list("round_id")
    counts: dict[int, int] = {}
    for (round_id,) in rows:
        counts[round_id] = counts.get(round_id, 0) + 1
    return counts


def test_a_batch_running_past_a_full_round_fills_it_closes_it_and_opens_the_next(wakes, fleet, settings, batch_only):
    from training.models import Round

    settings.DELTA_VERIFY_SHARDS = 1
    adapter, _ = fleet
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation={"buffer_size": 5, "min_deltas": 1})
    deltas = _upload(fleet, 3)
    assert verify_queue.shard_drain(0) == 3  # a round collecting, with 3 of 5
    deltas += _upload(fleet, 13, first=3)  # one batch of 13 (BATCH is 16)

    assert verify_queue.shard_drain(0) == 13

    rounds = {r.pk: r for r in Round.objects.filter(adapter=adapter)}
    per_round = _rounds_of(deltas)
    assert None not in per_round and sum(per_round.values()) == 16
    assert sorted(per_round.values()) == [1, 5, 5, 5]  # three full rounds and the next one collecting
    closed = [pk for pk, count in per_round.items() if count == 5]
    assert all(
        rounds[pk].state == Round.State.AGGREGATING and rounds[pk].close_reason == "buffer_full" for pk in closed
    )
    assert sorted(wakes["aggregate"]) == sorted(closed)  # each closed round handed to aggregation once
    (open_pk,) = [pk for pk, count in per_round.items() if count == 1]
    assert rounds[open_pk].state == Round.State.COLLECTING
    # in upload order: the round that was collecting takes two more, then five per round
    by_id = dict(Delta.objects.filter(pk__in=[d.pk for d in deltas]).values_list("pk", "round_id"))
    order = [by_id[d.pk] for d in sorted(deltas, key=lambda d: d.pk)]
    assert order == [order[0]] * 5 + [order[5]] * 5 + [order[10]] * 5 + [order[15]]


def test_a_batch_with_a_replay_and_rejections_gives_each_delta_its_own_outcome(
    wakes, fleet, settings, caplog, monkeypatch
):
    import math

    import training.federation.verification
    from devices.models import Device
    from training.models import Round

    settings.DELTA_VERIFY_SHARDS = 1
    adapter, devices = fleet
    real_judge, judged = training.federation.verification.delta_judge, []

    def counting_judge(delta, memo=None):
        judged.append(delta.pk)
        return real_judge(delta, memo)

    monkeypatch.setattr(training.federation.verification, "delta_judge", counting_judge)
    good = _upload(fleet, 4)  # counters 0..3 on devices 0..3
    replay = receive(devices[0], adapter, make_delta_tensors(adapter, seed=50), counter=0)  # device 0's counter again
    tensors = make_delta_tensors(adapter, seed=51)
    next(iter(tensors.values()))[0] = math.nan
    not_finite = receive(devices[1], adapter, tensors, counter=7)
    suspended = receive(devices[4], adapter, make_delta_tensors(adapter, seed=52), counter=8)
    Device.objects.filter(pk=devices[4].device.pk).update(status="suspended")

    assert verify_queue.shard_drain(0) == 7

    got = {d.pk: d for d in Delta.objects.filter(pk__in=[d.pk for d in [*good, replay, not_finite, suspended]])}
    assert {got[d.pk].state for d in good} == {Delta.State.ACCEPTED}
    assert (got[replay.pk].state, got[replay.pk].rejection_code) == ("rejected", "replayed_counter")
    assert (got[not_finite.pk].state, got[not_finite.pk].rejection_code) == ("rejected", "not_finite")
    assert got[not_finite.pk].counter_claimed  # a later check's failure still uses the counter up
    assert (got[suspended.pk].rejection_code, got[suspended.pk].counter_claimed) == ("device_not_active", False)
    assert all(got[pk].round_id is None for pk in (replay.pk, not_finite.pk, suspended.pk))
    (round_,) = Round.objects.filter(adapter=adapter)
    assert _rounds_of(good) == {round_.pk: 4}
    assert "recording them one by one" not in caplog.text  # a replay is not a failure: recorded one by one
    assert len(judged) == 7  # ... with the verdicts the batch had: no delta's checks ran twice


def test_rejections_in_a_batch_are_written_by_the_batch_as_delta_verify_writes_them(wakes, fleet, settings, batch_only):
    import math

    from devices.models import Device

    settings.DELTA_VERIFY_SHARDS = 1
    adapter, devices = fleet
    good = _upload(fleet, 2)
    tensors = make_delta_tensors(adapter, seed=51)
    next(iter(tensors.values()))[0] = math.inf
    not_finite = receive(devices[2], adapter, tensors, counter=7)
    stale = receive(devices[3], adapter, make_delta_tensors(adapter, seed=53), counter=9, base_version=7)
    suspended = receive(devices[4], adapter, make_delta_tensors(adapter, seed=52), counter=8)
    Device.objects.filter(pk=devices[4].device.pk).update(status="suspended")

    assert verify_queue.shard_drain(0) == 5

    got = {d.pk: d for d in Delta.objects.filter(pk__in=[d.pk for d in [*good, not_finite, stale, suspended]])}
    assert {got[d.pk].state for d in good} == {Delta.State.ACCEPTED}
    assert all(got[d.pk].encoding == "f32" and got[d.pk].norm > 0 and got[d.pk].round_id for d in good)
    expected = {  # code, counter claimed, adapter known, base version known
        not_finite.pk: ("not_finite", True, True, True),
        stale.pk: ("unknown_base_version", True, True, False),
        suspended.pk: ("device_not_active", False, False, False),
    }
    for pk, (code, claimed, has_adapter, has_base) in expected.items():
        delta = got[pk]
        assert (delta.state, delta.rejection_code, delta.counter_claimed) == ("rejected", code, claimed), pk
        assert (delta.adapter_id is not None, delta.base_version_id is not None) == (has_adapter, has_base), pk
        assert delta.rejection_detail and delta.verified_at and delta.round_id is None and delta.norm is None


def test_a_batch_of_two_adapters_puts_each_delta_in_its_own_adapter_s_round(
    wakes, fleet, settings, batch_only, base_model, cohort, make_user
):
    from training.models import Round
    from training.registry.services import adapter_create

    settings.DELTA_VERIFY_SHARDS = 1
    adapter, devices = fleet
    other = adapter_create(name="digits-lora-2", base_model=base_model, rank=4, alpha=8.0, actor=make_user("admin"))
    other.cohorts.add(cohort)
    version_create_seeded(adapter=other, seed=4)
    mine = _upload(fleet, 3)
    theirs = [receive(devices[i], other, make_delta_tensors(other, seed=60 + i), counter=20 + i) for i in range(3)]

    assert verify_queue.shard_drain(0) == 6

    (round_a,) = Round.objects.filter(adapter=adapter)
    (round_b,) = Round.objects.filter(adapter=other)
    assert _rounds_of(mine) == {round_a.pk: 3} and _rounds_of(theirs) == {round_b.pk: 3}


def test_a_batch_for_an_adapter_that_opens_no_rounds_leaves_its_deltas_accepted_and_waiting(
    wakes, fleet, settings, batch_only
):
    from training.models import Round

    settings.DELTA_VERIFY_SHARDS = 1
    adapter, _ = fleet
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation={"auto_rounds": False})
    deltas = _upload(fleet, 4)

    assert verify_queue.shard_drain(0) == 4

    assert not Round.objects.filter(adapter=adapter).exists()
    rows = Delta.objects.filter(pk__in=[d.pk for d in deltas])
    assert set(rows.values_list("state", "round_id")) == {(Delta.State.ACCEPTED, None)}


def test_a_batch_leaves_out_a_delta_verified_meanwhile_and_counts_it_once(wakes, fleet, settings):
    from training.federation.verification import delta_judge, delta_record_batch, delta_verify

    settings.DELTA_VERIFY_SHARDS = 1
    deltas = _upload(fleet, 3)
    batch = verify_queue._received(0, set())
    judged = [(delta, delta_judge(delta, {})) for delta in batch]
    first = delta_verify(delta_id=deltas[0].pk)  # the rescue, say, got there first

    recorded = delta_record_batch(judged)

    assert [d.pk for d in recorded] == [d.pk for d in deltas[1:]]
    assert sum(_rounds_of(deltas).values()) == 3 and list(_rounds_of(deltas)) == [first.round_id]


# --- a delta whose verification never finishes: tries counted, a cap, and no other delta held back ---

CRASHING_DRAIN = """
import os

import django

django.setup()

import training.federation.verification
from training.federation import verify_queue
from training.tasks import aggregate_round, verify_shard

verify_shard.delay = verify_shard.apply_async = aggregate_round.delay = lambda *args, **kwargs: None
poison, judge = int(os.environ["POISON"]), training.federation.verification.delta_judge


def dies_on_poison(delta, memo=None):
    if delta.pk == poison:
        os._exit(70)  # the process dies in the checks, as a worker crashing or killed for its memory would
    return judge(delta, memo)


training.federation.verification.delta_judge = dies_on_poison
print(verify_queue.shard_drain(0))
"""


def test_a_delta_that_kills_its_worker_every_time_is_rejected_after_the_cap_and_every_other_delta_counted_once(
    wakes, fleet, shared_blob_root
):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT, _test_database_url
    from training.selectors import deltas_awaiting_rescue

    deltas = _upload(fleet, 5)
    poison = deltas[2].pk
    env = {
        **os.environ,
        "DATABASE_URL": _test_database_url(),
        "BLOB_ROOT": str(shared_blob_root),
        "DELTA_VERIFY_SHARDS": "1",
        "DELTA_VERIFY_MAX_ATTEMPTS": "2",
        "POISON": str(poison),
    }

    def drain_in_a_process() -> subprocess.CompletedProcess:
        cache.delete(verify_queue._lock(0))  # a dead drainer's lock runs out
        return subprocess.run(
            [sys.executable, "-c", CRASHING_DRAIN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )

    def rows() -> dict[int, Delta]:
        return Delta.objects.in_bulk([d.pk for d in deltas])

    # 1: the whole batch is begun together and the process dies on the poison: nothing recorded, tries counted.
    assert drain_in_a_process().returncode == 70
    assert cache.get(verify_queue._lock(0)) is not None  # it died holding its shard
    assert {(d.state, d.verify_attempts) for d in rows().values()} == {("received", 1)}
    # 2: each delta tried before goes on its own, fewest tries first: the two before the poison get through.
    assert drain_in_a_process().returncode == 70
    got = rows()
    assert [got[d.pk].state for d in deltas] == ["accepted", "accepted", "received", "received", "received"]
    assert got[poison].verify_attempts == 2
    # 3: the two after it (one try each) go first; the poison is past the cap and rejected without its checks.
    done = drain_in_a_process()
    assert (done.returncode, done.stdout.strip()) == (0, "3"), done.stderr
    got = rows()
    assert [got[d.pk].state for d in deltas] == ["accepted", "accepted", "rejected", "accepted", "accepted"]
    assert got[poison].rejection_code == "verification_failed" and not got[poison].counter_claimed
    assert "begun 2 times and never finished" in got[poison].rejection_detail
    assert got[poison].verify_attempts == 3 and got[poison].round_id is None
    honest = [d for d in deltas if d.pk != poison]
    assert len(_rounds_of(honest)) == 1 and sum(_rounds_of(honest).values()) == 4  # each counted once
    assert poison not in deltas_awaiting_rescue()  # the rescue stops coming back to it
    assert verify_queue.shard_drain(0) == 0


def test_a_delta_whose_checks_raise_every_time_is_rejected_after_the_cap_not_rescued_for_ever(
    wakes, fleet, broken_checks, settings
):
    from training.federation.verification import delta_verify

    settings.DELTA_VERIFY_SHARDS = 1
    settings.DELTA_VERIFY_MAX_ATTEMPTS = 3
    deltas = _upload(fleet, 3)
    broken = deltas[1].pk
    broken_checks.add(broken)

    assert verify_queue.shard_drain(0) == 3  # try 1, in the batch; the others accepted
    assert verify_queue.shard_drain(0) == 1  # try 2, on its own
    with pytest.raises(RuntimeError):  # try 3: the rescue's (one by one)
        delta_verify(delta_id=broken)
    assert delta_verify(delta_id=broken).rejection_code == "verification_failed"  # try 4, past the cap: no checks
    assert delta_verify(delta_id=broken) is None
    row = Delta.objects.get(pk=broken)
    assert (row.state, row.rejection_code, row.verify_attempts) == ("rejected", "verification_failed", 4)
    accepted = Delta.objects.filter(pk__in=[d.pk for d in deltas], state="accepted")
    assert set(accepted.values_list("verify_attempts", flat=True)) == {1}  # one run each: the batch's
