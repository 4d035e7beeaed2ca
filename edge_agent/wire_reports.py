"""What a heartbeat reports beside the device's state (``edge_agent.wire.HeartbeatState``): the device's
measurement of its own model against the shared version (``Personal``), and what its users said of its answers
(``Feedback``, per installed version ``VersionFeedback``). Part of the protocol's typed definitions: the
documents in ``docs/protocol/`` are generated from these models as from the rest of ``edge_agent.wire``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from edge_agent.protocol import PERSONALIZATION_METHODS
from edge_agent.wire_types import AdapterName, EpochSeconds, Number, Positive, _Message


class Personal(_Message):
    """The device's latest measurement of its own model against the shared version, both on local samples that
    neither was trained on (the bundled agent holds out every 10th sample it collects for this)."""

    adapter: AdapterName
    version: Positive = Field(description="the shared version installed and measured")
    method: Literal[PERSONALIZATION_METHODS]  # type: ignore[valid-type]
    serving: Literal["personal", "shared"]
    shared_accuracy: Annotated[Number, Field(ge=0, le=1)]
    personal_accuracy: Annotated[Number, Field(ge=0, le=1)]
    val_samples: Annotated[int, Field(ge=0, le=10**9, description="how many held-out samples both were measured on")]
    trained_samples: Annotated[int, Field(ge=0, le=10**9, description="the last personal pass's training slice")]
    shared_only_right: Annotated[int, Field(ge=0, le=10**9)] | None = Field(
        default=None, description="distinct held samples the shared version gets right and the personal model wrong"
    )
    personal_only_right: Annotated[int, Field(ge=0, le=10**9)] | None = Field(
        default=None, description="distinct held samples the personal model gets right and the shared version wrong"
    )
    updated_at: EpochSeconds = Field(description="when it was measured; at most a day ahead of the server's clock")


MAX_COUNT = 10**9  # answers or samples a heartbeat counts: far above what a device keeps, far below 2**53
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]


class VersionFeedback(_Message):
    """The answers of one installed version that the device's users confirmed and corrected, whichever model
    (personal or shared) gave them; each answer takes feedback once."""

    version: Positive = Field(description="the shared version installed when the answers were given")
    confirmed: Count = Field(description="answers a user gave the predicted label: right")
    corrected: Count = Field(description="answers a user gave another label: wrong")


class Feedback(_Message):
    """What the device's users said of its answers (``edge_agent.feedback``): counts since each version was
    installed, never the answers or their inputs, which stay on the device."""

    adapter: AdapterName
    current: VersionFeedback = Field(description="the version installed now")
    previous: VersionFeedback | None = Field(
        default=None, description="the version it ran before the current one, if any (a different version)"
    )
    feedback_samples: Count = Field(description="labelled samples stored from feedback on the adapter's answers")
    samples: Count = Field(description="labelled samples the device holds, of every origin")
    unlabeled_samples: Count | None = Field(
        default=None, description="unlabeled samples the device holds (absent from agents before them: none reported)"
    )
