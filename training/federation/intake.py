"""Receiving delta uploads, over the agent WebSocket or REST: resumable, size-limited, idempotent.

An upload is named by the sha256 its signed envelope claims. ``upload_begin`` answers where to (re)start:
the existing delta when this device already uploaded that file (a repeat is acknowledged, never counted
twice), else the bytes already staged. ``upload_append`` adds bytes at exactly that offset, refusing
anything past the declared size or the server's limit, and on the last byte stores the file by hash,
creates the ``Delta`` row (state ``received``) and enqueues its verification. Everything about trusting the
contents happens later, in the Celery worker (``training.federation.verification``).

Partial files live in ``DELTA_STAGING_DIR/<device>/<sha256>.part`` with the envelope beside them; a lock per
file keeps two connections of one device from interleaving writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction

from core.errors import Conflict, DomainError, Forbidden, NotFound, TooLarge, TooMany
from core.queries import only_row
from edge_agent.delta import parse_envelope
from training.federation.events import announce_delta
from training.models import Delta
from training.registry.blobs import blob_put_bytes, blob_put_file

logger = logging.getLogger(__name__)
MAX_STAGED_PER_DEVICE = 4
_SIGNATURE = re.compile(r"[A-Za-z0-9_-]{1,128}")  # base64url, as the device sends it
_SHA256 = re.compile(r"[0-9a-f]{64}")


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


@dataclass(frozen=True)
class UploadState:
    sha256: str
    size: int
    offset: int
    delta: Delta | None = None  # set once the file is complete (or was refused with a stored rejection)

    def body(self) -> dict:
        """Where the upload stands, as the socket's ``delta_state`` and the REST upload's answer give it."""
        delta = self.delta
        return {
            "sha256": self.sha256,
            "size": self.size,
            "offset": self.offset,
            "delta_id": delta.pk if delta else None,
            "state": delta.state if delta else "uploading",
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


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock = open(path.with_suffix(".lock"), "a")  # noqa: SIM115  (closed below)
    except FileNotFoundError:  # the sweep removed the device's empty folder just now
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")  # noqa: SIM115
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
    return envelope


def upload_begin(*, device, envelope, signature, channel: str, metrics: dict | None = None) -> UploadState:
    """Where this upload stands: done (its delta), or the offset to continue from (0 for a new one)."""
    envelope = _parse(device, envelope, signature)
    sha256, size = envelope["sha256"], envelope["size"]
    part, meta = _staging(device.pk, sha256)
    if size > settings.DELTA_MAX_BYTES:
        existing = _existing(device, sha256)
        if existing is not None:
            return UploadState(sha256, size, size, existing)
        delta = _row(
            device,
            envelope,
            signature,
            channel,
            state=Delta.State.REJECTED,
            rejection_code="too_large",
            rejection_detail=f"the delta is {size} bytes; the limit is {settings.DELTA_MAX_BYTES}",
        )
        announce_delta(delta)
        return UploadState(sha256, size, size, delta)
    # Every upload begun here leaves its lock file until beat's sweep (DELTA_STAGED_EXPIRY_SECONDS): without
    # one, this device has not sent this file lately and the look-up is skipped (a query per upload, on the
    # web processes' busiest path). A repeat after the sweep sends its bytes again, and the unique insert at the
    # end answers with the delta stored the first time: still counted once.
    if part.with_suffix(".lock").exists():
        existing = _existing(device, sha256)
        if existing is not None:
            return UploadState(sha256, size, size, existing)
    with _locked(part):
        if not part.exists():
            staged = list(part.parent.glob("*.part"))
            if len(staged) >= MAX_STAGED_PER_DEVICE:
                staged = [path for path in staged if not _expire(path)]
            if len(staged) >= MAX_STAGED_PER_DEVICE:
                existing = _existing(device, sha256)  # a repeat of a stored file (its lock file swept) is answered
                if existing is not None:
                    return UploadState(sha256, size, size, existing)
                raise UploadTooMany(
                    "too_many_uploads", f"this device has {len(staged)} unfinished uploads; finish or wait"
                )
            part.touch()
        kept = _metrics(metrics) or (json.loads(meta.read_text()).get("metrics", {}) if meta.exists() else {})
        meta.write_text(json.dumps({"envelope": envelope, "signature": signature, "metrics": kept}))
        offset = part.stat().st_size
    if offset > size:  # cannot happen through upload_append; a stray file is discarded
        part.unlink(missing_ok=True)
        offset = 0
    return UploadState(sha256, size, offset)


@contextmanager
def _lock_if_free(lock_path: Path, *, create: bool):
    """Yields True holding the lock at ``lock_path`` if no one holds it (or, without ``create``, if there is no
    lock file: an upload takes its lock before it touches anything), False if someone does."""
    try:
        lock = open(lock_path, "a" if create else "r")  # noqa: SIM115  (closed below)
    except FileNotFoundError:
        yield True
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _expire(part: Path, now: float | None = None) -> bool:
    """Discard a staged upload (its part, envelope and lock files) that no chunk reached for
    DELTA_STAGED_EXPIRY_SECONDS; True if it is gone. Only when no one holds its lock: an upload being written
    to right now is not stale. (The caller may hold another upload's lock.)"""
    try:
        age = (now or time.time()) - part.stat().st_mtime
    except FileNotFoundError:
        return True
    if age < settings.DELTA_STAGED_EXPIRY_SECONDS:
        return False
    lock_path = part.with_suffix(".lock")
    with _lock_if_free(lock_path, create=True) as free:
        if not free:
            return False
        for path in (part, part.with_suffix(".json"), lock_path):
            path.unlink(missing_ok=True)
    logger.info("discarded a staged upload no chunk reached for %.0f s: %s", age, part)
    return True


def staged_expire() -> int:
    """Beat's sweep of the staging folder: every device's stale unfinished uploads, and the lock and envelope
    files that finished uploads leave behind once they are as old. Returns how many uploads were discarded."""
    root = Path(settings.DELTA_STAGING_DIR)
    if not root.is_dir():
        return 0
    now, expired = time.time(), 0
    for folder in (path for path in root.iterdir() if path.is_dir()):
        for part in folder.glob("*.part"):
            expired += _expire(part, now)
        for leftover in (*folder.glob("*.lock"), *folder.glob("*.json")):
            with contextlib.suppress(FileNotFoundError):
                if now - leftover.stat().st_mtime < settings.DELTA_STAGED_EXPIRY_SECONDS:
                    continue
                with _lock_if_free(leftover.with_suffix(".lock"), create=False) as free:
                    if free and not leftover.with_suffix(".part").exists():
                        leftover.unlink()
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty
    return expired


def _metrics(metrics) -> dict:
    """What of the device's training metrics can be kept: numbers and short texts, nothing a JSONB column
    refuses (NaN, infinities, NUL, lone surrogates)."""
    if not isinstance(metrics, dict) or len(json.dumps(metrics, default=str)) > 2000:
        return {}
    return {
        str(k)[:40]: v
        for k, v in metrics.items()
        if str(k).isprintable()
        and (
            (isinstance(v, int) and not isinstance(v, bool))
            or (isinstance(v, float) and math.isfinite(v))
            or (isinstance(v, str) and v.isprintable())
        )
    }


def upload_append(*, device, sha256: str, offset: int, data: bytes, channel: str) -> UploadState:
    """Append ``data`` at ``offset``; on the last byte, store the file and create the delta row.

    A chunk of an upload in progress touches only its staging files (no query); the database is asked only
    when there is nothing staged, which is when the upload finished (maybe on another connection) or never
    began."""
    part, meta = _staging(device.pk, sha256)
    with _locked(part):
        if not meta.exists() or not part.exists():
            existing = _existing(device, sha256)
            if existing is not None:
                return UploadState(sha256, existing.size, existing.size, existing)
            raise UploadNotFound("unknown_upload", "no upload of this file was begun; send the envelope first")
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
            # No fsync per chunk: a part file torn by a crash fails the sha256 check at the end, is kept as a
            # `hash_mismatch` rejection, and the device may upload the same file again.
            with open(part, "ab") as handle:
                handle.write(data)
            have += len(data)
            if have < size:
                return UploadState(sha256, size, have)
            delta = _finish(device, staged, channel, part=part)
        part.unlink(missing_ok=True)
        meta.unlink(missing_ok=True)
    return UploadState(sha256, size, size, delta)


def _finish(device, staged: dict, channel: str, *, part: Path | None = None, data: bytes | None = None) -> Delta:
    """Store the complete file (from its part file, or ``data`` when it came in one chunk) and its row."""
    envelope = staged["envelope"]
    if data is not None:
        blob = blob_put_bytes(data)  # kept even when the hash is wrong: rejected deltas stay for forensics
    else:
        with open(part, "rb") as handle:
            blob = blob_put_file(handle)
    actual = blob.sha256
    fields: dict = {"blob_sha256": blob.sha256, "metrics": staged.get("metrics") or {}}
    if actual != envelope["sha256"]:
        stored = _existing(device, envelope["sha256"])
        if stored is not None:  # a repeat of a stored file (sent again after the sweep) arrived torn: it stands
            return stored
        fields.update(
            state=Delta.State.REJECTED,
            rejection_code="hash_mismatch",
            rejection_detail=f"the bytes hash to {actual[:16]}…, the signed envelope says {envelope['sha256'][:16]}…",
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
