"""Turning a closed round into exactly one new AdapterVersion (run by Celery workers).

``round_aggregate`` is idempotent: it acts only on a round that is ``aggregating`` and has no version yet,
and the version row is unique per round, so a task run again after a worker was killed (``acks_late``)
either finishes the job or finds it done. Rounds of more than ``shard_size`` deltas are split across the
aggregation workers (``AGGREGATION_WORKERS``) as a Celery chord: by coordinate spans (robust rules; the mean
family without DP: each task reads its span of every delta, and the spans' values are joined in order) or, for
the mean family with DP, by shards of deltas (``strategies.shards``) whose partial sums are combined in shard
order. One worker computes the very same spans or shards in the same order, so the result is identical.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from django.conf import settings
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.utils import timezone
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from training import dispatch
from training.federation.aggregation_settings import aggregation_settings, dp_settings
from training.federation.release_gate import FAILED, gate_record
from training.federation.strategies import DeltaInput, get_strategy, shards
from training.federation.strategies.server_optimizers import BETA2, LR_DEFAULTS, MOMENTUM, TAU, server_step
from training.models import Adapter, AdapterVersion, Delta, Round
from training.registry.blobs import blob_local_path, blob_put_bytes, blob_put_tensors, blob_read
from training.registry.services import _next_number, _record

logger = logging.getLogger(__name__)


# PostgreSQL advisory locks (namespace, round id) held by the process aggregating a round, for as long as it does:
# a second task for the same round (queued again by ``requeue_stalled_rounds``) does not run beside it, and the
# rescue sees that the round is being worked on. A worker that dies loses its connection, and the lock with it.
_LOCK_NAMESPACE = 0x524E44  # "RND"


@contextlib.contextmanager
def aggregation_lock(round_id: int):
    """Yields True while this process holds the round's aggregation lock, False when another process holds it."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", [_LOCK_NAMESPACE, round_id])
        held = bool(cursor.fetchone()[0])
    try:
        yield held
    finally:
        if held:
            with contextlib.suppress(DatabaseError), connection.cursor() as cursor:  # gone with its connection
                cursor.execute("SELECT pg_advisory_unlock(%s, %s)", [_LOCK_NAMESPACE, round_id])


def aggregation_running(round_id: int) -> bool:
    """Whether some process holds the round's aggregation lock now."""
    with aggregation_lock(round_id) as free:
        return not free


def _round(round_id: int) -> Round | None:
    return (
        Round.objects.select_related("adapter__base_model", "base_version")
        .filter(pk=round_id, state=Round.State.AGGREGATING)
        .first()
    )


def round_deltas(round_: Round) -> list[Delta]:
    return list(round_.deltas.filter(state=Delta.State.ACCEPTED).select_related("base_version").order_by("id"))


def _params(round_: Round) -> dict:
    params = {"memory_budget": settings.AGGREGATION_MEMORY_BUDGET_MB << 20, **round_.params}
    if "dp" in params:  # fresh noise every run: a stored or derivable seed would let anyone subtract it
        params["dp"] = {**params["dp"], "seed": secrets.randbits(62)}
    return params


def staleness_in_round(round_: Round, deltas: list[Delta]) -> list[int]:
    """Each delta's staleness against the round's base: the released versions after the delta's base up to the
    round's (``training.federation.verification`` counts the same way). Candidates between them never reached a
    device, so they make no delta older; a delta on a version newer than the round's base is not stale."""
    released = list(
        AdapterVersion.objects.filter(
            adapter_id=round_.adapter_id, state=AdapterVersion.State.RELEASED, number__lte=round_.base_version.number
        ).values_list("number", flat=True)
    )
    return [sum(1 for number in released if number > delta.base_version.number) for delta in deltas]


def _inputs(stack: ExitStack, round_: Round, deltas: list[Delta]) -> list[DeltaInput]:
    return [
        DeltaInput(
            path=stack.enter_context(blob_local_path(delta.blob_sha256)),
            num_samples=delta.num_samples,
            staleness=staleness,
            norm=delta.norm,
        )
        for delta, staleness in zip(deltas, staleness_in_round(round_, deltas), strict=True)
    ]


def _base_tensors(round_: Round) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in load_safetensors(blob_read(round_.base_version.blob_sha256)).items()}


def shards_of(round_: Round, deltas: list[Delta]) -> list[list[int]] | None:
    """Delta ids per shard when the round is worth splitting across workers, else None."""
    strategy = get_strategy(round_.strategy)
    if not strategy.shardable or strategy.by_coordinates(round_.params):
        return None
    params = strategy.check_params(round_.params)  # the round's own workers, fixed when it opened (2 before)
    cut = shards([delta.pk for delta in deltas], params["shard_size"], params["workers"])
    return cut if len(cut) > 1 else None


def spans_of(round_: Round, deltas: list[Delta]) -> list[tuple[int, int]] | None:
    """Coordinate spans when the round's rule (a robust rule; the mean family without DP) is worth splitting
    across workers (more deltas than ``shard_size``), else None. Each task then reads its span of every delta."""
    strategy = get_strategy(round_.strategy)
    if not strategy.by_coordinates(round_.params) or len(deltas) <= int(round_.params.get("shard_size", 64)):
        return None
    spans = strategy.spans(None, spec=round_.adapter.tensor_spec, params=_params(round_))
    return spans if len(spans) > 1 else None


@dataclass(frozen=True)
class Plan:
    """How a closed round is aggregated: in shards of deltas (the mean family with DP), in coordinate spans
    (robust rules, ``gram`` for the distance-based ones; the mean family without DP), or on one worker."""

    shards: list[list[int]] | None = None
    spans: list[tuple[int, int]] | None = None
    gram: bool = False


def round_plan(round_: Round, deltas: list[Delta]) -> Plan | None:
    """The round's plan; None when it cannot be aggregated at all (a strategy this code does not know, e.g. one
    removed since the round closed, or parameters it refuses): the round is failed with the reason, where an
    error here would leave it ``aggregating`` and have it queued again every minute, forever."""
    try:
        shards = shards_of(round_, deltas)
        if shards is not None:
            return Plan(shards=shards)
        spans = spans_of(round_, deltas)
        if spans is not None:
            return Plan(spans=spans, gram=get_strategy(round_.strategy).needs_gram(round_.params))
    except (ValueError, LookupError) as exc:
        Round.objects.filter(pk=round_.pk).update(attempts=round_.attempts + 1)
        return _fail(round_, f"{type(exc).__name__}: {exc}")
    return Plan()


def _span_run(round_id: int, work) -> dict:
    """Run one span task's ``work(strategy, inputs, spec, params)`` on the round's deltas; a delta that cannot
    be read fails the round (every task of the chord would fail on it again)."""
    round_ = Round.objects.select_related("adapter", "base_version").get(pk=round_id)
    deltas = round_deltas(round_)
    try:
        with ExitStack() as stack:
            tensor = work(get_strategy(round_.strategy), _inputs(stack, round_, deltas), round_.adapter.tensor_spec)
    except (ValueError, LookupError, OSError) as exc:
        _fail(round_, f"{type(exc).__name__}: {exc}")
        return {"failed": True}
    return {"sha256": blob_put_tensors({"part": tensor}).sha256}


def span_gram(*, round_id: int, span: list[int]) -> dict:
    """One span's Gram matrix of the round's deltas, stored as a blob (float64): ``{"sha256"}``."""
    round_ = Round.objects.get(pk=round_id)
    params = _params(round_)
    return _span_run(
        round_id, lambda strategy, inputs, spec: strategy.gram_partial(inputs, spec=spec, params=params, span=span)
    )


def span_values(*, round_id: int, span: list[int], gram_sha256: str | None = None) -> dict:
    """One span of a coordinate rule's result (float32), stored as a blob: ``{"sha256"}``. ``gram_sha256``:
    the whole Gram matrix (combined from ``span_gram`` parts), when the rule mixes."""
    round_ = Round.objects.get(pk=round_id)
    params = _params(round_)
    gram = _part(gram_sha256) if gram_sha256 else None
    return _span_run(
        round_id,
        lambda strategy, inputs, spec: strategy.span_partial(inputs, spec=spec, params=params, span=span, gram=gram),
    )


def _part(sha256: str) -> torch.Tensor:
    """A span task's stored part: a tensor over the blob's file mapped (as ``partial_sums``), no copy; the keys
    ``assemble`` makes of it are views of that mapping."""
    with blob_local_path(sha256) as path, safe_open(path, framework="pt") as handle:
        return handle.get_tensor("part")


def spans_failed(parts: list[dict]) -> bool:
    return any(part.get("failed") for part in parts)


def combine_grams(*, parts: list[dict]) -> str:
    """The whole Gram matrix from the spans' parts (added in span order), stored as a blob: its sha256."""
    gram = get_strategy("krum").combine_grams(_part(part["sha256"]) for part in parts)
    return blob_put_tensors({"part": gram}).sha256


def combine_span_values(*, round_id: int, parts: list[dict], gram_sha256: str | None = None):
    """The round's result from its spans: the coordinate rules' values in span order, or Krum's choice from
    the whole Gram matrix (``gram_sha256``). Stored and released as ``round_aggregate`` does."""
    round_ = _round(round_id)
    if round_ is None:
        return None
    strategy = get_strategy(round_.strategy)
    deltas = round_deltas(round_)
    base = _base_tensors(round_)
    started = time.monotonic()
    try:
        with ExitStack() as stack:
            inputs = _inputs(stack, round_, deltas)
            spec = round_.adapter.tensor_spec
            if gram_sha256 is not None and not hasattr(strategy, "assemble"):
                delta = strategy.from_gram(inputs, spec=spec, params=_params(round_), gram=_part(gram_sha256))
            else:
                delta = strategy.assemble((_part(part["sha256"]) for part in parts), spec=spec, inputs=inputs)
    except (ValueError, LookupError, OSError) as exc:
        return _fail(round_, f"{type(exc).__name__}: {exc}")
    workers = len({part.get("worker") for part in parts if part.get("worker")}) or None
    return _finish(round_, base, delta, deltas, started, shards=len(parts), workers=workers)


def shard_partial(*, round_id: int, delta_ids: list[int]) -> dict:
    """One shard's partial sum, stored as a blob (float64): ``{"sha256", "weight"}``. DP noise, when on, is
    added once, to the combined sum."""
    round_ = Round.objects.select_related("adapter", "base_version").get(pk=round_id)
    deltas = list(Delta.objects.filter(pk__in=delta_ids).select_related("base_version").order_by("id"))
    strategy = get_strategy(round_.strategy)
    params = dict(round_.params)
    with ExitStack() as stack:
        sums, weight = strategy.partial(
            _inputs(stack, round_, deltas), spec=round_.adapter.tensor_spec, base=_base_tensors(round_), params=params
        )
    return {"sha256": blob_put_tensors(sums).sha256, "weight": weight}


def partial_sums(sha256: str) -> dict[str, torch.Tensor]:
    """A shard's stored float64 sums, mapped from the blob's file rather than read into one bytes object and
    copied again into tensors (two copies of 80 MB per shard of a 10M adapter; bench/README.md, "aggregation.py")."""
    with blob_local_path(sha256) as path, safe_open(path, framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (a handle, not a dict)


def combine_partials(*, round_id: int, partials: list[dict], seed: int | None = None) -> AdapterVersion | None:
    round_ = _round(round_id)
    if round_ is None:
        return None
    strategy = get_strategy(round_.strategy)
    params = dict(round_.params)
    if "dp" in params:
        params["dp"] = {**params["dp"], "seed": seed if seed is not None else secrets.randbits(62)}
    base = _base_tensors(round_)
    started = time.monotonic()
    # One partial at a time (combine takes any iterable, in order): memory is the sum and one float64 partial,
    # where a list held every shard's at once (16 shards of a 10M adapter: 1.3 GB).
    loaded = ((partial_sums(p["sha256"]), float(p["weight"])) for p in partials)
    delta = strategy.combine(loaded, spec=round_.adapter.tensor_spec, base=base, params=params)
    return _finish(round_, base, delta, round_deltas(round_), started, shards=len(partials))


def round_aggregate(*, round_id: int) -> AdapterVersion | None:
    """Aggregate a closed round on this worker (all shards in order). None when there is nothing to do."""
    round_ = _round(round_id)
    if round_ is None:
        return None
    existing = AdapterVersion.objects.filter(round=round_).first()
    if existing is not None:  # a previous run made the version but died before marking the round
        Round.objects.filter(pk=round_.pk, state=Round.State.AGGREGATING).update(
            state=Round.State.COMPLETED, completed_at=timezone.now()
        )
        return existing
    Round.objects.filter(pk=round_.pk).update(attempts=round_.attempts + 1)
    deltas = round_deltas(round_)
    if not deltas:
        return _fail(round_, "the round holds no accepted deltas")
    started = time.monotonic()
    try:
        strategy = get_strategy(round_.strategy)
        base = _base_tensors(round_)
        with ExitStack() as stack:
            delta = strategy.aggregate(
                _inputs(stack, round_, deltas), spec=round_.adapter.tensor_spec, base=base, params=_params(round_)
            )
    except (ValueError, LookupError, OSError) as exc:
        return _fail(round_, f"{type(exc).__name__}: {exc}")
    return _finish(round_, base, delta, deltas, started)


def _fail(round_: Round, reason: str) -> None:
    from training.federation.events import round_event

    changed = Round.objects.filter(pk=round_.pk, state=Round.State.AGGREGATING).update(
        state=Round.State.FAILED, failure=reason[:2000]
    )
    if changed:
        round_.refresh_from_db()
        _record("round.failed", actor=None, adapter=round_.adapter, round=round_.pk, reason=reason[:300])
        round_event(round_, kind="round.failed", failure=reason[:300])
    logger.warning("round %s failed: %s", round_.pk, reason)
    return None


def _finish(round_: Round, base: dict, delta: dict, deltas: list[Delta], started: float, shards: int = 1, workers=None):
    from training.federation.events import round_event
    from training.registry.evaluation import evaluate_tensors

    delta, server_state = _server_update(round_, delta)
    new = {name: (base[name] + delta[name].float()).contiguous() for name in sorted(base)}
    bad = [name for name, tensor in new.items() if not bool(torch.isfinite(tensor).all())]
    if bad:
        return _fail(round_, f"the aggregate holds NaN or infinite values in {bad[:3]}")
    blob = blob_put_bytes(save_safetensors(new))
    metrics = evaluate_tensors(round_.adapter, new)
    seconds = time.monotonic() - started
    stats = {
        "deltas": len(deltas),
        "samples": sum(d.num_samples for d in deltas),
        "devices": len({d.device_id for d in deltas}),
        "max_staleness": max((d.staleness or 0) for d in deltas),
        "update_norm": float(torch.sqrt(sum(t.double().square().sum() for t in delta.values()))),
        "seconds": round(seconds, 3),
        "shards": shards,
    }
    if workers is not None:  # a chord's: how many workers its tasks ran on
        stats["workers"] = workers
    with transaction.atomic():
        locked = (
            Round.objects.select_for_update(no_key=True).filter(pk=round_.pk, state=Round.State.AGGREGATING).first()
        )
        if locked is None:
            return AdapterVersion.objects.filter(round=round_).first()
        now = timezone.now()  # the version is stored, and the round aggregated, at this one moment
        try:
            with transaction.atomic():
                version = AdapterVersion.objects.create(
                    adapter=round_.adapter,
                    number=_next_number(round_.adapter),
                    parent=round_.base_version,
                    blob_sha256=blob.sha256,
                    size=blob.size,
                    source=AdapterVersion.Source.ROUND,
                    round=round_,
                    metrics=metrics,
                    server_state=server_state,
                    note=f"round {round_.pk}: {round_.strategy} over {len(deltas)} deltas",
                    created_at=now,
                )
        except IntegrityError:
            return AdapterVersion.objects.filter(round=round_).first()
        Delta.objects.filter(pk__in=[d.pk for d in deltas], state=Delta.State.ACCEPTED).update(
            state=Delta.State.AGGREGATED
        )
        epsilon = _spend_dp(round_) if "dp" in round_.params else None
        Round.objects.filter(pk=round_.pk).update(
            state=Round.State.COMPLETED,
            completed_at=now,
            aggregated_at=now,
            stats=stats,
            epsilon=epsilon,
            failure="",
        )
        _record("round.completed", actor=None, adapter=round_.adapter, version=version, round=round_.pk, **stats)
        verdict = gate_record(version)
        if verdict["verdict"] == FAILED:
            reason = verdict["reason"]
            _record("version.gate_failed", actor=None, adapter=round_.adapter, version=version, reason=reason)
        round_.refresh_from_db()
        transaction.on_commit(
            lambda: round_event(
                round_,
                kind="round.completed",
                deltas=len(deltas),
                result_version=version.number,
                gate=verdict["verdict"],
            )
        )
        if aggregation_settings(round_.adapter)["auto_release"] and verdict["verdict"] != FAILED:
            transaction.on_commit(lambda: dispatch.release_round_result(version.pk))
    logger.info("round %s made %s from %d deltas in %.2fs", round_.pk, version, len(deltas), seconds)
    return version


def _server_update(round_: Round, delta: dict) -> tuple[dict, dict]:
    """The update to add to the base for the aggregated ``delta``, and the server state to store with the version:
    ``server_lr`` times it, or a server optimizer's step continuing the moments stored with the adapter's newest
    version a round made (``strategies.server_optimizers``; none yet, or another optimizer's: from the start)."""
    params, optimizer = round_.params, round_.params.get("server_optimizer")
    if not optimizer:
        lr = float(params.get("server_lr", 1.0))  # the server learning rate (aggregation_settings)
        return ({name: tensor.float() * lr for name, tensor in delta.items()} if lr != 1.0 else delta), {}
    newest = round_.adapter.versions.exclude(server_state={}).order_by("-number").first()
    before = newest.server_state if newest is not None else {}
    same = before.get("optimizer") == optimizer and before.get("blob")
    moments = load_safetensors(blob_read(before["blob"])) if same else None
    update, after = server_step(
        delta,
        moments,
        optimizer=optimizer,
        lr=float(params.get("server_lr", LR_DEFAULTS[optimizer])),
        momentum=float(params.get("server_momentum", MOMENTUM)),
        beta2=float(params.get("server_beta2", BETA2)),
        tau=float(params.get("server_tau", TAU)),
    )
    blob = blob_put_bytes(save_safetensors({k: v.contiguous() for k, v in after.items()}))
    steps = int(before.get("steps", 0)) + 1 if same else 1
    return update, {"optimizer": optimizer, "steps": steps, "blob": blob.sha256}


def _spend_dp(round_: Round) -> float:
    from training.federation.rounds import dp_sample_rate
    from training.federation.strategies.dp import dp_epsilon

    adapter = Adapter.objects.select_for_update(no_key=True).get(pk=round_.adapter_id)
    dp = dp_settings(adapter)
    step = [float(round_.params["dp"]["noise_multiplier"]), dp_sample_rate(adapter, round_.buffer_size), 1]
    history = [*adapter.dp_history, step]
    epsilon = dp_epsilon([tuple(s) for s in history], dp["delta"])
    Adapter.objects.filter(pk=adapter.pk).update(dp_history=history, dp_epsilon=epsilon)
    return epsilon
