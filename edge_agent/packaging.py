"""From a trained adapter to a signed delta in a persistent outbox.

``package_delta`` makes the delta file's bytes and the signed envelope (``edge_agent.delta``). The
``Outbox`` is an SQLite file in the agent home plus one file per delta (``outbox/<sha256>.delta``, written
atomically): nothing queued is lost across restarts, a delta (by the sha256 of its bytes) is stored once,
and counters are allocated in the same transaction that inserts the row, so a counter can never be used by
two deltas, even after a crash (a counter from a rolled-back transaction was never signed into anything
that left the device).

Row states: ``queued`` -> ``uploading`` -> ``sent`` -> ``accepted`` | ``rejected`` (and ``uploading`` back
to ``queued`` when a connection drops).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_agent.delta import compute_delta, encode_delta, sign_delta
from edge_agent.identity import atomic_write

STATES = ("queued", "uploading", "sent", "accepted", "rejected")
TRANSITIONS = {
    "queued": {"uploading", "sent", "accepted", "rejected"},
    "uploading": {"queued", "uploading", "sent", "accepted", "rejected"},
    "sent": {"accepted", "rejected"},
    "accepted": set(),
    "rejected": set(),
}
SCHEMA = """
CREATE TABLE IF NOT EXISTS deltas (
    sha256 TEXT PRIMARY KEY,
    counter INTEGER NOT NULL UNIQUE,
    path TEXT NOT NULL,
    size INTEGER NOT NULL,
    envelope TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'queued',
    bytes_acknowledged INTEGER NOT NULL DEFAULT 0,
    detail TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, next INTEGER NOT NULL);
"""


def package_delta(
    new_tensors: dict[str, torch.Tensor],
    base_tensors: dict[str, torch.Tensor],
    *,
    key: Ed25519PrivateKey,
    device_id: str,
    adapter: str,
    base_version: int,
    num_samples: int,
    counter: int,
    encoding: str = "f32",
    only_b: bool = False,
    created_at: float | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """``(delta file bytes, {"envelope": ..., "signature": ...})`` for ``new - base``; the same tensors always
    give the same bytes."""
    data = encode_delta(compute_delta(new_tensors, base_tensors, only_b=only_b), encoding=encoding)
    signed = sign_delta(
        key,
        data,
        device_id=device_id,
        adapter=adapter,
        base_version=base_version,
        num_samples=num_samples,
        counter=counter,
        created_at=created_at,
    )
    return data, signed


@dataclass(frozen=True)
class OutboxItem:
    sha256: str
    counter: int
    path: Path
    size: int
    envelope: dict[str, Any]  # {"envelope": {...}, "signature": "..."}
    state: str
    bytes_acknowledged: int
    detail: str

    def read(self) -> bytes:
        return self.path.read_bytes()


class Outbox:
    def __init__(self, home: Path | str, *, filename: str = "outbox.sqlite3"):
        self.home = Path(home)
        self.directory = self.home / "outbox"
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.db_path = self.home / filename
        with closing(self._connect()) as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.db_path, isolation_level=None, timeout=30)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA synchronous=FULL")
        return db

    @staticmethod
    def _allocate(db: sqlite3.Connection) -> int:
        row = db.execute("SELECT next FROM counters WHERE name = 'delta'").fetchone()
        highest = db.execute("SELECT COALESCE(MAX(counter) + 1, 0) FROM deltas").fetchone()[0]
        counter = max(row["next"] if row else 0, highest)
        db.execute(
            "INSERT INTO counters (name, next) VALUES ('delta', ?)"
            " ON CONFLICT(name) DO UPDATE SET next = excluded.next",
            (counter + 1,),
        )
        return counter

    def next_counter(self) -> int:
        """Reserve a counter on its own (committed: never handed out again). ``put`` allocates its own."""
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                counter = self._allocate(db)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return counter

    def put(self, make: Callable[[int], tuple[bytes, dict[str, Any]]]) -> tuple[OutboxItem, bool]:
        """Allocate a counter, call ``make(counter) -> (delta bytes, signed envelope)`` (e.g. a
        ``package_delta`` partial) and store the result, all in one transaction. Returns ``(item, created)``;
        when the same bytes are already in the outbox the transaction rolls back (the counter is not used)
        and the stored item comes back with ``created=False``."""
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                counter = self._allocate(db)
                data, signed = make(counter)
                sha256 = hashlib.sha256(data).hexdigest()
                envelope = signed.get("envelope", {})
                if envelope.get("counter") != counter or envelope.get("sha256") != sha256:
                    raise ValueError("the envelope must carry the allocated counter and the sha256 of the bytes")
                if db.execute("SELECT 1 FROM deltas WHERE sha256 = ?", (sha256,)).fetchone():
                    db.execute("ROLLBACK")
                    return self.get(sha256), False
                path = self.directory / f"{sha256}.delta"
                atomic_write(path, data)
                now = time.time()
                db.execute(
                    "INSERT INTO deltas (sha256, counter, path, size, envelope, created_at, updated_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (sha256, counter, str(path), len(data), json.dumps(signed, sort_keys=True), now, now),
                )
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        return self.get(sha256), True

    def put_delta(self, new_tensors, base_tensors, **package_kwargs) -> tuple[OutboxItem, bool]:
        """``package_delta`` with a counter allocated by the outbox, then ``put``."""
        return self.put(lambda counter: package_delta(new_tensors, base_tensors, counter=counter, **package_kwargs))

    @staticmethod
    def _item(row: sqlite3.Row) -> OutboxItem:
        return OutboxItem(
            sha256=row["sha256"],
            counter=row["counter"],
            path=Path(row["path"]),
            size=row["size"],
            envelope=json.loads(row["envelope"]),
            state=row["state"],
            bytes_acknowledged=row["bytes_acknowledged"],
            detail=row["detail"],
        )

    def get(self, sha256: str) -> OutboxItem:
        with closing(self._connect()) as db:
            row = db.execute("SELECT * FROM deltas WHERE sha256 = ?", (sha256,)).fetchone()
        if row is None:
            raise KeyError(f"no delta {sha256} in the outbox")
        return self._item(row)

    def items(self, *states: str) -> list[OutboxItem]:
        """Every row (or those in ``states``), by counter."""
        with closing(self._connect()) as db:
            if states:
                marks = ",".join("?" * len(states))
                rows = db.execute(f"SELECT * FROM deltas WHERE state IN ({marks}) ORDER BY counter", states)  # noqa: S608
            else:
                rows = db.execute("SELECT * FROM deltas ORDER BY counter")
            return [self._item(r) for r in rows.fetchall()]

    def pending(self) -> list[OutboxItem]:
        """What still has to be uploaded (``queued``, or ``uploading`` from an interrupted attempt), oldest
        first; rows already ``sent`` wait for the server's verdict and are never uploaded again."""
        return self.items("queued", "uploading")

    def mark(
        self, sha256: str, state: str, *, bytes_acknowledged: int | None = None, detail: str | None = None
    ) -> OutboxItem:
        """Move a row to ``state`` (ValueError on a transition that is not allowed, e.g. back from
        ``accepted``); ``bytes_acknowledged`` records how far a resumable upload got."""
        if state not in STATES:
            raise ValueError(f"unknown outbox state {state!r}: use one of {list(STATES)}")
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                row = db.execute("SELECT state, size FROM deltas WHERE sha256 = ?", (sha256,)).fetchone()
                if row is None:
                    raise KeyError(f"no delta {sha256} in the outbox")
                if state != row["state"] and state not in TRANSITIONS[row["state"]]:
                    raise ValueError(f"a {row['state']} delta cannot become {state}")
                if bytes_acknowledged is not None and not 0 <= bytes_acknowledged <= row["size"]:
                    raise ValueError(f"bytes_acknowledged must be within 0..{row['size']}")
                db.execute(
                    "UPDATE deltas SET state = ?, bytes_acknowledged = COALESCE(?, bytes_acknowledged),"
                    " detail = COALESCE(?, detail), updated_at = ? WHERE sha256 = ?",
                    (state, bytes_acknowledged, detail, time.time(), sha256),
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return self.get(sha256)

    def purge_finished(self) -> int:
        """Delete the files of accepted and rejected deltas (their rows stay, so counters stay used)."""
        removed = 0
        for item in self.items("accepted", "rejected"):
            if item.path.exists():
                item.path.unlink()
                removed += 1
        return removed
