"""Rounds: collecting accepted deltas and closing them for aggregation (README.md, "Deltas, verification and rounds").

Every change to a round happens under a row lock on it, so deltas racing a close land either in the
closing round (before the close) or in the next one (after it): none lost, none counted twice. Closing
hands the round to a Celery task (``training.federation.aggregation``) through ``transaction.on_commit``.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.core.cache import cache
from django.db import IntegrityError, transaction
from django.utils import timezone

from core.errors import Conflict, DomainError
from core.queries import only_row
from devices.models import Device, DeviceStatus
from training import dispatch
from training.federation.aggregation_settings import (
    OPTIMIZER_PARAMS,
    STRATEGY_PARAMS,
    aggregation_settings,
    dp_settings,
)
from training.models import Adapter, AdapterVersion, Delta, Round
from training.registry.services import _record


def round_base(adapter: Adapter) -> AdapterVersion | None:
    """What a round builds on: the newest released version, which is what devices run and train on; the newest
    live candidate only while nothing is released. Never a chain of candidates: a round's version that the
    release gate held back is not the next round's base, so its flaws do not compound and deltas from devices
    stay fresh against it (``training.federation.verification`` counts staleness in released versions)."""
    live = adapter.versions.exclude(state=AdapterVersion.State.REVOKED).order_by("-number")
    released = live.filter(state=AdapterVersion.State.RELEASED)
    # a released version whose devices then judged it worse (an automatic rollout's guard) is not built on
    return released.exclude(gate__verdict="failed").first() or released.first() or live.first()


def dp_sample_rate(adapter: Adapter, buffer_size: int) -> float:
    rate = dp_settings(adapter)["sample_rate"]
    if rate is not None:
        return float(rate)
    fleet = Device.objects.filter(cohort__in=adapter.cohorts.all(), status=DeviceStatus.ACTIVE).count()
    return min(1.0, buffer_size / max(fleet, 1))


def dp_epsilon_after_round(adapter: Adapter, buffer_size: int) -> float:
    from training.federation.strategies.dp import epsilon_if_round_runs

    dp = dp_settings(adapter)
    history = [tuple(step) for step in adapter.dp_history]
    return epsilon_if_round_runs(history, dp["noise_multiplier"], dp_sample_rate(adapter, buffer_size), dp["delta"])


class DpBudgetExhausted(Conflict):
    """Another round would spend more privacy than the adapter's epsilon budget allows."""


class RoundAlreadyOpen(Conflict):
    """The adapter has a collecting round already (one at a time)."""


def _check_dp_budget(adapter: Adapter, buffer_size: int) -> None:
    dp = dp_settings(adapter)
    if not dp["enabled"]:
        return
    after = dp_epsilon_after_round(adapter, buffer_size)
    if after > dp["epsilon_budget"]:
        raise DpBudgetExhausted(
            "dp_budget_exhausted",
            f"another round would bring {adapter.name}'s epsilon from {adapter.dp_epsilon:.3g} to {after:.3g}, "
            f"past its budget of {dp['epsilon_budget']:.3g}; no round starts",
            details={"epsilon": adapter.dp_epsilon, "epsilon_after": after, "budget": dp["epsilon_budget"]},
        )


def _params(adapter: Adapter) -> dict:
    settings_ = aggregation_settings(adapter)
    params = {name: settings_[name] for name in STRATEGY_PARAMS if settings_[name] is not None}
    if not params.get("server_optimizer"):
        for name in OPTIMIZER_PARAMS:
            params.pop(name, None)
        if params.get("server_lr") == 1.0:
            del params["server_lr"]  # the whole update: what a round without it applies
    # The workers its deltas are split across if it grows past shard_size, fixed now: a chord and one worker
    # aggregating the round again cut the same shards, whichever process's settings they run with.
    params["workers"] = settings.AGGREGATION_WORKERS
    dp = dp_settings(adapter)
    if dp["enabled"]:
        params["dp"] = {"clip": dp["clip"], "noise_multiplier": dp["noise_multiplier"]}
    return params


def round_open(
    *,
    adapter: Adapter,
    actor=None,
    buffer_size: int | None = None,
    min_deltas: int | None = None,
    timeout_seconds: int | None = None,
) -> Round:
    """Open the adapter's collecting round on its newest released version (``round_base``), adopting accepted
    deltas that wait for one.

    Refused when a round is already collecting, the adapter has no version, or server-side DP would pass
    the adapter's epsilon budget (that refusal is recorded as an event, so it is visible)."""
    try:
        with transaction.atomic():
            return _round_create(
                adapter=adapter,
                actor=actor,
                buffer_size=buffer_size,
                min_deltas=min_deltas,
                timeout_seconds=timeout_seconds,
            )
    except DpBudgetExhausted as refusal:
        _record("round.refused", actor=actor, adapter=adapter, code=refusal.code, message=refusal.message)
        raise


def _round_create(*, adapter, actor, buffer_size, min_deltas, timeout_seconds) -> Round:
    Adapter.objects.select_for_update(no_key=True).filter(pk=adapter.pk).first()
    adapter.refresh_from_db()
    settings_ = aggregation_settings(adapter)
    if adapter.rounds.filter(state=Round.State.COLLECTING).exists():
        raise RoundAlreadyOpen("round_already_open", f"{adapter.name} already has a collecting round")
    base = round_base(adapter)
    if base is None:
        raise Conflict("no_version", f"{adapter.name} has no version to build on; seed or import one")
    buffer_size = buffer_size or settings_["buffer_size"]
    min_deltas = min(min_deltas or settings_["min_deltas"], buffer_size)
    _check_dp_budget(adapter, buffer_size)
    round_ = Round.objects.create(
        adapter=adapter,
        base_version=base,
        strategy=settings_["strategy"],
        params=_params(adapter),
        buffer_size=buffer_size,
        min_deltas=min_deltas,
        deadline=timezone.now() + timedelta(seconds=timeout_seconds or settings_["round_timeout_seconds"]),
        opened_by=actor,
    )
    _record("round.opened", actor=actor, adapter=adapter, round=round_.pk, base_version=base.number)
    waiting = Delta.objects.filter(adapter=adapter, state=Delta.State.ACCEPTED, round__isnull=True)
    waiting.filter(pk__in=list(waiting.order_by("id").values_list("pk", flat=True)[:buffer_size])).update(round=round_)
    _close_if_due(round_)
    return round_


def _collecting(adapter_id: int) -> Round | None:
    return only_row(
        Round.objects.select_for_update(no_key=True).filter(adapter_id=adapter_id, state=Round.State.COLLECTING)
    )


def round_admit(*, delta: Delta) -> Round | None:
    """Put a just-accepted delta into its adapter's collecting round (opening one if the adapter wants
    rounds opened automatically), and close the round when it is full. Runs inside the caller's transaction."""
    round_ = _collecting(delta.adapter_id)
    if round_ is None:
        if not aggregation_settings(delta.adapter)["auto_rounds"]:
            return None
        round_, adopted = _open_for(delta)
        if round_ is None or adopted:
            return round_
    round_.adapter = delta.adapter  # the same row, already loaded: the round's live event names it
    Delta.objects.filter(pk=delta.pk).update(round=round_)
    _close_if_due(round_)
    return round_


def round_admit_many(deltas: list[Delta]) -> None:
    """``round_admit`` for a batch of just-accepted deltas of one adapter (the batch of
    ``training.federation.verification``), setting each one's round: while the collecting round has room, one
    lock, one update, one count and one progress event for all of them. The deltas that do not fit once it is
    full go to the next round, which
    the first of them opens as ``round_admit`` does (opening adopts the others waiting). Runs inside the
    caller's transaction."""
    pending = list(deltas)
    while pending:
        round_ = _collecting(pending[0].adapter_id)
        if round_ is None:
            first = pending.pop(0)
            first.round = round_admit(delta=first)
            if first.round is None:  # no round to join (not opened automatically, or refused): each tries
                for delta in pending:  # as it would alone (a refusal is recorded for each, as before)
                    delta.round = round_admit(delta=delta)
                return
            adopted = dict(
                Delta.objects.filter(pk__in=[d.pk for d in pending], round__isnull=False).values_list("pk", "round_id")
            )
            for delta in pending:
                delta.round_id = adopted.get(delta.pk)
            pending = [delta for delta in pending if delta.round_id is None]
            continue
        round_.adapter = pending[0].adapter  # the same row, already loaded: the round's live event names it
        count = _accepted_count(round_)
        room = max(round_.buffer_size - count, 0)
        joining, pending = pending[:room], pending[room:]
        if joining:
            Delta.objects.filter(pk__in=[d.pk for d in joining]).update(round=round_)
            for delta in joining:
                delta.round = round_
        if not _close_if_due(round_, count + len(joining)) and pending:
            # Full but not closed cannot happen under the round's lock; one by one rather than loop on it.
            for delta in pending:
                delta.round = round_admit(delta=delta)
            return


_OPEN_ATTEMPTS = 5


def _open_for(delta: Delta) -> tuple[Round | None, bool]:
    """Open a round for a delta that found none and lock it; returns it, and whether opening adopted the
    delta (then the round may be closed already: it was full). Another worker may open a round first, and it
    may be closed (full, or by an operator) before this transaction sees it: then open again, a few times,
    so the delta is not left waiting with no round to wait for. A refusal that is not a race (DP budget, no
    version) leaves the delta waiting for the next round that opens: it adopts waiting deltas."""
    for _ in range(_OPEN_ATTEMPTS):
        try:
            round_open(adapter=delta.adapter)
        except IntegrityError:
            pass  # another worker's round went in first
        except RoundAlreadyOpen:
            pass  # another worker's round, committed: look for it below
        except DomainError:  # DP budget, no version: the delta waits for the next round that opens
            return None, False
        adopted_by = Delta.objects.filter(pk=delta.pk).values_list("round_id", flat=True).first()
        if adopted_by is not None:
            return Round.objects.get(pk=adopted_by), True
        round_ = _collecting(delta.adapter_id)
        if round_ is not None:
            return round_, False
    return None, False


def _accepted_count(round_: Round) -> int:
    return round_.deltas.filter(state=Delta.State.ACCEPTED).count()


def _close_if_due(round_: Round, count: int | None = None) -> bool:
    """Close the locked round if it is full, or past its deadline with its minimum; else publish its progress.
    ``count``: its accepted deltas, when the caller has just counted them."""
    count = _accepted_count(round_) if count is None else count
    if count >= round_.buffer_size:
        return _close(round_, "buffer_full", count)
    if round_.deadline and round_.deadline <= timezone.now() and count >= round_.min_deltas:
        return _close(round_, "deadline", count)
    _progress(round_, count)
    return False


def _progress(round_: Round, count: int) -> None:
    from training.federation.events import round_event

    transaction.on_commit(lambda: round_event(round_, deltas=count))


def _close(round_: Round, reason: str, count: int, actor=None) -> bool:
    changed = Round.objects.filter(pk=round_.pk, state=Round.State.COLLECTING).update(
        state=Round.State.AGGREGATING, close_reason=reason, closed_at=timezone.now()
    )
    if not changed:
        return False
    round_.refresh_from_db()
    _record("round.closed", actor=actor, adapter=round_.adapter, round=round_.pk, reason=reason, deltas=count)
    transaction.on_commit(lambda: dispatch.aggregate_round(round_.pk))
    _progress(round_, count)
    return True


@transaction.atomic
def round_close(*, round_: Round, actor) -> Round:
    """An operator closes a collecting round now (it needs at least one accepted delta)."""
    locked = Round.objects.select_for_update(no_key=True).get(pk=round_.pk)
    if locked.state != Round.State.COLLECTING:
        raise Conflict("invalid_transition", f"the round is {locked.state}, not collecting")
    count = _accepted_count(locked)
    if count == 0:
        raise Conflict("round_empty", "the round has no accepted deltas yet")
    _close(locked, "manual", count, actor=actor)
    locked.refresh_from_db()
    return locked


@transaction.atomic
def round_rerun(*, round_: Round, actor) -> Round:
    """Run a failed round's aggregation again, on the same deltas. Its times (``Round.aggregation_seconds``,
    ``release_seconds``) count from now on: not the time it sat failed."""
    locked = Round.objects.select_for_update(no_key=True).get(pk=round_.pk)
    if locked.state != Round.State.FAILED:
        raise Conflict("invalid_transition", f"only a failed round runs again; this one is {locked.state}")
    Round.objects.filter(pk=locked.pk).update(state=Round.State.AGGREGATING, failure="", reran_at=timezone.now())
    _record("round.rerun", actor=actor, adapter=locked.adapter, round=locked.pk)
    transaction.on_commit(lambda: dispatch.aggregate_round(locked.pk))
    locked.refresh_from_db()
    return locked


def close_due_rounds() -> int:
    """Close every collecting round past its deadline that has its minimum (beat calls this)."""
    closed = 0
    due = Round.objects.filter(state=Round.State.COLLECTING, deadline__lte=timezone.now()).values_list("pk", flat=True)
    for pk in list(due):
        with transaction.atomic():
            round_ = only_row(Round.objects.select_for_update(no_key=True).filter(pk=pk, state=Round.State.COLLECTING))
            if round_ is not None and _close_if_due(round_):
                closed += 1
    return closed


def stalled_rounds() -> list[int]:
    """Rounds `aggregating` since longer than ROUND_AGGREGATION_RESCUE_SECONDS that no worker is aggregating
    now: their task was lost (a worker killed while it held the task, which the broker hands out again only
    after its visibility timeout, or the broker away when the round closed). Each is picked at most once per
    that period, so a large round whose chord of shards is still running is not queued again every minute."""
    from training.federation.aggregation import aggregation_running

    period = settings.ROUND_AGGREGATION_RESCUE_SECONDS
    older_than = timezone.now() - timedelta(seconds=period)
    due = Round.objects.filter(state=Round.State.AGGREGATING, closed_at__lt=older_than).order_by("closed_at")
    return [
        pk
        for pk in due.values_list("pk", flat=True)[:500]
        if not aggregation_running(pk) and cache.add(f"rounds:rescued:{pk}", 1, timeout=period)
    ]
