"""Feedback on the served model's answers: a user confirms an answer or corrects it, and the answer's input
becomes a labelled sample.

Every answer ``Agent.predict`` gives carries an id (``secrets.token_urlsafe(16)``: 22 characters, unguessable,
never starting with ``-``, so a command line never takes one for an option).
The agent keeps the input of its recent answers on the device, in ``<home>/answers.sqlite3`` (mode 0600, like
the rest of the home; every change one SQLite transaction, so a power cut leaves it as it was before or after;
dropped inputs overwritten, ``secure_delete``, their last copies in the write-ahead log gone at its next
checkpoint, within ``WAL_PAGES``), and never uploads it: at most ``answers_keep`` answers (1,000)
and none older than ``answers_keep_days`` (7 days), the oldest dropped first (``edge-agent configure
--answers-keep N --answers-keep-days D``; 0 answers keeps none, and feedback is then refused).

Feedback (``Answers.answer``, through ``Agent.feedback``, ``edge-agent feedback ID LABEL`` or a feedback file in
the inbox, ``read_feedback``) names an answer by its id and gives its label: the predicted one confirms the
answer, another corrects it. Either way the kept input with that label is handed to ``Agent.add_samples``, so
every check of the schema (the label range above all) applies, and the answer is marked answered. Feedback on
an id the agent never gave, an expired one, one already answered or a label the schema refuses raises
``FeedbackError`` with the reason, and changes nothing; several entries (a file) are taken whole or not at all.

An answer whose input was dropped, or that was answered, leaves a mark (its id, when, and why: no input, no
label), so feedback on it says "expired" or "already confirmed" rather than "unknown"; at most ``answers_keep``
marks are kept, the oldest dropped first. How many answers were confirmed and how many corrected are counted per
installed version and served model (``Answers.status``, in ``edge-agent status`` and ``Agent.status()``), the
share corrected being what users say of the model.

A power cut after the sample is stored and before the answer is marked answered (one transaction, committed
right after the sample store's atomic write) leaves the answer open: feedback given on it again would store the
sample twice. The window is the time of one commit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent import bounded_json
from edge_agent.families.common import LABEL
from edge_agent.sample_bounds import MAX_JSON_BYTES, SampleError, open_regular
from edge_agent.sample_formats import bounded_lines
from edge_agent.visible_text import visible

ANSWERS_FILE = "answers.sqlite3"
KEEP_ANSWERS = 1000
KEEP_DAYS = 7.0
DAY = 86400.0
FEEDBACK_SUFFIXES = (".feedback.jsonl", ".feedback.json")  # inbox files of feedback, not of samples
MAX_FEEDBACK_BYTES = MAX_JSON_BYTES  # a feedback file: 4 MiB, some 60,000 entries
MAX_FEEDBACK_LINE = 4096  # one entry: {"id": "...", "label": 3}
MAX_ID_CHARS = 64
SCHEMA_VERSION = 1
WAL_PAGES = 100  # the write-ahead log is checkpointed into the file (and emptied) every 100 pages, some 400 kB

SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    at REAL NOT NULL,
    state TEXT NOT NULL,          -- open, confirmed, corrected, expired
    why TEXT NOT NULL DEFAULT '', -- of an expired answer: age or count
    predicted INTEGER,            -- these five are NULL once the answer is no longer open
    adapter TEXT,
    version INTEGER,
    serving TEXT,
    layout TEXT,
    input BLOB,
    closed_at REAL
);
CREATE INDEX IF NOT EXISTS answers_state ON answers (state, seq);
CREATE TABLE IF NOT EXISTS feedback_counts (
    adapter TEXT NOT NULL,
    version INTEGER NOT NULL,
    serving TEXT NOT NULL,
    confirmed INTEGER NOT NULL DEFAULT 0,
    corrected INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (adapter, version, serving)
);
"""


# An answer whose input is dropped keeps its id, when and why (its mark); the rest is gone.
EXPIRE_BY_AGE = """UPDATE answers SET state = 'expired', why = 'age', predicted = NULL, adapter = NULL,
    version = NULL, serving = NULL, layout = NULL, input = NULL, closed_at = ? WHERE state = 'open' AND at < ?"""
EXPIRE_BY_COUNT = """UPDATE answers SET state = 'expired', why = 'count', predicted = NULL, adapter = NULL,
    version = NULL, serving = NULL, layout = NULL, input = NULL, closed_at = ? WHERE state = 'open' AND seq NOT IN
    (SELECT seq FROM answers WHERE state = 'open' ORDER BY seq DESC LIMIT ?)"""
COUNT = {
    "confirmed": """INSERT INTO feedback_counts (adapter, version, serving, confirmed) VALUES (?, ?, ?, 1)
        ON CONFLICT (adapter, version, serving) DO UPDATE SET confirmed = confirmed + 1""",
    "corrected": """INSERT INTO feedback_counts (adapter, version, serving, corrected) VALUES (?, ?, ?, 1)
        ON CONFLICT (adapter, version, serving) DO UPDATE SET corrected = corrected + 1""",
}


class FeedbackError(ValueError):
    """Feedback that is refused: an unknown, expired or answered id, a label the schema refuses, a malformed
    feedback file. The message says which and why; nothing was changed."""


def is_feedback_file(path: Path) -> bool:
    return path.name.lower().endswith(FEEDBACK_SUFFIXES)


def new_id() -> str:
    """22 URL-safe characters whose first is never ``-``: ``edge-agent feedback -x… 3`` would read it as an option."""
    while True:
        answer_id = secrets.token_urlsafe(16)
        if not answer_id.startswith("-"):
            return answer_id


# An answer's input (the checked fields of one sample, without the label) as one blob and its layout ------------


def _pack(fields: dict[str, np.ndarray], index: int) -> tuple[str, bytes]:
    layout, parts = [], []
    for name in sorted(fields):
        value = fields[name][index]
        if fields[name].dtype == object:  # a text field
            data = str(value).encode("utf-8", "surrogatepass")
            layout.append([name, "text", [], len(data)])
        else:
            value = np.ascontiguousarray(value)
            data = value.tobytes()
            layout.append([name, value.dtype.str, list(value.shape), len(data)])
        parts.append(data)
    return json.dumps(layout), b"".join(parts)


def _unpack(layout: str, blob: bytes) -> dict[str, Any]:
    fields, offset = {}, 0
    for name, dtype, shape, length in json.loads(layout):
        data = blob[offset : offset + length]
        offset += length
        if dtype == "text":
            fields[name] = data.decode("utf-8", "surrogatepass")
        else:
            fields[name] = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
    return fields


def _stack(inputs: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    if any(set(i) != set(inputs[0]) for i in inputs):  # a text family's answers of predict (texts) and ask (tokens)
        raise FeedbackError("answers of predict and of ask on texts take their feedback in separate calls or files")
    return {
        name: np.asarray([i[name] for i in inputs], dtype=object)
        if isinstance(inputs[0][name], str)
        else np.stack([i[name] for i in inputs])
        for name in inputs[0]
    }


def _label(value: Any, where: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise FeedbackError(f"{where}label {visible(repr(value))[:80]} is not a number")
    return value


def _id(value: Any, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise FeedbackError(f"{where}{visible(repr(value))[:80]} is not an answer id (the text `predict` gave)")
    return value


class Answers:
    """The recent answers of one agent home and the feedback on them."""

    def __init__(self, home: Path | str, *, keep: int = KEEP_ANSWERS, keep_days: float = KEEP_DAYS):
        self.path = Path(home) / ANSWERS_FILE
        self.keep, self.keep_days = max(int(keep), 0), float(keep_days)
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, home: Path, config) -> Answers:
        """The answers as the agent's settings bound them (``answers_keep``, ``answers_keep_days``)."""
        return cls(home, keep=config.answers_keep, keep_days=config.answers_keep_days)

    def _connect(self) -> sqlite3.Connection:
        """The connection to the answers file (one an object, kept open: opening and closing a write-ahead log
        costs an fsync each), made private (0600) before SQLite writes a byte."""
        if self._db is not None:
            return self._db
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
        db = sqlite3.connect(self.path, isolation_level=None, timeout=30, check_same_thread=False)
        db.execute("PRAGMA secure_delete=ON")  # a dropped input is overwritten, not left in free pages
        db.execute(f"PRAGMA wal_autocheckpoint={WAL_PAGES}")
        db.execute("PRAGMA journal_size_limit=0")  # the log emptied at each checkpoint: old pages do not linger
        if db.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
            db.execute("PRAGMA journal_mode=WAL")  # (its -wal and -shm files take the database's mode)
            db.executescript(SCHEMA)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        self._db = db
        return db

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    @contextlib.contextmanager
    def _transaction(self, *, durable: bool) -> Iterator[sqlite3.Connection]:
        """One transaction, the file locked for writing. Recording answers costs no fsync (``durable=False``: a
        power cut may lose the last answers, never the file); feedback is durable (``synchronous=FULL``), as the
        sample it stores."""
        with self._lock:
            db = self._connect()
            db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _prune(self, db: sqlite3.Connection, now: float) -> None:
        """Drop the inputs older than ``keep_days`` and beyond the newest ``keep``, then the marks beyond the
        newest ``keep``."""
        db.execute(EXPIRE_BY_AGE, (now, now - self.keep_days * DAY))
        db.execute(EXPIRE_BY_COUNT, (now, self.keep))
        db.execute(
            "DELETE FROM answers WHERE state != 'open' AND seq NOT IN "
            "(SELECT seq FROM answers WHERE state != 'open' ORDER BY seq DESC LIMIT ?)",
            (self.keep,),
        )

    def record(self, inputs: dict[str, np.ndarray], labels: list[int], about: dict) -> list[str]:
        """Keep the inputs of a batch of answers (the checked fields, one value per sample; ``about``: the
        adapter, version and model that answered); returns their ids. Of a batch larger than ``keep``, only the
        newest ``keep`` inputs are kept."""
        ids = [new_id() for _ in labels]
        if self.keep == 0 or not ids:
            return ids
        now, first = time.time(), max(len(ids) - self.keep, 0)
        with self._transaction(durable=False) as db:
            db.executemany(
                "INSERT INTO answers (id, at, state, why, closed_at) VALUES (?, ?, 'expired', 'count', ?)",
                [(ids[i], now, now) for i in range(max(first - self.keep, 0), first)],
            )
            db.executemany(
                "INSERT INTO answers (id, at, state, predicted, adapter, version, serving, layout, input) "
                "VALUES (?, ?, 'open', ?, ?, ?, ?, ?, ?)",
                [
                    (
                        ids[i],
                        now,
                        int(labels[i]),
                        about.get("adapter"),
                        about.get("version"),
                        about.get("serving"),
                        *_pack(inputs, i),
                    )
                    for i in range(first, len(ids))
                ],
            )
            self._prune(db, now)
        return ids

    def _refusal(self, row: tuple | None, answer_id: str) -> str | None:
        if row is None and self.keep == 0:
            return f"unknown answer id {visible(answer_id)!r}: the agent keeps no answers (answers_keep is 0)"
        if row is None:
            return (
                f"unknown answer id {visible(answer_id)!r}: not one the agent gave, or its mark is gone too (it keeps "
                f"the last {self.keep} answers of the last {self.keep_days:g} days)"
            )
        state, why, closed_at = row[0], row[1], row[2]
        if state == "open":
            return None
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(closed_at)) if closed_at else "earlier"
        if state == "expired" and why == "age":
            return (
                f"answer {visible(answer_id)!r} expired: its input was dropped ({when}) when it was older than "
                f"{self.keep_days:g} days (answers_keep_days)"
            )
        if state == "expired":
            return (
                f"answer {visible(answer_id)!r} expired: its input was dropped ({when}) to keep only the newest "
                f"{self.keep} answers (answers_keep)"
            )
        return f"answer {visible(answer_id)!r} was already {state} ({when}); each answer takes feedback once"

    def answer(
        self, entries: list[tuple[str, Any]], add: Callable[[dict], int], *, places: list[str] | None = None
    ) -> list[dict]:
        """Apply feedback, ``(id, label)`` each, whole or not at all: every entry's input with its label is handed
        to ``add`` (``Agent.add_samples``) in one batch, then each answer is marked confirmed or corrected and
        counted. Returns per entry ``{"id", "label", "predicted", "outcome"}``; raises ``FeedbackError``, whose
        message names the entry (``places``: where each entry came from, "line 3") when there are several."""
        if not entries:
            raise FeedbackError("no feedback: give an answer id and its label")
        if places is None:
            places = [f"entry {index}: " for index in range(len(entries))] if len(entries) > 1 else [""]
        for (answer_id, label), where in zip(entries, places, strict=True):
            _id(answer_id, where)
            _label(label, where)
        seen: dict[str, str] = {}
        for (answer_id, _), where in zip(entries, places, strict=True):
            if answer_id in seen:
                before = seen[answer_id] or "before"
                raise FeedbackError(f"{where}answer {visible(answer_id)!r} is given twice ({before})")
            seen[answer_id] = where.rstrip(": ")
        now = time.time()
        with self._transaction(durable=True) as db:
            self._prune(db, now)
            rows = []
            for (answer_id, _), where in zip(entries, places, strict=True):
                row = db.execute(
                    "SELECT state, why, closed_at, predicted, adapter, version, serving, layout, input "
                    "FROM answers WHERE id = ?",
                    (answer_id,),
                ).fetchone()
                refused = self._refusal(row, answer_id)
                if refused:
                    raise FeedbackError(f"{where}{refused}")
                rows.append(row)
            inputs = _stack([_unpack(row[7], row[8]) for row in rows])
            labels = [label for _, label in entries]
            try:
                add({**inputs, LABEL: labels})
            except SampleError as error:  # "sample 3: field 'y' is 10.0, outside ...": sample 3 is the 4th entry
                found = re.match(r"sample (\d+): (.*)", str(error), re.S)
                where, why = (places[int(found[1])], found[2]) if found else ("", str(error))
                raise FeedbackError(f"{where}refused by the sample schema, nothing stored: {why}") from None
            outcomes = []
            for (answer_id, label), row in zip(entries, rows, strict=True):
                outcome = "confirmed" if float(label) == row[3] else "corrected"
                db.execute(
                    "UPDATE answers SET state = ?, predicted = NULL, adapter = NULL, version = NULL, serving = NULL, "
                    "layout = NULL, input = NULL, closed_at = ? WHERE id = ?",
                    (outcome, now, answer_id),
                )
                db.execute(COUNT[outcome], (row[4] or "", row[5] or 0, row[6] or ""))
                outcomes.append({"id": answer_id, "label": int(label), "predicted": row[3], "outcome": outcome})
        return outcomes

    def status(self) -> dict:
        """How many answers users confirmed and corrected (in all and per version and served model), the share
        corrected, and how many inputs are kept against the bounds. Reads only; no file is made."""
        counts: list[tuple] = []
        kept = 0
        if self.path.exists():
            reader = sqlite3.connect(self.path, timeout=30)  # (an existing file: nothing is made)
            with closing(reader) as db, contextlib.suppress(sqlite3.OperationalError):  # (no table yet)
                counts = db.execute(
                    "SELECT adapter, version, serving, confirmed, corrected FROM feedback_counts "
                    "ORDER BY adapter, version, serving"
                ).fetchall()
                since = time.time() - self.keep_days * DAY
                (kept,) = db.execute(
                    "SELECT COUNT(*) FROM answers WHERE state = 'open' AND at >= ?", (since,)
                ).fetchone()
        confirmed, corrected = sum(c[3] for c in counts), sum(c[4] for c in counts)
        return {
            "confirmed": confirmed,
            "corrected": corrected,
            "correction_rate": round(corrected / (confirmed + corrected), 4) if confirmed + corrected else None,
            "by_version": [
                {"adapter": a, "version": v, "serving": s, "confirmed": c, "corrected": k} for a, v, s, c, k in counts
            ],
            "answers_kept": min(kept, self.keep),
            "answers_keep": self.keep,
            "answers_keep_days": self.keep_days,
        }

    def open_ids(self, ids: list[str]) -> set[str]:
        """Which of ``ids`` are answers still open (their input kept, no feedback yet). Reads only."""
        if not ids or not self.path.exists():
            return set()
        reader = sqlite3.connect(self.path, timeout=30)  # (an existing file: nothing is made)
        with closing(reader) as db, contextlib.suppress(sqlite3.OperationalError):  # (no table yet)
            since = time.time() - self.keep_days * DAY
            rows = db.execute("SELECT id FROM answers WHERE state = 'open' AND at >= ?", (since,))  # (at most keep)
            return {row[0] for row in rows} & set(ids)
        return set()

    def counts(self, adapter: str) -> dict[int, tuple[int, int]]:
        """Per installed version of ``adapter``: ``(confirmed, corrected)``, every served model's answers together.
        Reads only; no file is made."""
        if not self.path.exists():
            return {}
        reader = sqlite3.connect(self.path, timeout=30)  # (an existing file: nothing is made)
        with closing(reader) as db, contextlib.suppress(sqlite3.OperationalError):  # (no table yet)
            rows = db.execute(
                "SELECT version, SUM(confirmed), SUM(corrected) FROM feedback_counts WHERE adapter = ? "
                "GROUP BY version",
                (adapter,),
            ).fetchall()
            return {int(version): (int(confirmed), int(corrected)) for version, confirmed, corrected in rows}
        return {}


def heartbeat_feedback(answers: Answers, adapters: dict, samples: int, unlabeled: int | None = None) -> dict | None:
    """The heartbeat's ``feedback`` object (docs/protocol/README.md, "Heartbeats") from the answers' counts and
    the adapter store's state (``current``, ``previous``): the installed version's counts and the previous one's,
    when the device ran another version of the same adapter before, the labelled samples held and (when given)
    the unlabeled ones. None before a version is installed."""
    current, previous = adapters.get("current") or {}, adapters.get("previous") or {}
    if not current.get("adapter") or not current.get("version"):
        return None
    counts = answers.counts(current["adapter"])

    def version(number: int) -> dict:
        confirmed, corrected = counts.get(number, (0, 0))
        return {"version": number, "confirmed": confirmed, "corrected": corrected}

    ran_before = previous.get("adapter") == current["adapter"] and previous.get("version") not in (
        None,
        current["version"],
    )
    return {
        "adapter": current["adapter"],
        "current": version(current["version"]),
        "previous": version(previous["version"]) if ran_before else None,
        "feedback_samples": sum(confirmed + corrected for confirmed, corrected in counts.values()),
        "samples": samples,
    } | ({"unlabeled_samples": unlabeled} if unlabeled is not None else {})


# Feedback files in the inbox ----------------------------------------------------------------------------------


def _entry(record: Any, where: str) -> tuple[str, Any]:
    if not isinstance(record, dict) or set(record) != {"id", "label"}:
        raise FeedbackError(f'{where}expected an object {{"id": ..., "label": ...}}')
    return _id(record["id"], where), _label(record["label"], where)


def read_feedback(path: Path) -> tuple[list[tuple[str, Any]], list[str]]:
    """The entries of a feedback file, and where each is in it (``Answers.answer``'s ``places``):
    ``*.feedback.jsonl`` (one ``{"id": ..., "label": ...}`` a line) or ``*.feedback.json`` (a list of them),
    at most ``MAX_FEEDBACK_BYTES``, a regular file (never through a link).
    Whatever is wrong is a ``FeedbackError`` naming the file, the line or entry, and why."""
    path = Path(path)
    name = visible(path.name)
    try:
        with open_regular(path, limit=MAX_FEEDBACK_BYTES, hint="; hand feedback over in several files") as file:
            size = os.fstat(file.fileno()).st_size
            entries, places = [], []
            if path.name.lower().endswith(".jsonl"):
                for number, line in bounded_lines(file, name, size, limit=MAX_FEEDBACK_LINE, each="one entry"):
                    if not line.strip():
                        continue
                    places.append(f"{name}: line {number}: ")
                    try:
                        record = bounded_json.loads(line)
                    except ValueError as error:  # not JSON, not UTF-8, nested too deep
                        raise FeedbackError(f"{places[-1]}cannot be read ({type(error).__name__}: {error})") from None
                    entries.append(_entry(record, places[-1]))
            else:
                text = file.read(MAX_FEEDBACK_BYTES + 1)
                if len(text) > size:
                    raise FeedbackError(f"{name}: grew while it was read; write it under a .part name and rename it")
                records = bounded_json.loads(text)
                if not isinstance(records, list):
                    raise FeedbackError(f'{name}: expected a list of {{"id": ..., "label": ...}} objects')
                places = [f"{name}: entry {index}: " for index in range(len(records))]
                entries = [_entry(record, where) for record, where in zip(records, places, strict=True)]
    except FeedbackError:
        raise
    except SampleError as error:  # not a regular file, too large, a line too long
        raise FeedbackError(str(error)) from None
    except (ValueError, OSError) as error:  # not JSON, not UTF-8, nested too deep
        raise FeedbackError(f"{name}: cannot be read ({type(error).__name__}: {error})") from None
    if not entries:
        raise FeedbackError(f"{name}: holds no feedback")
    return entries, places
