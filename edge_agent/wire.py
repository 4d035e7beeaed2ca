"""Every message of the device protocol as a typed model: the one definition the server validates what it
receives with, the agent builds what it sends with, and the generated documents come from (JSON Schema and
AsyncAPI in ``docs/protocol/``, written by ``manage.py protocol_docs``; the specification a team implements
from is ``docs/protocol/README.md``).

pydantic v2 rather than msgspec: its JSON Schema output (2020-12, with every bound and description) is what
the documents are generated from, and its errors name the field's path, which the server sends back to a
client that got a message wrong. Strict mode throughout: ``true`` is not a number, ``1.0`` is not a whole
number and ``"1"`` is neither, as a client in any language would expect of a contract.

The value types (hashes, keys, ids, times, metrics) and the models' bases are in ``edge_agent.wire_types``; what a
heartbeat reports of the device's own model and of its users' feedback is in ``edge_agent.wire_reports``.
Transport messages ignore fields they do not define (a newer peer may add some); the signed objects a device
makes (the hello, the token request, the delta envelope) refuse any field they do not define, since every byte of
them is signed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)

from edge_agent.protocol import (
    DELTA_CHUNK_BYTES,
    PERSONALIZATION_DEFAULTS,
    PERSONALIZATION_METHODS,
    PROTOCOL_VERSION,
    SUPPORTED_PROTOCOLS,
    MessageType,
)
from edge_agent.pseudo_labels import UNLABELED_METHODS
from edge_agent.wire_reports import Feedback, Personal
from edge_agent.wire_types import (
    MAX_CLASSES,
    MAX_SAFE_INTEGER,
    AdapterName,
    DeviceId,
    EpochSeconds,
    Metrics,
    Nonce,
    Number,
    Positive,
    PublicKey,
    Sha256Hex,
    Signature,
    Whole,
    _Message,
    _Signed,
)

# --- signed objects -------------------------------------------------------------------------------------------


class HelloPayload(_Signed):
    """What a device signs to answer the socket's challenge (never sent itself: the server rebuilds it)."""

    purpose: Literal["agent-hello"] = "agent-hello"
    nonce: Nonce
    device_id: DeviceId
    protocol: Literal[1, 2] = Field(description="the protocol the device speaks; it selects the canonical form")


class TokenPayload(_Signed):
    """What a device signs to exchange a REST challenge for a short-lived token."""

    purpose: Literal["device-token"] = "device-token"
    nonce: Nonce
    device_id: DeviceId
    protocol: Literal[1, 2]


class DeltaEnvelope(_Signed):
    """What a device signs for each delta it uploads."""

    purpose: Literal["delta-upload"] = "delta-upload"
    device_id: DeviceId
    adapter: AdapterName
    base_version: Positive = Field(description="the number of the shared version the delta was trained from")
    sha256: Sha256Hex = Field(description="sha256 of the whole delta file")
    size: Annotated[int, Field(ge=1, le=MAX_SAFE_INTEGER, description="the delta file's size in bytes")]
    num_samples: Positive = Field(description="how many samples the device trained on")
    counter: Whole = Field(description="unused by this device before (each counter counts once)")
    created_at: Annotated[
        float,
        Field(
            ge=0,
            allow_inf_nan=False,
            description="when the delta was made, epoch seconds; within the server's window of its own clock "
            "(DELTA_CREATED_AT_MAX_AGE_SECONDS before, DELTA_CREATED_AT_MAX_AHEAD_SECONDS after) or bad_created_at",
        ),
    ]


# --- socket: agent -> server ----------------------------------------------------------------------------------


class Hello(_Message):
    type: Literal["hello"] = "hello"
    device_id: DeviceId
    signature: Signature = Field(description="over the canonical form of HelloPayload")
    protocol: Literal[1, 2] = Field(
        default=1, description="the protocol the signature was made for (absent: 1, the only one before 2)"
    )
    agent_version: Annotated[str, StringConstraints(max_length=32)] = ""
    hardware: Annotated[dict[str, str | int | float | bool | None], Field(max_length=16)] = Field(default_factory=dict)


class HeartbeatState(_Message):
    """A heartbeat's fields: ``POST /api/v1/device/heartbeat/``'s body, and the socket's heartbeat with its type."""

    seq: Whole = Field(description="counts up from 1 on each connection; echoed by heartbeat_ack")

    battery: Annotated[Number, Field(ge=0, le=100)] | None = Field(default=None, description="percent, or null")
    charging: bool | None = None
    free_memory_mb: Annotated[int, Field(ge=0, le=MAX_SAFE_INTEGER)] | None = Field(
        default=None, description="MiB, or null"
    )
    metrics: Annotated[dict[Annotated[str, StringConstraints(max_length=64)], Number], Field(max_length=32)] = Field(
        default_factory=dict, description="at most 32 named finite numbers (names up to 64 characters)"
    )
    personal: Personal | None = None
    feedback: Feedback | None = Field(default=None, description="absent from agents before it: none reported")


class Heartbeat(HeartbeatState):
    type: Literal["heartbeat"] = "heartbeat"


class Ack(_Message):
    type: Literal["ack"] = "ack"
    id: Annotated[str, StringConstraints(max_length=64)] = Field(description="the command's id")
    ok: bool
    detail: Annotated[str, StringConstraints(max_length=500)] | None = None


class DeltaBegin(_Message):
    type: Literal["delta_begin"] = "delta_begin"
    envelope: DeltaEnvelope
    signature: Signature = Field(description="over the canonical form of the envelope")
    metrics: Metrics = Field(default_factory=dict)


# An upload is named by the sha256 its delta_begin declared; a chunk or abort naming anything else is answered
# ``unknown_upload`` (a delta_error: the socket stays), as a name that was never begun is.
UploadName = Annotated[
    str, StringConstraints(max_length=256), Field(description="the sha256 the upload's delta_begin declared")
]


class DeltaChunk(_Message):
    type: Literal["delta_chunk"] = "delta_chunk"
    sha256: UploadName
    offset: Whole = Field(description="where these bytes go: exactly the offset the server last answered")
    data: Annotated[
        str,
        StringConstraints(pattern=r"^[A-Za-z0-9_-]*$", max_length=(DELTA_CHUNK_BYTES * 4 + 2) // 3),
        Field(description=f"at most {DELTA_CHUNK_BYTES} bytes of the file as base64url without padding"),
    ]


class DeltaAbort(_Message):
    type: Literal["delta_abort"] = "delta_abort"
    sha256: UploadName


class ChunkFrameHeader(_Signed):
    """The JSON header of a binary chunk frame (``FPD1``, 2-byte big-endian length, this header, the bytes)."""

    offset: Whole
    sha256: Sha256Hex


AgentMessage = Annotated[Hello | Heartbeat | Ack | DeltaBegin | DeltaChunk | DeltaAbort, Field(discriminator="type")]


# --- socket: server -> agent ----------------------------------------------------------------------------------


class Challenge(_Message):
    type: Literal["challenge"] = "challenge"
    nonce: Nonce
    protocol: int = Field(description="the newest protocol the server speaks")
    protocols: list[int] = Field(
        default_factory=lambda: list(SUPPORTED_PROTOCOLS), description="every protocol the server accepts"
    )
    server_time: EpochSeconds


class Welcome(_Message):
    type: Literal["welcome"] = "welcome"
    device_id: DeviceId
    status: Literal["active"]
    cohort: str
    heartbeat_interval: Annotated[int, Field(ge=1, description="seconds between heartbeats")]
    protocol: Literal[1, 2] = Field(default=PROTOCOL_VERSION, description="the protocol of this session")
    server_time: EpochSeconds


class HeartbeatAck(_Message):
    type: Literal["heartbeat_ack"] = "heartbeat_ack"
    seq: Whole
    server_time: EpochSeconds
    recorded: bool = Field(
        default=True, description="false when the heartbeat came sooner than half the interval and was not recorded"
    )


class PersonalizationSetting(_Message):
    method: Literal[PERSONALIZATION_METHODS]  # type: ignore[valid-type]
    lambda_: Annotated[Number, Field(gt=0, alias="lambda")] = Field(alias="lambda")
    private_modules: list[str]
    epochs: Annotated[int, Field(ge=1, le=100)]
    lr: Annotated[Number, Field(gt=0)]
    margin: Annotated[Number, Field(ge=0, le=1)]
    min_val_samples: Annotated[int, Field(ge=0, le=10000)]
    release_classes: bool
    unlabeled: Literal[UNLABELED_METHODS] = Field(  # type: ignore[valid-type]
        default=PERSONALIZATION_DEFAULTS["unlabeled"],
        description="what the personal model learns from unlabeled samples: pseudo_label (what the model trained on "
        "the labelled ones is at least `confidence` sure of) or none. Absent (servers before it): the default",
    )
    confidence: Annotated[Number, Field(gt=0, le=1)] = PERSONALIZATION_DEFAULTS["confidence"]

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, populate_by_name=True)


class TrainingConfig(_Message):
    """How to build and train the adapter, and how this version scored on the server's evaluation set; signed with
    the manifest."""

    family: str
    family_config: dict[str, Any]
    rank: Positive
    alpha: Number
    dropout: Annotated[Number, Field(ge=0, lt=1)]
    target_modules: list[str]
    modules_to_save: list[str]
    ffa: bool
    personalization: PersonalizationSetting
    max_norm: Annotated[Number, Field(gt=0)] | None = Field(
        default=None,
        description="the adapter's bound on a delta's L2 norm (norm_too_large); the agent clips its update a little "
        "below it. Absent from servers before it was sent: no bound known",
    )
    proximal_mu: Annotated[Number, Field(ge=0, le=100)] = Field(
        default=0.0,
        description="FedProx: the shared pass adds mu/2 times the squared distance of the adapter from where it "
        "started (the installed version) to its loss; 0: plain training. Absent (servers before it): 0",
    )
    class_accuracy: list[Annotated[Number, Field(ge=0, le=1)] | None] | None = Field(
        default=None,
        max_length=MAX_CLASSES,
        description="this version's accuracy on each class of the server's evaluation set (index: the label; null: "
        "no sample of it). A device too small to judge versions on its own samples weighs it by its labels. "
        "Absent: the adapter has no evaluation set",
    )


class Manifest(_Message):
    """What the server signs for each assignment: the version a device should run."""

    purpose: Literal["adapter-manifest"] = "adapter-manifest"
    device_id: DeviceId
    adapter: AdapterName
    version: Positive
    sha256: Sha256Hex = Field(description="sha256 of the adapter file")
    size: Annotated[int, Field(ge=1, le=MAX_SAFE_INTEGER)]
    base_model_sha256: Sha256Hex
    assignment_seq: Positive = Field(description="above every earlier manifest's for this device")
    issued_at: EpochSeconds
    expires_at: EpochSeconds
    training: TrainingConfig | None = None


class KeyRotationStatement(_Message):
    purpose: Literal["server-key-rotation"] = "server-key-rotation"
    seq: Positive
    old_public_key: PublicKey
    new_public_key: PublicKey
    issued_at: EpochSeconds


class KeyRotationLink(_Message):
    statement: KeyRotationStatement
    signature: Signature = Field(description="by the old key")
    new_signature: Signature = Field(description="by the new key")


class ManifestEnvelope(_Message):
    manifest: Manifest
    signature: Signature = Field(description="by the server key, over the manifest's canonical form")
    key_rotations: list[KeyRotationLink] = Field(default_factory=list, description="oldest first; absent: none")


class BlobRef(_Message):
    sha256: Sha256Hex
    size: Annotated[int, Field(ge=1, le=MAX_SAFE_INTEGER)]
    download_path: str


class AssignmentMessage(_Message):
    """The ``assignment`` command's args, and ``GET /api/v1/device/assignment/``'s body."""

    assignment_id: Positive
    envelope: ManifestEnvelope
    download_path: str
    base_model: BlobRef


class DeltaResult(_Message):
    """The ``delta_result`` command's args: the verification outcome of one delta."""

    sha256: Sha256Hex
    delta_id: Positive
    state: Literal["accepted", "rejected", "aggregated"]
    code: str = Field(description="the rejection code; empty when accepted")
    detail: str


class AssignmentCommand(_Message):
    type: Literal["command"] = "command"
    id: str = Field(description="assignment-<assignment_id>: the same id every time it is sent")
    command: Literal["assignment"]
    args: AssignmentMessage


class DeltaResultCommand(_Message):
    type: Literal["command"] = "command"
    id: str = Field(description="delta-<delta_id>: the same id every time it is sent")
    command: Literal["delta_result"]
    args: DeltaResult


class Error(_Message):
    type: Literal["error"] = "error"
    code: str
    message: str


class DeltaState(_Message):
    type: Literal["delta_state"] = "delta_state"
    sha256: Sha256Hex
    size: Annotated[int, Field(ge=0, le=MAX_SAFE_INTEGER)]
    offset: Whole = Field(description="the bytes the server holds: continue from here")
    delta_id: Positive | None
    state: Literal["uploading", "received", "accepted", "rejected", "aggregated", "aborted"]
    rejection_code: str
    rejection_detail: str


class DeltaError(_Message):
    type: Literal["delta_error"] = "delta_error"
    sha256: str | None
    code: str
    message: str
    retry_after: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="seconds to wait before the next delta_begin (rate limits only)"
    )


# --- REST payloads of devices ---------------------------------------------------------------------------------


class EnrollRequest(_Message):
    token: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    public_key: PublicKey
    name: Annotated[str, StringConstraints(min_length=1, max_length=100)]  # the server requires a name
    hardware: dict[str, Any] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    agent_version: Annotated[str, StringConstraints(max_length=32)] = ""


class EnrollResponse(_Message):
    device_id: DeviceId
    status: Literal["active", "pending"]
    cohort: str
    server_public_key: PublicKey
    websocket_path: str
    heartbeat_interval: Annotated[int, Field(ge=1)]


class DeviceChallengeRequest(_Message):
    device_id: DeviceId


class DeviceChallenge(_Message):
    nonce: Nonce
    expires_in: Annotated[int, Field(ge=1, description="seconds")]


class DeviceTokenRequest(_Message):
    device_id: DeviceId
    nonce: Nonce
    signature: Signature = Field(description="over the canonical form of TokenPayload")
    protocol: Literal[1, 2] = 1


class DeviceToken(_Message):
    token: str
    expires_in: Annotated[int, Field(ge=1, description="seconds")]


class AssignmentReport(_Message):
    status: Literal["delivered", "installed", "failed"]
    reason: Annotated[str, StringConstraints(max_length=300)] = ""
    metrics: Annotated[dict[str, Number], Field(max_length=32)] = Field(default_factory=dict)


ServerCommand = Annotated[AssignmentCommand | DeltaResultCommand, Field(discriminator="command")]

SOCKET_AGENT_MESSAGES: tuple[type[_Message], ...] = (Hello, Heartbeat, Ack, DeltaBegin, DeltaChunk, DeltaAbort)
SOCKET_SERVER_MESSAGES: tuple[type[_Message], ...] = (
    Challenge,
    Welcome,
    HeartbeatAck,
    AssignmentCommand,
    DeltaResultCommand,
    DeltaState,
    DeltaError,
    Error,
)
SIGNED_OBJECTS: tuple[type[BaseModel], ...] = (
    HelloPayload,
    TokenPayload,
    DeltaEnvelope,
    Manifest,
    KeyRotationStatement,
)
REST_PAYLOADS: tuple[type[_Message], ...] = (
    EnrollRequest,
    EnrollResponse,
    DeviceChallengeRequest,
    DeviceChallenge,
    DeviceTokenRequest,
    DeviceToken,
    HeartbeatState,
    AssignmentReport,
    AssignmentMessage,
)
OTHER_OBJECTS: tuple[type[BaseModel], ...] = (ManifestEnvelope, KeyRotationLink, DeltaResult, ChunkFrameHeader)

_AGENT_MESSAGE = TypeAdapter(AgentMessage)
_AGENT_TYPES = {model.model_fields["type"].default for model in SOCKET_AGENT_MESSAGES}
assert {MessageType.HELLO, MessageType.DELTA_ABORT} <= _AGENT_TYPES


def problem(exc: ValidationError, *, what: str = "", skip: int = 0) -> str:
    """The first thing wrong with a message, as ``what.path.to.field: what is wrong`` (the path's first ``skip``
    parts left out: a union's tag), for the peer that sent it."""
    error = exc.errors(include_url=False)[0]
    where = ".".join([*([what] if what else []), *(str(part) for part in error["loc"][skip:])])
    return f"{where}: {error['msg']}" if where else error["msg"]


def agent_message(message: dict) -> _Message:
    """A decoded message from an agent as its model; ValueError naming the bad field (and the type, when it
    is not one an agent sends)."""
    kind = message.get("type")
    if kind not in _AGENT_TYPES:
        raise ValueError(f"unknown message type {kind!r}")
    try:
        return _AGENT_MESSAGE.validate_python(message)
    except ValidationError as exc:
        raise ValueError(problem(exc, what=kind, skip=1)) from None


_SERVER_COMMAND = TypeAdapter(ServerCommand)
_SERVER_TYPES = {
    model.model_fields["type"].default: model for model in SOCKET_SERVER_MESSAGES if model is not DeltaResultCommand
}


def server_message(message: dict) -> _Message:
    """A decoded message from the server as its model; ValueError naming the bad field (or an unknown type or
    command: an agent older than the server meets those, and ignores them)."""
    kind = message.get("type")
    if kind not in _SERVER_TYPES:
        raise ValueError(f"unknown message type {kind!r}")
    try:
        if kind == MessageType.COMMAND:
            return _SERVER_COMMAND.validate_python(message)
        return _SERVER_TYPES[kind].model_validate(message)
    except ValidationError as exc:
        raise ValueError(problem(exc, what=kind, skip=1 if kind == MessageType.COMMAND else 0)) from None


def validated(model: type[BaseModel], value: Any, *, what: str = "") -> BaseModel:
    """``value`` as ``model``; ValueError naming the bad field."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise ValueError(problem(exc, what=what)) from None
