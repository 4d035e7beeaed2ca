"""What the agent socket hands to the training side (``devices.socket_hooks``): the assignment at check-in
and the delta upload steps, each answered with the message the socket sends back."""

from __future__ import annotations

from edge_agent.protocol import MessageType
from training.federation.intake import UploadRefused, upload_append, upload_begin
from training.rollouts.delivery import assignment_message, current_assignment
from training.rollouts.joining import assignment_at_check_in


def _answer(step) -> tuple[str, dict]:
    try:
        state = step()
    except UploadRefused as exc:
        return MessageType.DELTA_ERROR, {"code": exc.code, "message": exc.message}
    return MessageType.DELTA_STATE, state.body()


class TrainingSocketEntry:
    def check_in(self, device) -> dict | None:
        """Join a rollout in progress (or the last completed one) the device is not part of yet; else the
        newest assignment it has not installed yet, as the message it should receive."""
        if assignment_at_check_in(device=device) is not None:
            return None  # pushed to the socket by ``deliver`` once it is committed
        assignment = current_assignment(device.pk)
        return assignment_message(assignment) if assignment is not None else None

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
