"""Verifying one received delta before it can count (README.md, "Deltas, verification and rounds"), run by a
Celery worker.

The checks run in a fixed order and the first failure is stored as a stable ``rejection_code`` with a
detail a person can act on. A rejected delta's row is kept (its metadata, for forensics) and never aggregated;
its bytes are deleted once the verdict is written, unless something else still refers to the same blob
(``rejected_bytes_delete``). An accepted
delta joins its adapter's collecting round (``training.federation.rounds``). Running this twice for one delta
changes nothing the second time: only a ``received`` delta is verified.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Count, Exists, OuterRef, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from core.queries import only_row
from devices.identity import accepted_protocols
from devices.models import DeviceStatus
from edge_agent.protocol import public_key_from_b64, verify
from training.federation.aggregation_settings import aggregation_settings
from training.federation.delta_contents import Rejection, contents_check
from training.federation.events import announce_delta
from training.federation.rounds import round_admit, round_admit_many
from training.models import Adapter, AdapterVersion, BaseModel, Delta
from training.registry.blobs import blob_delete, blob_open, blob_path

logger = logging.getLogger(__name__)


def _check_bytes(delta: Delta) -> None:
    """What the row says of the bytes, before any is read; that the stored bytes are the signed ones (their
    size and sha256) is checked while ``_check_contents`` reads them."""
    if delta.size > settings.DELTA_MAX_BYTES:
        raise Rejection("too_large", f"the delta is {delta.size} bytes; the limit is {settings.DELTA_MAX_BYTES}")
    if delta.blob_sha256 != delta.sha256:
        raise Rejection("hash_mismatch", "the stored bytes do not hash to the signed sha256")


def _memoized(memo: dict | None, key: tuple, load):
    """``load()``, or what it gave for ``key`` earlier in the same batch (``memo``; None: no batch)."""
    if memo is None:
        return load()
    if key not in memo:
        memo[key] = load()
    return memo[key]


def _check_device(delta: Delta, memo: dict | None = None) -> Adapter:
    device = delta.device  # loaded with its cohort by delta_verify
    try:
        key = public_key_from_b64(device.public_key)
    except ValueError:
        raise Rejection("bad_signature", "the device has no usable public key") from None
    if not verify(key, delta.envelope, delta.signature, protocols=accepted_protocols()):
        raise Rejection("bad_signature", "the envelope's signature does not verify with this device's key")
    if device.status != DeviceStatus.ACTIVE:
        raise Rejection("device_not_active", f"the device is {device.status}; only active devices may contribute")
    adapter = _memoized(
        memo,
        ("adapter", delta.adapter_name, device.cohort_id),
        lambda: only_row(
            Adapter.objects.filter(name=delta.adapter_name).annotate(
                trains_cohort=Exists(
                    Adapter.cohorts.through.objects.filter(adapter=OuterRef("pk"), cohort=device.cohort_id)
                )
            )
        ),
    )
    if adapter is None:
        raise Rejection("unknown_adapter", f"there is no adapter {delta.adapter_name!r}")
    delta.adapter = adapter
    if not adapter.trains_cohort:
        raise Rejection("wrong_cohort", f"cohort {device.cohort.name!r} does not train adapter {adapter.name!r}")
    return adapter


def _check_base(delta: Delta, adapter: Adapter, memo: dict | None = None) -> AdapterVersion:
    """The base version exists, is not revoked and is at most ``max_staleness`` released versions behind the
    newest released one. Staleness counts released versions only: candidates the release gate held back never
    reached devices, so however many of them a run of rounds makes, a delta on what devices run stays fresh."""
    newer = AdapterVersion.objects.filter(
        adapter=adapter, state=AdapterVersion.State.RELEASED, number__gt=OuterRef("number")
    )
    count = newer.order_by().values("adapter").annotate(n=Count("pk")).values("n")
    base = _memoized(
        memo,
        ("base", adapter.pk, delta.base_version_number),
        lambda: only_row(
            adapter.versions.filter(number=delta.base_version_number).annotate(
                newer_released=Coalesce(Subquery(count), 0),
                newest_released=Subquery(newer.order_by("-number").values("number")[:1]),
            )
        ),
    )
    if base is None or base.state == AdapterVersion.State.REVOKED:
        what = "does not exist" if base is None else "was revoked"
        raise Rejection("unknown_base_version", f"{adapter.name} v{delta.base_version_number} {what}")
    staleness = base.newer_released
    limit = aggregation_settings(adapter)["max_staleness"]
    if staleness > limit:
        raise Rejection(
            "stale_base_version",
            f"based on v{base.number}, {staleness} released versions behind v{base.newest_released} (the limit is "
            f"{limit}): the device has not installed a newer version; it gets one at its next assignment",
        )
    delta.base_version, delta.staleness = base, staleness
    return base


def _check_contents(delta: Delta, adapter: Adapter) -> tuple[str, float]:
    """The contents check on the stored bytes. Bytes that are gone are not the signed ones either: deleted by a
    run that rejected this delta meanwhile (whose verdict stands: only a ``received`` delta is written), or lost
    from storage (rejected, claiming no counter, rather than failing every try)."""
    try:
        handle = blob_open(delta.blob_sha256)
    except FileNotFoundError:
        raise Rejection("hash_mismatch", "the stored bytes are gone: nothing to verify") from None
    with handle:
        return contents_check(
            handle, size=delta.size, sha256=delta.sha256, adapter=adapter, path=blob_path(delta.blob_sha256)
        )


def delta_verify(*, delta_id: int) -> Delta | None:
    """Verify a received delta; returns it accepted or rejected (None if it is gone or already done).

    The checks only read; every outcome is written by one conditional update at the end (``_finish``), so a
    second run, or a run racing this one, changes nothing. The counter is claimed by that same update: it
    comes after the checks that precede it in the documented order (README.md, "Deltas, verification and
    rounds": bytes, signature, device, adapter), so a delta that fails a later check still uses up its counter,
    and a replay is caught by the database's ``UNIQUE(device, counter)`` however close together the two
    arrive."""
    delta = only_row(Delta.objects.select_related("device__cohort").filter(pk=delta_id, state=Delta.State.RECEIVED))
    if delta is None or (attempts := delta_attempt([delta.pk]).get(delta.pk)) is None:
        return None
    return _finish(delta, given_up(delta, attempts) or delta_judge(delta))


def delta_attempt(ids: list[int]) -> dict[int, int]:
    """Count a verification run begun on each of these deltas still ``received``: their tries so far, this one
    included, by id (one left out was verified meanwhile). Run outside a transaction, so the count is committed
    before the checks: a worker that dies in them still leaves it up (``given_up``)."""
    if not ids:
        return {}
    with connection.cursor() as cursor:
        cursor.execute(_attempt_sql(), [list(ids), Delta.State.RECEIVED])
        return dict(cursor.fetchall())


@lru_cache(maxsize=1)
def _attempt_sql() -> str:
    """``delta_attempt``'s UPDATE ... RETURNING (built once, as ``_outcome_sql``)."""
    meta = Delta._meta
    quote = connection.ops.quote_name
    attempts = quote(meta.get_field("verify_attempts").column)
    return (  # identifiers from the model's own metadata; every value a parameter
        f"UPDATE {quote(meta.db_table)} SET {attempts} = {attempts} + 1"  # noqa: S608
        f" WHERE {quote(meta.pk.column)} = ANY(%s) AND {quote(meta.get_field('state').column)} = %s"
        f" RETURNING {quote(meta.pk.column)}, {attempts}"
    )


def given_up(delta: Delta, attempts: int) -> Verdict | None:
    """The verdict for a delta past DELTA_VERIFY_MAX_ATTEMPTS tries (each begun and never finished), else
    None. It does not claim the counter: nothing says its signature held."""
    limit = settings.DELTA_VERIFY_MAX_ATTEMPTS
    if attempts <= limit:
        return None
    detail = (
        f"verification was begun {limit} times and never finished (the worker died or failed on this delta "
        f"each time; its log names delta {delta.pk}); it is not tried again"
    )
    return Verdict(Delta.State.REJECTED, "verification_failed", detail)


@dataclass(frozen=True)
class Verdict:
    """What the checks found for one delta, before anything is written."""

    state: str
    code: str = ""
    detail: str = ""
    claim_counter: bool = False
    encoding: str = ""
    norm: float | None = None


def delta_judge(delta: Delta, memo: dict | None = None) -> Verdict:
    """Run the checks on a delta loaded ``received`` with its device and cohort; writes nothing. ``memo``, one
    dict per batch (``training.federation.verify_queue``), lets the batch's deltas share the adapter and base version
    looked up for the first of them (a batch takes a fraction of a second: a setting or version that changes
    meanwhile counts from the next batch)."""
    try:
        _check_bytes(delta)
        adapter = _check_device(delta, memo)
    except Rejection as rejection:
        return Verdict(Delta.State.REJECTED, rejection.code, rejection.detail)
    try:
        _check_base(delta, adapter, memo)
        encoding, norm = _check_contents(delta, adapter)
    except Rejection as rejection:
        # Stored bytes that are not the signed ones (found while reading them) are not the device's doing: they
        # claim no counter, as at the door.
        claim = rejection.code != "hash_mismatch"
        return Verdict(Delta.State.REJECTED, rejection.code, rejection.detail, claim_counter=claim)
    return Verdict(Delta.State.ACCEPTED, claim_counter=True, encoding=encoding, norm=norm)


class _CounterUsed(Exception):
    """The device's counter is already claimed by another of its deltas (a replay)."""


def _fields(delta: Delta, verdict: Verdict, now) -> dict:
    """The columns a verdict writes besides state, code, detail and the counter claim."""
    fields = {
        "adapter": delta.adapter,
        "base_version": delta.base_version,
        "staleness": delta.staleness,
        "verified_at": now,
    }
    if verdict.state == Delta.State.ACCEPTED:
        fields.update(encoding=verdict.encoding, norm=verdict.norm)
    return fields


def _finish(delta: Delta, verdict: Verdict) -> Delta | None:
    fields = _fields(delta, verdict, timezone.now())
    try:
        return _record(delta, verdict.state, verdict.code, verdict.detail, verdict.claim_counter, fields)
    except _CounterUsed:
        detail = f"counter {delta.counter} was already used by another delta of this device"
        return _record(delta, Delta.State.REJECTED, "replayed_counter", detail, False, fields)


def _outcome(state: str, code: str, detail: str, claim_counter: bool, fields: dict) -> dict:
    """Every column an outcome writes, by field name."""
    return {
        **fields,
        "state": state,
        "rejection_code": code,
        "rejection_detail": detail[:500],
        "counter_claimed": claim_counter,
    }


def _apply(delta: Delta, values: dict) -> None:
    for name, value in values.items():
        setattr(delta, name, value)


def _record(delta: Delta, state: str, code: str, detail: str, claim_counter: bool, fields: dict) -> Delta | None:
    """Write the outcome (claiming the counter if asked) and, if accepted, admit the delta to its round: one
    transaction. A used counter rolls it back whole (no savepoint per verification) as ``_CounterUsed``."""
    values = _outcome(state, code, detail, claim_counter, fields)
    with transaction.atomic():
        try:
            changed = Delta.objects.filter(pk=delta.pk, state=Delta.State.RECEIVED).update(**values)
        except IntegrityError:
            if not claim_counter:
                raise
            raise _CounterUsed from None
        if not changed:
            return None
        _apply(delta, values)
        if state == Delta.State.ACCEPTED:
            delta.round = round_admit(delta=delta)
        announce_delta(delta)
        if state == Delta.State.REJECTED:
            transaction.on_commit(lambda: rejected_bytes_delete([delta]))
    return delta


def _blob_in_use(sha256: str) -> bool:
    """Another delta that is not rejected, an adapter version or a base model holds these bytes."""
    return (
        Delta.objects.filter(blob_sha256=sha256).exclude(state=Delta.State.REJECTED).exists()
        or AdapterVersion.objects.filter(blob_sha256=sha256).exists()
        or BaseModel.objects.filter(weights_sha256=sha256).exists()
    )


def rejected_bytes_delete(deltas: list[Delta]) -> int:
    """Delete the stored bytes of these rejected deltas once their verdict is committed: a rejected delta keeps
    its row (metadata), not a device's bytes the server will never use. A blob something else still refers to
    stays (``_blob_in_use``); the rows whose bytes went have ``blob_sha256`` blanked. Returns how many blobs went.
    A failure leaves the bytes (logged): the verdict stands either way."""
    gone, cleared = 0, []
    for sha256 in {delta.blob_sha256 for delta in deltas if delta.state == Delta.State.REJECTED and delta.blob_sha256}:
        try:
            if not _blob_in_use(sha256):
                blob_delete(sha256)
                gone += 1
            cleared.append(sha256)
        except Exception:
            logger.warning("could not delete the bytes of a rejected delta (blob %s)", sha256, exc_info=True)
    ids = [delta.pk for delta in deltas if delta.blob_sha256 in cleared]
    if ids:
        Delta.objects.filter(pk__in=ids, state=Delta.State.REJECTED).update(blob_sha256="")
    return gone


# --- a batch (training.federation.verify_queue): the same outcomes, written together ---

_OUTCOME_FIELDS = (
    "state",
    "rejection_code",
    "rejection_detail",
    "counter_claimed",
    "adapter",
    "base_version",
    "staleness",
    "encoding",
    "norm",
    "verified_at",
)


def delta_record_batch(judged: list[tuple[Delta, Verdict]]) -> list[Delta]:
    """Write a batch's verdicts in one transaction: one ``UPDATE`` for every outcome (each only if the delta is
    still ``received``) and, per adapter, one admission of its accepted deltas to the round
    (``round_admit_many``). Returns the deltas it recorded; one verified meanwhile by another run is left out,
    as ``delta_verify`` returns None for it. A counter claimed twice (a replay, even within the batch) rolls
    the batch back, and its verdicts are recorded one by one, which tells the replay apart. The outcomes are
    the ones ``delta_verify`` would write for each delta; it saves the statements and commits of each delta's
    own transaction, the larger part of a verification's cost. Adapters are admitted in id order, so two
    batches holding deltas of the same adapters lock their rounds in the same order."""
    if not judged:
        return []
    now = timezone.now()
    try:
        with transaction.atomic():
            rows = {}
            for delta, verdict in judged:  # a rejection keeps the (empty) encoding and norm the delta has
                fields = {"encoding": delta.encoding, "norm": delta.norm, **_fields(delta, verdict, now)}
                values = _outcome(verdict.state, verdict.code, verdict.detail, verdict.claim_counter, fields)
                rows[delta.pk] = (delta, values)
            changed = _set_outcomes(list(rows.values()))
            recorded = [rows[pk][0] for pk in rows if pk in changed]
            for pk in changed:
                _apply(*rows[pk])
            by_adapter: dict[int, list[Delta]] = {}
            for delta in recorded:
                if delta.state == Delta.State.ACCEPTED:
                    by_adapter.setdefault(delta.adapter_id, []).append(delta)
            for adapter_id in sorted(by_adapter):
                round_admit_many(by_adapter[adapter_id])
            for delta in recorded:
                announce_delta(delta)
            rejected = [delta for delta in recorded if delta.state == Delta.State.REJECTED]
            if rejected:
                transaction.on_commit(lambda: rejected_bytes_delete(rejected))
    except IntegrityError:
        return _record_one_by_one(judged)
    return recorded


def _record_one_by_one(judged: list[tuple[Delta, Verdict]]) -> list[Delta]:
    """The batch's verdicts, each in a transaction of its own (``_finish``: a used counter makes the delta a
    ``replayed_counter`` rejection), on the rows loaded again: the batch's rolled-back writes may have changed
    the objects in memory. The checks are not run again."""
    fresh = Delta.objects.select_related("device__cohort").in_bulk([delta.pk for delta, _ in judged])
    recorded = []
    for delta, verdict in judged:
        again = fresh.get(delta.pk)
        if again is None or again.state != Delta.State.RECEIVED:
            continue
        again.adapter, again.base_version, again.staleness = delta.adapter, delta.base_version, delta.staleness
        if (done := _finish(again, verdict)) is not None:
            recorded.append(done)
    return recorded


@lru_cache(maxsize=32)
def _outcome_sql(size: int) -> tuple[list, str]:
    """The outcome fields and the ``UPDATE ... FROM (VALUES ...)`` text for a batch of ``size`` rows (they
    depend on nothing else, so each batch size is built once)."""
    meta = Delta._meta
    fields = [meta.get_field(name) for name in _OUTCOME_FIELDS]
    quote = connection.ops.quote_name
    pk = meta.pk
    types = [pk.cast_db_type(connection), *(field.cast_db_type(connection) for field in fields)]
    row_sql = "(" + ", ".join(f"%s::{kind}" for kind in types) + ")"
    columns = [quote(pk.column), *(quote(field.column) for field in fields)]
    sql = (  # identifiers from the model's own metadata; every value a parameter
        f"UPDATE {quote(meta.db_table)} AS d SET "  # noqa: S608
        + ", ".join(f"{column} = v.{column}" for column in columns[1:])
        + f" FROM (VALUES {', '.join([row_sql] * size)}) AS v({', '.join(columns)})"
        + f" WHERE d.{columns[0]} = v.{columns[0]} AND d.{quote(meta.get_field('state').column)} = %s"
        + f" RETURNING d.{columns[0]}"
    )
    return fields, sql


def _set_outcomes(rows: list[tuple[Delta, dict]]) -> set[int]:
    """One ``UPDATE ... FROM (VALUES ...)`` writing each row's outcome (``_outcome``) if its delta is still
    received; the ids it changed."""
    fields, sql = _outcome_sql(len(rows))
    params: list = []
    for delta, values in rows:
        params.append(delta.pk)
        for field in fields:
            value = values[field.name]
            if field.is_relation:
                value = None if value is None else value.pk
            params.append(field.get_db_prep_value(value, connection))
    params.append(Delta.State.RECEIVED)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {row[0] for row in cursor.fetchall()}
