"""Receiving delta uploads, over the agent WebSocket or REST: resumable, size-limited, idempotent.

An upload is named by the sha256 its signed envelope claims. ``upload_begin`` answers where to (re)start:
the existing delta when this device already uploaded that file (a repeat is acknowledged, never counted
twice), else the bytes already staged. ``upload_append`` adds bytes at exactly that offset, refusing
anything past the declared size or the server's limit, and on the last byte stores the file by hash,
creates the ``Delta`` row (state ``received``) and enqueues its verification. Everything about trusting the
contents happens later, in the Celery worker (``training.federation.verification``).

Partial files live in ``DELTA_STAGING_DIR/<device>/<sha256>.part`` with the envelope beside them; a lock per
file keeps two connections of one device from interleaving writes (``training.federation.staging``, which
also expires what no chunk reaches).

A begin is checked in full before anything is staged: the per-device rate limits, the envelope's fields and
its signature (the worker checks the signature again), the size, the signed ``created_at`` against the
server's clock and the metrics' schema. A refused begin stores nothing but a count on the device
(``devices.uploads``), so a hostile client costs neither disk nor rows.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.core.cache import cache
from django.db import IntegrityError, transaction
from django.utils import timezone

from core.errors import Conflict, DomainError, Forbidden, NotFound, TooLarge, TooMany
from core.queries import only_row
from devices.identity import accepted_protocols
from devices.uploads import RATE_LIMITED, upload_refused
from edge_agent.delta import parse_envelope
from edge_agent.protocol import MAX_DELTA_METRICS, METRIC_NAME_PATTERN, public_key_from_b64, verify
from training.federation.events import announce_delta
from training.federation.staging import expire, locked
from training.models import Delta
from training.registry.blobs import blob_put_bytes, blob_put_file

logger = logging.getLogger(__name__)
MAX_STAGED_PER_DEVICE = 4
_SIGNATURE = re.compile(r"[A-Za-z0-9_-]{1,128}")  # base64url, as the device sends it
_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_METRICS = MAX_DELTA_METRICS
_METRIC_NAME = re.compile(METRIC_NAME_PATTERN)


class UploadRefused(DomainError):
    """Refused at the door: nothing is stored. ``code`` is stable (the socket's ``delta_error``, the API's
    ``error.code``); the kinds below say which kind of refusal it is."""


class UploadNotFound(NotFound, UploadRefused):
    pass


class UploadForbidden(Forbidden, UploadRefused):
    pass


class UploadConflict(Conflict, UploadRefused):
    pass


class UploadTooLarge(TooLarge, UploadRefused):
    pass


class UploadTooMany(TooMany, UploadRefused):
    pass


class UploadRateLimited(UploadTooMany):
    """A per-device limit (``too_many_begins``, ``too_many_rejections``): ``retry_after`` whole seconds until
    a begin may pass again (the socket's ``delta_error`` field, the API's ``Retry-After``)."""

    def __init__(self, code: str, message: str, *, retry_after: int):
        super().__init__(code, message, details={"retry_after": max(1, int(retry_after))})


@dataclass(frozen=True)
class UploadState:
    sha256: str
    size: int
    offset: int
    delta: Delta | None = None  # set once the file is complete (or was refused with a stored rejection)
    aborted: bool = False  # the device gave the upload up (``upload_abort``): nothing of it is staged now

    def body(self) -> dict:
        """Where the upload stands, as the socket's ``delta_state`` and the REST upload's answer give it."""
        delta = self.delta
        return {
            "sha256": self.sha256,
            "size": self.size,
            "offset": self.offset,
            "delta_id": delta.pk if delta else None,
            "state": delta.state if delta else ("aborted" if self.aborted else "uploading"),
            "rejection_code": delta.rejection_code if delta else "",
            "rejection_detail": delta.rejection_detail if delta else "",
        }


def _staging(device_id, sha256: str) -> tuple[Path, Path]:
    # The name comes from the device (a socket's delta_chunk): anything but a sha256 could lead out of the
    # device's own folder, e.g. ``../<another device>/<its sha256>`` into that device's unfinished upload.
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise UploadNotFound("unknown_upload", "no such upload: an upload is named by its sha256 (64 hex digits)")
    folder = Path(settings.DELTA_STAGING_DIR) / str(device_id)
    return folder / f"{sha256}.part", folder / f"{sha256}.json"


def _existing(device, sha256: str) -> Delta | None:
    return only_row(Delta.objects.filter(device=device, sha256=sha256).exclude(rejection_code="hash_mismatch"))


def _row(device, envelope: dict, signature: str, channel: str, **fields) -> Delta:
    """Insert the delta row; a concurrent insert of the same file by the same device wins and is returned."""
    try:
        with transaction.atomic():
            return Delta.objects.create(
                device=device,
                adapter_name=envelope["adapter"],
                base_version_number=envelope["base_version"],
                sha256=envelope["sha256"],
                size=envelope["size"],
                num_samples=envelope["num_samples"],
                counter=envelope["counter"],
                envelope=envelope,
                signature=signature,
                channel=channel,
                **fields,
            )
    except IntegrityError:
        return _existing(device, envelope["sha256"])


def _parse(device, envelope, signature) -> dict:
    try:
        envelope = parse_envelope(envelope)
    except ValueError as exc:
        raise UploadRefused("malformed_envelope", str(exc)) from None
    if not isinstance(signature, str) or not _SIGNATURE.fullmatch(signature):
        raise UploadRefused("malformed_envelope", "the upload needs the envelope's signature (base64url)")
    if envelope["device_id"] != str(device.pk):
        raise UploadForbidden("wrong_device", "the envelope names another device; a device uploads only as itself")
    _check_signature(device, envelope, signature)
    return envelope


def _check_signature(device, envelope: dict, signature: str) -> None:
    """The envelope is signed by this device's key: checked before a byte is taken (the worker checks again,
    as it does for every delta, so a row never counts on this check alone)."""
    try:
        key = public_key_from_b64(device.public_key)
    except ValueError:
        raise UploadForbidden("bad_signature", "the device has no usable public key") from None
    if not verify(key, envelope, signature, protocols=accepted_protocols()):
        raise UploadForbidden("bad_signature", "the envelope's signature does not verify with this device's key")


def _check_size(envelope: dict) -> None:
    if envelope["size"] > settings.DELTA_MAX_BYTES:
        raise UploadTooLarge(
            "too_large", f"the delta is {envelope['size']} bytes; the limit is {settings.DELTA_MAX_BYTES}"
        )


def _check_created_at(envelope: dict) -> None:
    """The signed ``created_at`` lies within the stated window of the server's clock: a delta trained long ago
    (or replayed from an old capture) or by a device whose clock is far ahead is refused before it is taken."""
    now = time.time()
    oldest, newest = now - settings.DELTA_CREATED_AT_MAX_AGE_SECONDS, now + settings.DELTA_CREATED_AT_MAX_AHEAD_SECONDS
    created_at = envelope["created_at"]
    if not oldest <= created_at <= newest:
        raise UploadRefused(
            "bad_created_at",
            f"the envelope's created_at ({created_at:.0f}) must be within "
            f"{settings.DELTA_CREATED_AT_MAX_AGE_SECONDS} s before and {settings.DELTA_CREATED_AT_MAX_AHEAD_SECONDS} s "
            f"after the server's time ({now:.0f}, epoch seconds)",
        )


def _checked_metrics(metrics) -> dict:
    """The device's training metrics, stored exactly as sent once they fit the schema: an object of at most
    MAX_METRICS entries, each a name (``_METRIC_NAME``) and a finite number. Anything else refuses the begin
    naming the entry: a silent repair would store something the device did not say."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise UploadRefused("malformed_metrics", "metrics must be an object of names to numbers")
    if len(metrics) > MAX_METRICS:
        raise UploadRefused("malformed_metrics", f"metrics has {len(metrics)} entries; at most {MAX_METRICS}")
    for name, value in metrics.items():
        if not _METRIC_NAME.fullmatch(name):
            shown = name[:40] + ("…" if len(name) > 40 else "")
            raise UploadRefused(
                "malformed_metrics",
                f"metric name {shown!r} ({len(name)} characters) must match {_METRIC_NAME.pattern}",
            )
        finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
        if isinstance(value, bool) or not finite:
            raise UploadRefused("malformed_metrics", f"metric {name!r} must be a finite number, not {value!r:.40}")
    return metrics


def _check_begin_rate(device) -> None:
    """At most DELTA_BEGINS_PER_MINUTE begins per device in each minute (a fixed window counted in Redis)."""
    now = time.time()
    window = int(now // 60)
    key = f"delta-begins:{device.pk}:{window}"
    try:
        cache.add(key, 0, timeout=120)
        count = cache.incr(key)
    except Exception:  # Redis away for a moment: the begin is not held up by its own rate limit
        logger.warning("could not count a begin of %s", device.pk, exc_info=True)
        return
    limit = settings.DELTA_BEGINS_PER_MINUTE
    if count > limit:
        raise UploadRateLimited(
            RATE_LIMITED,
            f"more than {limit} upload begins this minute; wait and begin again",
            retry_after=math.ceil((window + 1) * 60 - now),
        )


def _check_rejections(device) -> None:
    """A device with DELTA_REJECTIONS_PER_HOUR deltas rejected in the last hour begins no more until the
    oldest of them is an hour old."""
    limit = settings.DELTA_REJECTIONS_PER_HOUR
    since = timezone.now() - timedelta(hours=1)
    times = list(
        Delta.objects.filter(device=device, state=Delta.State.REJECTED, received_at__gte=since)
        .order_by("-received_at")
        .values_list("received_at", flat=True)[:limit]
    )
    if len(times) >= limit:
        retry = (times[-1] - since).total_seconds()
        raise UploadRateLimited(
            "too_many_rejections",
            f"{limit} or more of this device's deltas were rejected in the last hour; fix the cause and wait",
            retry_after=math.ceil(retry),
        )


def begin_refused(device, refusal: UploadRefused) -> UploadRefused:
    """Count a refused begin on the device (``devices.uploads``) and hand the refusal back to be raised. Of
    the ``too_many_begins`` refusals only the first of each minute reaches the database; the rest are counted
    in Redis (a device hammering the door costs no writes)."""
    first = refusal.code != RATE_LIMITED or _first_refusal_in_window(device)
    try:
        upload_refused(device.pk, refusal.code, first_in_window=first)
    except Exception:  # the count is for operators; the refusal goes out whatever happens to it
        logger.warning("could not count a refused begin of %s", device.pk, exc_info=True)
    return refusal


def upload_begin(*, device, envelope, signature, channel: str, metrics: dict | None = None) -> UploadState:
    """Where this upload stands: done (its delta), or the offset to continue from (0 for a new one). A refusal
    (``UploadRefused``) stores nothing of the upload; it is counted on the device."""
    try:
        _check_begin_rate(device)
        envelope = _parse(device, envelope, signature)
        _check_size(envelope)
        _check_created_at(envelope)
        metrics = _checked_metrics(metrics)
        _check_rejections(device)
        return _begin(device, envelope, signature, metrics)
    except UploadRefused as refusal:
        raise begin_refused(device, refusal) from None


def _first_refusal_in_window(device) -> bool:
    try:
        return bool(cache.add(f"delta-begins-refused:{device.pk}:{int(time.time() // 60)}", 1, timeout=120))
    except Exception:  # Redis away: the rate limit did not count either, so this is not reached
        return False


def _begin(device, envelope: dict, signature: str, metrics: dict) -> UploadState:
    sha256, size = envelope["sha256"], envelope["size"]
    part, meta = _staging(device.pk, sha256)
    # Every upload begun here leaves its lock file until beat's sweep (DELTA_STAGED_EXPIRY_SECONDS): without
    # one, this device has not sent this file lately and the look-up is skipped (a query per upload, on the
    # web processes' busiest path). A repeat after the sweep sends its bytes again, and the unique insert at the
    # end answers with the delta stored the first time: still counted once.
    if part.with_suffix(".lock").exists():
        existing = _existing(device, sha256)
        if existing is not None:
            return UploadState(sha256, size, size, existing)
    with locked(part):
        if not part.exists():
            staged = list(part.parent.glob("*.part"))
            if len(staged) >= MAX_STAGED_PER_DEVICE:
                staged = [path for path in staged if not expire(path)]
            if len(staged) >= MAX_STAGED_PER_DEVICE:
                existing = _existing(device, sha256)  # a repeat of a stored file (its lock file swept) is answered
                if existing is not None:
                    return UploadState(sha256, size, size, existing)
                raise UploadTooMany(
                    "too_many_uploads",
                    f"this device has {len(staged)} unfinished uploads; finish one, abort one (delta_abort) or wait",
                )
            part.touch()
        kept = metrics or (json.loads(meta.read_text()).get("metrics", {}) if meta.exists() else {})
        meta.write_text(json.dumps({"envelope": envelope, "signature": signature, "metrics": kept}))
        offset = part.stat().st_size
    if offset > size:  # cannot happen through upload_append; a stray file is discarded
        part.unlink(missing_ok=True)
        offset = 0
    return UploadState(sha256, size, offset)


def upload_abort(*, device, sha256: str) -> UploadState:
    """Give up an unfinished upload: its part, envelope and lock files go (under its lock), freeing one of the
    device's MAX_STAGED_PER_DEVICE slots at once rather than after DELTA_STAGED_EXPIRY_SECONDS. An upload
    that is not staged (never begun, finished, or swept) is ``unknown_upload``."""
    part, meta = _staging(device.pk, sha256)
    if not part.exists() and not meta.exists():
        raise UploadNotFound("unknown_upload", "no unfinished upload of this file to abort")
    with locked(part):
        found = part.exists() or meta.exists()
        size = json.loads(meta.read_text())["envelope"]["size"] if meta.exists() else 0
        for path in (part, meta, part.with_suffix(".lock")):
            path.unlink(missing_ok=True)
    if not found:  # finished or aborted by another connection meanwhile
        raise UploadNotFound("unknown_upload", "no unfinished upload of this file to abort")
    logger.info("device %s aborted its upload of %s", device.pk, sha256[:12])
    return UploadState(sha256, size, 0, aborted=True)


def upload_append(*, device, sha256: str, offset: int, data: bytes, channel: str) -> UploadState:
    """Append ``data`` at ``offset``; on the last byte, store the file and create the delta row.

    A chunk of an upload in progress touches only its staging files (no query); the database is asked only
    when there is nothing staged, which is when the upload finished (maybe on another connection) or never
    began."""
    part, meta = _staging(device.pk, sha256)
    if not meta.exists() or not part.exists():  # not staged: no lock file is made for a name the device made up
        return _not_staged(device, sha256)
    with locked(part):
        if not meta.exists() or not part.exists():  # finished (or aborted) by another connection meanwhile
            return _not_staged(device, sha256)
        staged = json.loads(meta.read_text())
        envelope, size = staged["envelope"], staged["envelope"]["size"]
        have = part.stat().st_size
        if offset != have:
            raise UploadConflict("wrong_offset", f"the server holds {have} bytes of this file; continue from there")
        if have + len(data) > size:
            part.unlink(missing_ok=True)
            meta.unlink(missing_ok=True)
            delta = _row(
                device,
                envelope,
                staged["signature"],
                channel,
                state=Delta.State.REJECTED,
                rejection_code="too_large",
                rejection_detail=f"more than the {size} bytes the envelope declares were sent",
            )
            announce_delta(delta)
            return UploadState(sha256, size, size, delta)
        if have == 0 and len(data) == size:  # the whole file in one chunk: stored from memory, no part file
            delta = _finish(device, staged, channel, data=data)
        else:
            # No fsync per chunk: a part file torn by a crash fails the sha256 check at the end, is recorded as a
            # `hash_mismatch` rejection (its bytes are not stored), and the device may upload the same file again.
            with open(part, "ab") as handle:
                handle.write(data)
            have += len(data)
            if have < size:
                return UploadState(sha256, size, have)
            delta = _finish(device, staged, channel, part=part)
        part.unlink(missing_ok=True)
        meta.unlink(missing_ok=True)
    return UploadState(sha256, size, size, delta)


def _not_staged(device, sha256: str) -> UploadState:
    existing = _existing(device, sha256)
    if existing is not None:
        return UploadState(sha256, existing.size, existing.size, existing)
    raise UploadNotFound("unknown_upload", "no upload of this file was begun; send the envelope first")


def _finish(device, staged: dict, channel: str, *, part: Path | None = None, data: bytes | None = None) -> Delta:
    """Store the complete file (from its part file, or ``data`` when it came in one chunk) and its row. Bytes
    that are not the signed ones are never stored: the row (``hash_mismatch``) keeps the metadata, and the
    hash they had is in its detail."""
    envelope = staged["envelope"]
    if data is not None:
        blob = blob_put_bytes(data, expect_sha256=envelope["sha256"])
    else:
        with open(part, "rb") as handle:
            blob = blob_put_file(handle, expect_sha256=envelope["sha256"])
    fields: dict = {"blob_sha256": blob.sha256 if blob.stored else "", "metrics": staged.get("metrics") or {}}
    if not blob.stored:
        stored = _existing(device, envelope["sha256"])
        if stored is not None:  # a repeat of a stored file (sent again after the sweep) arrived torn: it stands
            return stored
        fields.update(
            state=Delta.State.REJECTED,
            rejection_code="hash_mismatch",
            rejection_detail=(
                f"the bytes hash to {blob.sha256[:16]}…, the signed envelope says {envelope['sha256'][:16]}…"
            ),
        )
    delta = _row(device, envelope, staged["signature"], channel, **fields)
    if delta.state == Delta.State.RECEIVED:
        from training.federation.verify_queue import queue_verification

        transaction.on_commit(lambda: queue_verification(delta.pk))
    announce_delta(delta)
    return delta


def upload_state(*, device, sha256: str) -> UploadState | None:
    """Where this device's upload of ``sha256`` stands (for a resuming client), or None if it never began."""
    delta = _existing(device, sha256)
    if delta is not None:
        return UploadState(sha256, delta.size, delta.size, delta)
    part, meta = _staging(device.pk, sha256)
    if not meta.exists():
        return None
    size = json.loads(meta.read_text())["envelope"]["size"]
    return UploadState(sha256, size, part.stat().st_size if part.exists() else 0)
