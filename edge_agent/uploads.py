"""The bridge between the outbox and the socket uploader (``edge_agent.connection.UploadSource``): which delta to
send next, the training metrics its ``delta_begin`` may carry, and what the server's verdicts do to the outbox."""

from __future__ import annotations

import json
import logging
import math
import re
import time
from typing import Any

from edge_agent.packaging import Outbox
from edge_agent.protocol import MAX_DELTA_METRICS, METRIC_NAME_PATTERN

logger = logging.getLogger("edge_agent.uploads")
_METRIC_NAME = re.compile(METRIC_NAME_PATTERN)


def upload_metrics(metrics: Any) -> dict:
    """The training metrics a delta_begin may carry (the server refuses the begin otherwise,
    ``malformed_metrics``): finite numbers under names the protocol allows, at most MAX_DELTA_METRICS. A
    training run that ended with a NaN loss still uploads its delta, without that figure."""
    if not isinstance(metrics, dict):
        return {}
    kept = {
        name: value
        for name, value in metrics.items()
        if isinstance(name, str)
        and _METRIC_NAME.fullmatch(name)
        and not isinstance(value, bool)
        and (isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)))
    }
    return dict(list(kept.items())[:MAX_DELTA_METRICS])


class OutboxUploads:
    """The outbox seen by the socket uploader (``edge_agent.connection.UploadSource``)."""

    RECHECK_SENT_SECONDS = 30.0

    def __init__(self, outbox: Outbox):
        self.outbox = outbox
        self.checked: dict[str, float] = {}

    def next_upload(self) -> dict | None:
        """The oldest delta the server does not have yet; else, now and then, one it has but whose verdict
        this agent missed (it was down when the server pushed it): beginning that upload again is
        answered with the delta's current state, never counted twice."""
        pending = self.outbox.pending()
        if pending:
            item = pending[0]
        else:
            now = time.monotonic()
            due = [
                i
                for i in self.outbox.items("sent")
                if now - self.checked.get(i.sha256, -1e9) > self.RECHECK_SENT_SECONDS
            ]
            if not due:
                return None
            item = due[0]
            self.checked[item.sha256] = now
        metrics_path = item.path.with_suffix(".metrics.json")
        return {
            "sha256": item.sha256,
            "path": str(item.path),
            "envelope": item.envelope["envelope"],
            "signature": item.envelope["signature"],
            "metrics": upload_metrics(json.loads(metrics_path.read_text())) if metrics_path.exists() else {},
        }

    def _state_of(self, sha256: str) -> str | None:
        try:
            return self.outbox.get(sha256).state
        except KeyError:
            return None

    def _mark(self, sha256: str, state: str, **fields) -> None:
        try:
            self.outbox.mark(sha256, state, **fields)
        except (KeyError, ValueError) as error:  # already final, or not ours: nothing to change
            logger.debug("outbox %s -> %s ignored: %s", sha256[:12], state, error)

    def on_state(self, sha256: str, state: dict) -> None:
        server_state = state.get("state")
        if server_state == "uploading":
            self._mark(sha256, "uploading", bytes_acknowledged=int(state.get("offset", 0)))
        elif server_state == "received":
            before = self._state_of(sha256)
            self._mark(sha256, "sent", bytes_acknowledged=int(state.get("size", 0)))
            if before != "sent":  # said once, not again for a repeated begin's answer
                logger.info("delta %s received by the server (id %s)", sha256[:12], state.get("delta_id"))
        elif server_state in ("accepted", "aggregated"):
            self._mark(sha256, "accepted")
        elif server_state == "rejected":
            self._mark(sha256, "rejected", detail=f"{state.get('rejection_code')}: {state.get('rejection_detail')}")
        elif server_state == "aborted":  # the server holds none of it now: the next begin starts from 0
            self._mark(sha256, "queued", bytes_acknowledged=0)

    # Refusals at begin that sending the same signed delta again can never get past: the delta is dropped.
    FINAL_REFUSALS = frozenset({"wrong_device", "malformed_envelope", "bad_signature", "bad_created_at", "too_large"})

    def on_error(self, sha256: str, code: str, message: str) -> None:
        logger.warning("upload of %s refused: %s: %s", sha256[:12], code, message)
        if code in self.FINAL_REFUSALS:
            if code == "bad_created_at":
                logger.warning(
                    "delta %s dropped: its signed created_at is outside the server's window (is this device's clock "
                    "right?): %s",
                    sha256[:12],
                    message,
                )
            self._mark(sha256, "rejected", detail=f"{code}: {message}")

    def on_result(self, result: dict) -> None:
        sha256 = str(result.get("sha256", ""))
        if result.get("state") == "rejected":
            logger.warning("delta %s rejected: %s: %s", sha256[:12], result.get("code"), result.get("detail"))
            self._mark(sha256, "rejected", detail=f"{result.get('code')}: {result.get('detail')}")
        elif result.get("state") in ("accepted", "aggregated"):
            logger.info("delta %s accepted", sha256[:12])
            self._mark(sha256, "accepted")
