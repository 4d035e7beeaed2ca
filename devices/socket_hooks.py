"""The agent socket's one entry point into the training side.

``devices`` sits below the training side (docs/architecture.md): the socket (``devices.consumers``) knows
devices, presence and the wire protocol, while the assignment a device receives when it checks in, the delta
uploads it sends and what its users' feedback means for a rollout belong to training. Training registers its
handlers here when Django starts (``training.apps``), so no module of ``devices`` imports ``training``.

Each upload handler returns the message to send back as ``(type, fields)``: ``delta_state`` with where the
upload stands, or ``delta_error`` with the refusal's code and message (docs/protocol/README.md, "Delta uploads").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from devices.models import Device


class TrainingSide(Protocol):
    def check_in(self, device: Device) -> dict | None:
        """The assignment message a device that just said hello should receive now, or None."""

    def upload_begin(self, device: Device, message: dict) -> tuple[str, dict]:
        """A ``delta_begin`` message: begin (or resume) the upload its signed envelope names."""

    def upload_append(self, device: Device, sha256: str, offset: int, data: bytes) -> tuple[str, dict]:
        """One chunk of an upload at ``offset``."""

    def upload_abort(self, device: Device, sha256: str) -> tuple[str, dict]:
        """A ``delta_abort`` message: discard the unfinished upload of ``sha256``, freeing its slot."""

    def unacknowledged_results(self, device: Device) -> list[dict]:
        """``{id, command, args}`` of the ``delta_result`` commands to send again after a hello."""

    def command_acknowledged(self, device: Device, command_id: str) -> bool:
        """An ``ack`` with ok=true of ``command_id``: the device has it (delta results, assignments)."""

    def feedback_reported(self, device: Device, feedback: dict) -> None:
        """Changed feedback counts of a heartbeat (``devices.feedback``), the device's row locked: the rollout
        guard metrics of the version it runs."""


_training: TrainingSide | None = None


def register_training_side(side: TrainingSide) -> None:
    global _training
    _training = side


def training_side() -> TrainingSide:
    if _training is None:
        raise RuntimeError("the training app is not installed: nothing handles assignments and uploads")
    return _training
