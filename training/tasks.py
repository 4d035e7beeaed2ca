"""Celery tasks: thin. They take ids, load rows, call one service, and tolerate a row that is gone or
already handled (every service guards its own state), so a redelivered task (``acks_late``) changes
nothing twice."""

from celery import chord, shared_task

from training.dispatch import TRANSIENT_ERRORS
from training.federation.aggregation import (
    _round,
    aggregation_lock,
    combine_grams,
    combine_partials,
    combine_span_values,
    round_aggregate,
    round_deltas,
    round_plan,
    shard_partial,
    span_gram,
    span_values,
    spans_failed,
    spans_of,
)
from training.federation.rounds import close_due_rounds as close_due
from training.federation.rounds import stalled_rounds
from training.federation.staging import staged_expire
from training.federation.strategies import get_strategy
from training.federation.verification import delta_verify
from training.federation.verify_queue import shard_drain
from training.models import AdapterVersion, Rollout
from training.registry.blobs import blob_parts_sweep
from training.rollouts.automatic import round_result_release
from training.rollouts.lifecycle import rollout_tick
from training.selectors import deltas_awaiting_rescue

# PostgreSQL or Redis away for a moment (a restart, "too many clients"): verification and aggregation tasks are
# tried again after 2, 4, 8 ... (at most 60) seconds, eight times. Each is safe to run again: a delta is verified
# once (its state), a round aggregated at most once (state guards, ``UNIQUE(round)`` on the version), a shard's or
# span's part is a blob named by its hash. Where every try fails, beat's rescues queue the work again later
# (``requeue_unverified_deltas``, ``requeue_stalled_rounds``).
RETRY_TRANSIENT = {
    "autoretry_for": TRANSIENT_ERRORS,
    "retry_backoff": 2,
    "retry_backoff_max": 60,
    "retry_jitter": True,
    "max_retries": 8,
}


@shared_task(name="training.tasks.tick_rollouts", ignore_result=True, time_limit=120, soft_time_limit=100)
def tick_rollouts() -> dict:
    """Advance every running rollout one step (guards, soak, next phase). Safe to run twice at once."""
    outcomes: dict[str, int] = {}
    for rollout in Rollout.objects.filter(state=Rollout.State.RUNNING).select_related("version__adapter"):
        outcome = rollout_tick(rollout=rollout)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


@shared_task(
    name="training.tasks.verify_delta", ignore_result=True, time_limit=300, soft_time_limit=280, **RETRY_TRANSIENT
)
def verify_delta(delta_id: int) -> str | None:
    delta = delta_verify(delta_id=delta_id)
    return delta.state if delta is not None else None


@shared_task(
    name="training.tasks.verify_shard", ignore_result=True, time_limit=300, soft_time_limit=280, **RETRY_TRANSIENT
)
def verify_shard(shard: int) -> int:
    """Verify one shard's received deltas in batches (``training.federation.verify_queue``); how many were verified."""
    return shard_drain(shard)


@shared_task(name="training.tasks.requeue_unverified_deltas", ignore_result=True, time_limit=60, soft_time_limit=50)
def requeue_unverified_deltas() -> int:
    """Queue verification again for deltas left `received` (their task was lost); verifying twice is a no-op."""
    ids = deltas_awaiting_rescue()
    for delta_id in ids:
        verify_delta.delay(delta_id)
    return len(ids)


@shared_task(name="training.tasks.expire_staged_uploads", ignore_result=True, time_limit=600, soft_time_limit=550)
def expire_staged_uploads() -> int:
    """Discard unfinished uploads no chunk reached for DELTA_STAGED_EXPIRY_SECONDS (and finished ones' leftovers),
    and blob stores a dead process left unfinished (``blob_parts_sweep``)."""
    blob_parts_sweep()
    return staged_expire()


@shared_task(
    name="training.tasks.aggregate_round",
    ignore_result=True,
    time_limit=3600,
    soft_time_limit=3500,
    **RETRY_TRANSIENT,
)
def aggregate_round(round_id: int) -> int | None:
    """Aggregate a closed round: here, or split into a chord of shards when it is large. A second task for a
    round another worker is aggregating right now does nothing."""
    with aggregation_lock(round_id) as mine:
        round_ = _round(round_id) if mine else None
        if round_ is None:
            return None
        plan = round_plan(round_, round_deltas(round_))
        if plan is None:  # failed, with the reason on the round
            return None
        if plan.shards is not None:
            chord(aggregate_shard.s(round_id, ids) for ids in plan.shards)(combine_shards.s(round_id))
            return None
        if plan.spans is not None:  # each task reads its coordinate span of every delta
            if plan.gram:
                chord(aggregate_span.s(round_id, span, "gram") for span in plan.spans)(
                    combine_spans.s(round_id, "gram")
                )
            else:
                chord(aggregate_span.s(round_id, span) for span in plan.spans)(combine_spans.s(round_id))
            return None
        version = round_aggregate(round_id=round_id)
        return version.pk if version is not None else None


@shared_task(name="training.tasks.requeue_stalled_rounds", ignore_result=True, time_limit=60, soft_time_limit=50)
def requeue_stalled_rounds() -> int:
    """Queue aggregation again for rounds left `aggregating` that no worker is aggregating (their task was
    lost); a round is aggregated at most once (state guards, ``UNIQUE(round)`` on the version)."""
    ids = stalled_rounds()
    for round_id in ids:
        aggregate_round.delay(round_id)
    return len(ids)


@shared_task(name="training.tasks.aggregate_shard", time_limit=3600, soft_time_limit=3500, **RETRY_TRANSIENT)
def aggregate_shard(round_id: int, delta_ids: list[int]) -> dict:
    return shard_partial(round_id=round_id, delta_ids=delta_ids)


@shared_task(
    name="training.tasks.combine_shards",
    ignore_result=True,
    time_limit=3600,
    soft_time_limit=3500,
    **RETRY_TRANSIENT,
)
def combine_shards(partials: list[dict], round_id: int) -> int | None:
    version = combine_partials(round_id=round_id, partials=partials)
    return version.pk if version is not None else None


@shared_task(name="training.tasks.aggregate_span", time_limit=3600, soft_time_limit=3500, **RETRY_TRANSIENT)
def aggregate_span(round_id: int, span: list[int], stage: str = "values", gram_sha256: str | None = None) -> dict:
    """One coordinate span of a robust round: its Gram matrix (``stage`` "gram") or its values."""
    if stage == "gram":
        part = span_gram(round_id=round_id, span=span)
    else:
        part = span_values(round_id=round_id, span=span, gram_sha256=gram_sha256)
    return {**part, "worker": aggregate_span.request.hostname}


@shared_task(
    name="training.tasks.combine_spans",
    ignore_result=True,
    time_limit=3600,
    soft_time_limit=3500,
    **RETRY_TRANSIENT,
)
def combine_spans(parts: list[dict], round_id: int, stage: str = "values", gram_sha256: str | None = None):
    """The spans' parts in span order: Gram matrices (then Krum chooses, or a mixing rule's value spans run
    as a second chord) or a coordinate rule's values (then the version is stored)."""
    if spans_failed(parts):
        return None  # the round failed in the task that could not read a delta
    if stage == "gram":
        gram_sha256 = combine_grams(parts=parts)
        round_ = _round(round_id)
        if round_ is None:
            return None
        if hasattr(get_strategy(round_.strategy), "assemble"):  # a coordinate rule that mixes: now its values
            spans = [[a, b] for a, b in spans_of(round_, round_deltas(round_)) or []]
            chord(aggregate_span.s(round_id, span, "values", gram_sha256) for span in spans)(combine_spans.s(round_id))
            return None
    version = combine_span_values(round_id=round_id, parts=parts, gram_sha256=gram_sha256)
    return version.pk if version is not None else None


@shared_task(name="training.tasks.close_due_rounds", ignore_result=True, time_limit=120, soft_time_limit=100)
def close_due_rounds() -> int:
    return close_due()


@shared_task(name="training.tasks.release_round_result", ignore_result=True, time_limit=120, soft_time_limit=100)
def release_round_result(version_id: int) -> int:
    version = AdapterVersion.objects.filter(pk=version_id).first()
    return len(round_result_release(version=version)) if version is not None else 0
