"""What the agent socket hands to the training side (``devices.socket_hooks``): the assignment and the unread
delta results at check-in, the delta upload steps, each answered with the message the socket sends back, and
the device's acknowledgements of the commands it was sent, and its users' feedback counts (rollout guard
metrics)."""

from __future__ import annotations

import re
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from edge_agent.protocol import MessageType
from training.federation.events import delta_result_command
from training.federation.intake import UploadRefused, upload_abort, upload_append, upload_begin
from training.models import Assignment, Delta
from training.rollouts.delivery import assignment_message, current_assignment
from training.rollouts.feedback import assignment_feedback_record
from training.rollouts.joining import assignment_at_check_in

# The stable ids of the commands a device acknowledges: ``delta-<id>`` (delta_result), ``assignment-<id>``.
_COMMAND_ID = re.compile(r"(delta|assignment)-([0-9]{1,18})")
RESULTS_PER_HELLO = 32


def _answer(step) -> tuple[str, dict]:
    try:
        state = step()
    except UploadRefused as exc:
        fields = {"code": exc.code, "message": exc.message}
        if "retry_after" in exc.details:
            fields["retry_after"] = exc.details["retry_after"]
        return MessageType.DELTA_ERROR, fields
    return MessageType.DELTA_STATE, state.body()


class TrainingSocketEntry:
    def check_in(self, device) -> dict | None:
        """Join a rollout in progress (or the last completed one) the device is not part of yet; else the
        newest assignment it has not installed nor acknowledged yet, as the message it should receive."""
        if assignment_at_check_in(device=device) is not None:
            return None  # pushed to the socket by ``deliver`` once it is committed
        assignment = current_assignment(device.pk, unacknowledged=True)
        return assignment_message(assignment) if assignment is not None else None

    def unacknowledged_results(self, device) -> list[dict]:
        """The ``delta_result`` commands the device has not acknowledged (it was offline when its deltas were
        verified, or the push was lost): received in the last DELTA_RESULT_RESEND_DAYS, oldest first, at most
        RESULTS_PER_HELLO per hello (the rest follow at the next ones, as these are acknowledged)."""
        since = timezone.now() - timedelta(days=settings.DELTA_RESULT_RESEND_DAYS)
        deltas = Delta.objects.filter(
            device=device,
            state__in=(Delta.State.ACCEPTED, Delta.State.REJECTED, Delta.State.AGGREGATED),
            result_acked_at__isnull=True,
            received_at__gte=since,
        ).order_by("received_at", "id")[:RESULTS_PER_HELLO]
        return [delta_result_command(delta) for delta in deltas]

    def command_acknowledged(self, device, command_id: str) -> bool:
        """The device acknowledged (ok) the command ``command_id``: a ``delta_result`` is not sent again, nor
        is an assignment at the next hello. Only this device's own rows; anything else is ignored."""
        match = _COMMAND_ID.fullmatch(command_id)
        if match is None:
            return False
        kind, pk = match.group(1), int(match.group(2))
        if kind == "delta":
            rows = Delta.objects.filter(pk=pk, device=device, result_acked_at__isnull=True)
            return bool(rows.update(result_acked_at=timezone.now()))
        rows = Assignment.objects.filter(pk=pk, device=device, acked_at__isnull=True)
        return bool(rows.update(acked_at=timezone.now()))

    def upload_begin(self, device, message: dict) -> tuple[str, dict]:
        return _answer(
            lambda: upload_begin(
                device=device,
                envelope=message.get("envelope"),
                signature=message.get("signature"),
                channel="ws",
                metrics=message.get("metrics"),
            )
        )

    def upload_append(self, device, sha256: str, offset: int, data: bytes) -> tuple[str, dict]:
        return _answer(lambda: upload_append(device=device, sha256=sha256, offset=offset, data=data, channel="ws"))

    def upload_abort(self, device, sha256: str) -> tuple[str, dict]:
        return _answer(lambda: upload_abort(device=device, sha256=sha256))

    def feedback_reported(self, device, feedback: dict) -> None:
        """Changed feedback counts: the correction metrics of the rollout assignment that installed the version
        (``training.rollouts.feedback``), which its guards read at the next tick."""
        assignment_feedback_record(device=device, feedback=feedback)
