"""Rounds: deltas racing a close, aggregation by a real Celery worker equal to the reference computation,
sharded (chord) aggregation identical to one worker's, DP budget refusing a round."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
import torch
from django.db import connection
from django.utils import timezone
from safetensors.torch import load as load_safetensors

from core.errors import DomainError
from edge_agent.delta import encode_delta, sign_delta
from tests.conftest import worker_log
from training import dispatch
from training.federation.aggregation import aggregation_lock, round_aggregate, round_deltas, round_plan
from training.federation.intake import upload_append, upload_begin
from training.federation.rounds import round_close, round_open, stalled_rounds
from training.federation.verification import delta_verify
from training.models import AdapterVersion, Delta, Round, TrainingEvent
from training.registry.blobs import blob_read
from training.registry.services import adapter_set_aggregation
from training.tasks import aggregate_round, requeue_stalled_rounds, requeue_unverified_deltas


def make_delta_tensors(adapter, seed: int, scale: float = 0.01) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(tuple(entry["shape"]), generator=generator) * scale
        for name, entry in adapter.tensor_spec.items()
    }


def receive(device, adapter, tensors, *, counter: int, samples: int = 10, base_version: int = 1) -> Delta:
    """A delta through the real intake service (the code REST and the socket call)."""
    data = encode_delta(tensors)
    signed = sign_delta(
        device.key,
        data,
        device_id=device.id,
        adapter=adapter.name,
        base_version=base_version,
        num_samples=samples,
        counter=counter,
    )
    upload_begin(device=device.device, envelope=signed["envelope"], signature=signed["signature"], channel="rest")
    state = upload_append(
        device=device.device, sha256=signed["envelope"]["sha256"], offset=0, data=data, channel="rest"
    )
    return state.delta


def revoke_delayed_tasks() -> None:
    """Revoke the tasks an earlier test left waiting in the session's worker: a drain's look again
    (``verify_queue.shard_drain`` queues one LOCK_SECONDS + 1 later) would verify this test's deltas of its
    shard when it fires."""
    from fleet.celery import app

    scheduled = app.control.inspect(timeout=2).scheduled() or {}
    ids = [entry["request"]["id"] for entries in scheduled.values() for entry in entries]
    if ids:
        app.control.revoke(ids)


def fleet_state() -> str:
    """The rounds and deltas as the database holds them, and the end of the session worker's log: what a wait
    that timed out reports."""
    rounds = list(Round.objects.order_by("pk").values("pk", "state", "close_reason", "buffer_size", "failure"))
    fields = ("pk", "state", "round_id", "rejection_code", "rejection_detail", "verify_attempts")
    deltas = list(Delta.objects.order_by("pk").values(*fields))
    log = worker_log("test")  # the session worker's (``celery_worker_process``)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log.exists() else "(no worker log)"
    return f"rounds: {rounds}\ndeltas: {deltas}\nthe worker's log, last lines:\n{tail}"


def wait_for(check, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s\n{fleet_state()}")


@pytest.mark.django_db(transaction=True)
def test_a_hundred_deltas_racing_the_close_are_each_counted_in_exactly_one_round(trained, make_user):
    adapter, _, devices = trained
    # Every close makes a version once the session's Celery worker (when one runs) aggregates it, and that
    # worker also verifies these deltas as they arrive: with the default staleness bound (4) a delta verified
    # after the fifth version would rightly be rejected as stale. This test is about counting, not staleness.
    adapter_set_aggregation(
        adapter=adapter, actor=None, aggregation={"buffer_size": 30, "min_deltas": 1, "max_staleness": 1000}
    )
    adapter.refresh_from_db()
    received = [receive(devices[i % 5], adapter, make_delta_tensors(adapter, seed=i), counter=i) for i in range(100)]
    operator = make_user("operator")
    errors: list[BaseException] = []

    def verify_slice(ids):
        try:
            for pk in ids:
                delta_verify(delta_id=pk)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            connection.close()

    def close_repeatedly():
        try:
            for _ in range(40):
                for round_ in Round.objects.filter(state=Round.State.COLLECTING):
                    try:
                        round_close(round_=round_, actor=operator)
                    except Exception as exc:  # an empty or already-closed round is refused: that is fine
                        if getattr(exc, "code", None) not in ("round_empty", "invalid_transition"):
                            raise
                time.sleep(0.005)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    ids = [d.pk for d in received]
    threads = [threading.Thread(target=verify_slice, args=(ids[i::4],)) for i in range(4)]
    threads.append(threading.Thread(target=close_repeatedly))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    deltas = list(Delta.objects.all())
    assert len(deltas) == 100
    assert all(d.state in ("accepted", "aggregated") for d in deltas), [
        (d.pk, d.state, d.rejection_code, d.rejection_detail) for d in deltas if d.state == "rejected"
    ]
    assert all(d.round_id is not None for d in deltas), "a delta was left out of every round"
    per_round = {}
    for d in deltas:
        per_round[d.round_id] = per_round.get(d.round_id, 0) + 1
    rounds = Round.objects.filter(pk__in=per_round)
    assert sum(per_round.values()) == 100
    assert all(per_round[r.pk] <= r.buffer_size for r in rounds)
    assert Round.objects.filter(state=Round.State.COLLECTING).count() <= 1


@pytest.mark.django_db(transaction=True)
def test_a_real_worker_aggregates_a_full_round_into_the_fedavg_of_its_deltas(trained, celery_worker_process):
    adapter, version, devices = trained
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation={"buffer_size": 4, "min_deltas": 2})
    tensors = [make_delta_tensors(adapter, seed=10 + i) for i in range(4)]
    samples = [5, 10, 20, 40]
    for i, (device, delta) in enumerate(zip(devices, tensors, strict=False)):
        receive(device, adapter, delta, counter=1, samples=samples[i])
    # The upload enqueued each verification; the worker verifies, closes the full round and aggregates.
    result = wait_for(lambda: AdapterVersion.objects.filter(round__isnull=False).first())
    round_ = Round.objects.get()
    assert round_.state == Round.State.COMPLETED and round_.close_reason == "buffer_full"
    assert result.number == 2 and result.parent == version and result.source == "round"
    assert Delta.objects.filter(state="aggregated").count() == 4
    base = load_safetensors(blob_read(version.blob_sha256))
    got = load_safetensors(blob_read(result.blob_sha256))
    total = sum(samples)
    for name in base:
        reference = base[name] + sum(t[name] * (n / total) for t, n in zip(tensors, samples, strict=True))
        torch.testing.assert_close(got[name], reference, rtol=1e-5, atol=1e-6)
    assert "eval_accuracy" in result.metrics  # digits-cnn has a server evaluation set


@pytest.fixture(scope="module")
def two_more_workers(celery_worker_process, shared_blob_root):
    """Two more real Celery workers (one process each) beside the session's: a chord's tasks spread over
    three workers."""
    from tests.conftest import start_worker, stop_worker

    started = [start_worker(name=f"span{i}", blob_root=shared_blob_root, WORKER_CONCURRENCY="1")[0] for i in (1, 2)]
    yield started
    for process in started:
        stop_worker(process)


def five_deltas_on_three_workers(trained, settings, *, seed: int, aggregation: dict, dp: dict | None = None):
    """A round of five deltas with ``shard_size`` 2, opened with three aggregation workers (fixed in the round's
    params, so every process cuts alike) and aggregated by the real workers: ``(version, round)``."""
    adapter, _, devices = trained
    aggregation = {**aggregation, "buffer_size": 5, "min_deltas": 1, "shard_size": 2}
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation=aggregation, dp=dp)
    settings.AGGREGATION_WORKERS = 3
    round_open(adapter=adapter)
    for i in range(5):
        receive(devices[i], adapter, make_delta_tensors(adapter, seed=seed + i), counter=1, samples=3 + i)
    made = wait_for(lambda: AdapterVersion.objects.filter(round__isnull=False).first())
    round_ = Round.objects.get()
    assert round_.params["workers"] == 3 and round_.state == Round.State.COMPLETED
    assert AdapterVersion.objects.filter(round=round_).count() == 1
    return made, round_


def plan_as_closed(round_: Round):
    """The round's plan with its deltas as they were when it closed (accepted): what its chord ran."""
    Delta.objects.filter(round=round_).update(state="accepted")
    return round_plan(round_, round_deltas(round_))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("strategy", ["fedavg", "fedbuff"])
def test_a_mean_round_split_by_coordinates_across_workers_equals_one_workers_result(
    trained, two_more_workers, settings, strategy
):
    """Without DP, a mean round over more deltas than a shard runs as a chord of coordinate spans, one per
    aggregation worker (each task reads its span of every delta and stores that span's float32 values): the
    version's bytes are those of the same round aggregated on one worker."""
    spread, round_ = five_deltas_on_three_workers(trained, settings, seed=40, aggregation={"strategy": strategy})
    assert round_.stats["shards"] == 3 and 1 <= round_.stats["workers"] <= 3
    plan = plan_as_closed(round_)
    assert plan.shards is None and len(plan.spans) == 3 and not plan.gram
    # The same round, aggregated again on one worker (this process), gives the very same bytes.
    Round.objects.filter(pk=round_.pk).update(state=Round.State.AGGREGATING)
    AdapterVersion.objects.filter(pk=spread.pk).update(round=None)
    single = round_aggregate(round_id=round_.pk)
    assert single.blob_sha256 == spread.blob_sha256


@pytest.mark.django_db(transaction=True)
def test_a_dp_round_is_split_by_shards_of_deltas(trained, two_more_workers, settings):
    """With server-side DP the noise is drawn once for the whole sum, so a round over more deltas than a shard
    runs as a chord of shards of deltas (float64 partial sums, combined in shard order, then noised), not of
    coordinate spans: one version, from the three shards."""
    dp = {"enabled": True, "noise_multiplier": 0.5, "epsilon_budget": 1000.0, "sample_rate": 1.0}
    released, round_ = five_deltas_on_three_workers(trained, settings, seed=50, aggregation={}, dp=dp)
    assert "dp" in round_.params and round_.stats["shards"] == 3
    plan = plan_as_closed(round_)
    assert plan.spans is None and [len(ids) for ids in plan.shards] == [1, 2, 2]
    assert released.blob_sha256 != trained[1].blob_sha256


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("strategy", "mixing"),
    [("median", "none"), ("trimmed_mean", "nnm"), ("krum", None)],
    ids=["median", "trimmed+mixing", "krum"],
)
def test_a_robust_round_split_by_coordinates_across_workers_equals_one_workers_result(
    trained, two_more_workers, strategy, mixing
):
    """Over more deltas than a shard, a robust rule runs as a chord of coordinate spans (each task reads its
    span of every delta; with mixing or Krum, a chord of the spans' Gram matrices first): the version's
    bytes are those of the same round aggregated on one worker."""
    adapter, version, devices = trained
    aggregation = {"strategy": strategy, "mixing": mixing, "buffer_size": 5, "min_deltas": 1, "shard_size": 2}
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation={**aggregation, "coordinate_shards": 3})
    for i in range(5):
        receive(devices[i], adapter, make_delta_tensors(adapter, seed=70 + i), counter=1, samples=3 + i)
    spread = wait_for(lambda: AdapterVersion.objects.filter(round__isnull=False).first())
    round_ = Round.objects.get()
    assert round_.stats["shards"] == 3 and round_.state == Round.State.COMPLETED
    assert 1 <= round_.stats["workers"] <= 3  # which workers took the tasks is the broker's choice
    # The same round, aggregated again on one worker (this process), gives the very same bytes.
    Round.objects.filter(pk=round_.pk).update(state=Round.State.AGGREGATING)
    AdapterVersion.objects.filter(pk=spread.pk).update(round=None)
    Delta.objects.filter(round=round_).update(state="accepted")
    single = round_aggregate(round_id=round_.pk)
    assert single.blob_sha256 == spread.blob_sha256


@pytest.mark.django_db(transaction=True)
def test_a_round_set_to_mix_aggregates_the_median_of_each_delta_s_nearest_mean(trained, monkeypatch):
    """The adapter's ``mixing`` reaches the round's params and the strategy (checked against a brute-force
    nearest-neighbour mixing and median over the flattened deltas)."""
    # verified and aggregated right here (no wake flag raised either, so no later test waits on it)
    monkeypatch.setattr("training.federation.verify_queue.queue_verification", lambda delta_id: None)
    monkeypatch.setattr(dispatch, "aggregate_round", lambda round_id: None)
    adapter, version, devices = trained
    aggregation = {"strategy": "median", "mixing": "nnm", "byzantine": 1, "buffer_size": 5, "min_deltas": 1}
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation=aggregation)
    tensors = [make_delta_tensors(adapter, seed=60 + i, scale=0.01 * (1 + i)) for i in range(5)]
    for device, delta in zip(devices, tensors, strict=True):
        assert delta_verify(delta_id=receive(device, adapter, delta, counter=1).pk).state == "accepted"
    round_ = Round.objects.get()
    assert round_.state == Round.State.AGGREGATING and round_.params["mixing"] == "nnm"
    result = round_aggregate(round_id=round_.pk)

    names = list(adapter.tensor_spec)
    flat = torch.stack([torch.cat([t[name].double().reshape(-1) for name in names]) for t in tensors])
    mixed = []
    for i in range(5):  # each delta's 4 nearest (N - f), itself first
        order = sorted(range(5), key=lambda j: (j != i, float((flat[i] - flat[j]).square().sum())))
        mixed.append(flat[order[:4]].mean(0))
    want = torch.stack(mixed).median(dim=0).values
    plain = flat.median(dim=0).values
    base = load_safetensors(blob_read(version.blob_sha256))
    got = load_safetensors(blob_read(result.blob_sha256))
    got_flat = torch.cat([(got[name] - base[name]).double().reshape(-1) for name in names])
    torch.testing.assert_close(got_flat, want, rtol=1e-4, atol=1e-6)
    assert float((got_flat - plain).abs().max()) > 1e-3  # not what median without mixing gives


@pytest.mark.django_db
def test_a_round_that_would_pass_the_dp_budget_does_not_start_and_says_so(trained, make_user):
    adapter, _, _ = trained
    adapter_set_aggregation(
        adapter=adapter,
        actor=None,
        dp={"enabled": True, "noise_multiplier": 0.5, "epsilon_budget": 0.5, "sample_rate": 1.0},
    )
    adapter.refresh_from_db()
    with pytest.raises(DomainError) as refused:
        round_open(adapter=adapter, actor=make_user("operator"))
    assert refused.value.code == "dp_budget_exhausted" and "budget" in refused.value.message
    assert not Round.objects.exists()
    assert TrainingEvent.objects.filter(kind="round.refused", adapter=adapter).exists()


@pytest.mark.django_db(transaction=True)
def test_a_delta_whose_verification_task_was_lost_is_queued_again_and_verified_once(
    trained, celery_worker_process, monkeypatch, settings
):
    from datetime import timedelta

    adapter, _, devices = trained
    revoke_delayed_tasks()
    # The upload commits but its verification task never reaches the broker (the web process died, or Redis
    # was away, between the commit and the publish).
    lost = []
    with monkeypatch.context() as patch:
        patch.setattr("training.federation.verify_queue.queue_verification", lambda delta_id: lost.append(delta_id))
        delta = receive(devices[0], adapter, make_delta_tensors(adapter, seed=70), counter=1)
    assert lost == [delta.pk]
    recent = receive(devices[1], adapter, make_delta_tensors(adapter, seed=71), counter=1)
    wait_for(lambda: Delta.objects.get(pk=recent.pk).state != Delta.State.RECEIVED)
    assert Delta.objects.get(pk=delta.pk).state == Delta.State.RECEIVED

    Delta.objects.filter(pk=delta.pk).update(
        received_at=timezone.now() - timedelta(seconds=settings.DELTA_VERIFY_RESCUE_SECONDS + 5)
    )
    requeue_unverified_deltas.delay()
    rescued = wait_for(lambda: Delta.objects.exclude(state=Delta.State.RECEIVED).filter(pk=delta.pk).first())
    assert rescued.state == Delta.State.ACCEPTED and rescued.round_id is not None
    # Queued again a second time (the beat task runs every minute), it changes nothing.
    requeue_unverified_deltas.delay()
    time.sleep(2)
    assert Delta.objects.filter(state=Delta.State.ACCEPTED).count() == 2
    assert Delta.objects.get(pk=delta.pk).verified_at == rescued.verified_at


@pytest.mark.django_db(transaction=True)
def test_a_round_whose_aggregation_task_was_lost_is_aggregated_again_once(
    trained, celery_worker_process, monkeypatch, settings, make_user
):
    from datetime import timedelta

    adapter, _, devices = trained
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation={"buffer_size": 30, "min_deltas": 1})
    adapter.refresh_from_db()
    for i in range(3):
        receive(devices[i], adapter, make_delta_tensors(adapter, seed=80 + i), counter=1)
    wait_for(lambda: Delta.objects.filter(state=Delta.State.ACCEPTED).count() == 3)
    # The round closes but its task never reaches a worker (the broker was away, or the worker that held it
    # was killed: the broker hands it out again only after its visibility timeout).
    with monkeypatch.context() as patch:
        patch.setattr(dispatch, "aggregate_round", lambda round_id: None)
        round_ = round_close(round_=Round.objects.get(), actor=make_user("operator"))
    assert round_.state == Round.State.AGGREGATING
    closed_long_ago = timezone.now() - timedelta(seconds=settings.ROUND_AGGREGATION_RESCUE_SECONDS + 5)
    Round.objects.filter(pk=round_.pk).update(closed_at=closed_long_ago)

    with aggregation_lock(round_.pk) as held:  # as a worker aggregating it right now would hold it
        assert held
        requeue_stalled_rounds.delay()
        time.sleep(2)
        assert Round.objects.get(pk=round_.pk).state == Round.State.AGGREGATING
    requeue_stalled_rounds.delay()
    done = wait_for(lambda: Round.objects.filter(pk=round_.pk, state=Round.State.COMPLETED).first())
    requeue_stalled_rounds.delay()  # again (beat runs it every minute): nothing more happens
    time.sleep(2)
    assert AdapterVersion.objects.filter(round=done).count() == 1
    assert done.stats["deltas"] == 3 == Delta.objects.filter(round=done, state=Delta.State.AGGREGATED).count()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_aggregation_that_finds_the_database_refusing_connections_is_tried_again_and_makes_one_version(
    trained, celery_worker_process, monkeypatch, make_user
):
    """PostgreSQL refusing new connections for a moment (a restart, "too many clients"): the aggregation task
    is tried again a few seconds later and makes the version, where before it failed and the round waited for
    beat's rescue (``ROUND_AGGREGATION_RESCUE_SECONDS``)."""
    adapter, _, devices = trained
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation={"buffer_size": 30, "min_deltas": 1})
    for i in range(3):
        receive(devices[i], adapter, make_delta_tensors(adapter, seed=90 + i), counter=1)
    wait_for(lambda: Delta.objects.filter(state=Delta.State.ACCEPTED).count() == 3)
    with monkeypatch.context() as patch:  # closed without its task: this test sends it
        patch.setattr(dispatch, "aggregate_round", lambda round_id: None)
        round_ = round_close(round_=Round.objects.get(), actor=make_user("operator"))
    name = connection.settings_dict["NAME"]
    database = connection.ops.quote_name(name)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        mine = cursor.fetchone()[0]
    # As a restart looks to a worker: its open connections are ended and new ones refused (said from another
    # database: PostgreSQL refuses it from the one it applies to). This test's own connection is spared.
    admin = psycopg.connect(**{**connection.get_connection_params(), "dbname": "postgres"}, autocommit=True)
    pattern = worker_log("*")  # every worker of this run: another test's may be consuming the queue too

    def logs() -> str:
        return "".join(path.read_text(errors="replace") for path in pattern.parent.glob(pattern.name))

    try:
        admin.execute(f"ALTER DATABASE {database} ALLOW_CONNECTIONS false")
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> %s", [name, mine]
        )
        task = aggregate_round.delay(round_.pk)
        deadline = time.monotonic() + 60
        while f"{task.id}] retry: Retry in" not in logs():
            assert time.monotonic() < deadline, fleet_state()
            time.sleep(0.2)
        assert Round.objects.get(pk=round_.pk).state == Round.State.AGGREGATING
    finally:
        admin.execute(f"ALTER DATABASE {database} ALLOW_CONNECTIONS true")
        admin.close()
    done = wait_for(lambda: Round.objects.filter(pk=round_.pk, state=Round.State.COMPLETED).first(), timeout=90)
    assert AdapterVersion.objects.filter(round=done).count() == 1
    assert done.stats["deltas"] == 3 == Delta.objects.filter(round=done, state=Delta.State.AGGREGATED).count()
    retried = [line for line in logs().splitlines() if f"{task.id}] retry: Retry in" in line]
    assert retried and all("OperationalError" in line for line in retried), retried


def test_a_round_whose_strategy_this_code_does_not_know_fails_with_the_reason_and_is_not_queued_again(
    trained, monkeypatch, settings, make_user
):
    from datetime import timedelta

    adapter, _, devices = trained
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation={"buffer_size": 30, "min_deltas": 1})
    adapter.refresh_from_db()
    monkeypatch.setattr("training.federation.verify_queue.queue_verification", lambda delta_id: None)
    for i in range(2):
        delta = receive(devices[i], adapter, make_delta_tensors(adapter, seed=90 + i), counter=1)
        delta_verify(delta_id=delta.pk)
    monkeypatch.setattr(dispatch, "aggregate_round", lambda round_id: None)
    round_ = round_close(round_=Round.objects.get(), actor=make_user("operator"))
    # The round was closed under a strategy that an upgrade has since removed.
    Round.objects.filter(pk=round_.pk).update(
        strategy="vanished", closed_at=timezone.now() - timedelta(seconds=settings.ROUND_AGGREGATION_RESCUE_SECONDS + 5)
    )
    assert round_.pk in stalled_rounds()
    assert aggregate_round(round_.pk) is None  # the task body, as a worker runs it
    failed = Round.objects.get(pk=round_.pk)
    assert failed.state == Round.State.FAILED and "unknown aggregation strategy 'vanished'" in failed.failure
    assert failed.attempts == 1
    assert round_.pk not in stalled_rounds()  # never queued again
    assert AdapterVersion.objects.filter(round=failed).count() == 0
