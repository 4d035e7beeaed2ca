"""The agent <-> server wire protocol, defined once here and imported by the server.

The specification is ``docs/protocol/README.md``; every message is a typed model in ``edge_agent/wire.py``.
Messages are JSON objects with a ``type``. Binary values (nonces, keys, signatures) are base64url without
padding; hashes are lowercase hex. Everything signed is the canonical form of an object that names its
purpose, so a signature made for one purpose can never be replayed as another.

The canonical form is RFC 8785 (JSON Canonicalization Scheme) from protocol 2 on: the form every language's
JCS library writes, numbers included (``8.0`` is written ``8``). Protocol 1 signed Python's
``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)``, which writes ``8.0`` and ``1e-05``;
for an object of whole numbers and ASCII text the two forms are the same bytes. The server still accepts
protocol 1 until ``PROTOCOL_1_ACCEPTED_UNTIL`` (docs/protocol/README.md, "Versions").
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Callable
from typing import Any

import rfc8785
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from edge_agent import bounded_json

PROTOCOL_VERSION = 2
SUPPORTED_PROTOCOLS = (1, 2)  # what this code can verify; the server may stop accepting 1 (its sunset setting)
# How a device personalizes (the manifest's signed ``personalization.method``; a heartbeat's ``personal.method``).
PERSONALIZATION_METHODS = ("none", "finetune", "ditto", "private_modules")
# The manifest's ``personalization`` object with every setting at its default: what the server signs for an adapter
# that sets none (``training.registry.personalization_settings``) and what the agent assumes for a setting a
# manifest leaves out (``edge_agent.personal.PersonalSettings``; a manifest without the object means "none").
PERSONALIZATION_DEFAULTS: dict[str, Any] = {
    "method": "ditto",
    # ditto's proximal weight: 1.0 held devices whose sensor or names differ near a shared version that misreads
    # them, 5 to 20 points below a plain local fine-tune (bench/README.md, "fleet_learning.py")
    "lambda": 0.1,
    "private_modules": ["head"],  # the modules that stay on the device under "private_modules"
    "epochs": 50,  # the personal pass at most: it stops early on validation loss (edge_agent/personal.py, PATIENCE)
    "lr": 0.01,
    "margin": 0.01,  # accuracy the personal model must gain over the shared one before the device serves it
    "min_val_samples": 10,  # held-out local samples needed before the device judges between them
    # ditto: the classifier rows of the classes the device's own labels rename are its own, free of the pull and
    # never uploaded (bench/README.md, "personalization.py")
    "release_classes": True,
    # "pseudo_label": the personal pass also trains on unlabeled samples that the model trained on the labelled ones
    # is at least ``confidence`` sure of (edge_agent/pseudo_labels.py). Off by default: with 10% of the digits
    # fleet's samples labelled it lowered the served model by 1.9 points (bench/README.md, "unlabeled.py")
    "unlabeled": "none",
    "confidence": 0.95,
}
AGENT_WS_PATH = "/ws/agent/"

# Limits the server enforces; the agent keeps to them.
MAX_MESSAGE_BYTES_BEFORE_AUTH = 4 * 1024
MAX_MESSAGE_BYTES = 64 * 1024
HELLO_TIMEOUT_SECONDS = 10
# Raw bytes per delta_chunk: base64 makes 60,000 characters, inside MAX_MESSAGE_BYTES with the JSON around.
DELTA_CHUNK_BYTES = 45_000
# A delta chunk may also travel as a binary frame (``encode_chunk_frame``): the raw bytes after a short
# header, no base64 and no JSON around them, so a 300 KiB delta is one frame instead of seven (each frame is
# a stop-and-wait round trip and a step on the server; 512 KiB keeps a resend after a dropped link short).
DELTA_BINARY_CHUNK_BYTES = 512 * 1024
CHUNK_FRAME_MAGIC = b"FPD1"
MAX_CHUNK_FRAME_HEADER = 256
CHUNK_FRAME_HEADER_FIELDS = frozenset({"sha256", "offset"})  # wire.ChunkFrameHeader's; any other is refused
MAX_BINARY_MESSAGE_BYTES = DELTA_BINARY_CHUNK_BYTES + len(CHUNK_FRAME_MAGIC) + 2 + MAX_CHUNK_FRAME_HEADER
# delta_begin's metrics: at most this many entries, each a name matching METRIC_NAME_PATTERN and a finite number.
MAX_DELTA_METRICS = 32
METRIC_NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_.:-]{0,63}"


class MessageType:
    CHALLENGE = "challenge"  # server -> agent, first message: {nonce, protocol, server_time}
    HELLO = "hello"  # agent -> server: {device_id, signature, agent_version, hardware}
    WELCOME = "welcome"  # server -> agent: {device_id, status, heartbeat_interval, server_time}
    HEARTBEAT = "heartbeat"  # agent -> server: {seq, battery, charging, free_memory_mb, metrics}
    HEARTBEAT_ACK = "heartbeat_ack"  # server -> agent: {seq, server_time}
    COMMAND = "command"  # server -> agent: {id, command, args}
    ACK = "ack"  # agent -> server: {id, ok, detail}
    ERROR = "error"  # server -> agent, before a close: {code, message}
    DELTA_BEGIN = "delta_begin"  # agent -> server: {envelope, signature, metrics}
    DELTA_CHUNK = "delta_chunk"  # agent -> server: {sha256, offset, data (base64url, <= DELTA_CHUNK_BYTES)},
    # or a binary frame: see encode_chunk_frame
    DELTA_STATE = "delta_state"  # server -> agent: {sha256, size, offset, delta_id, state, rejection_code, ...}
    DELTA_ERROR = "delta_error"  # server -> agent: {sha256, code, message, retry_after}; the socket stays open
    DELTA_ABORT = "delta_abort"  # agent -> server: {sha256}; answered with delta_state "aborted"


class CloseCode:
    """WebSocket close codes (4000-4999 are the application's own)."""

    MALFORMED = 4400  # not JSON, not an object, unknown type, missing or bad fields
    AUTH_FAILED = 4401  # unknown device or a signature that does not verify
    NOT_ALLOWED = 4403  # pending approval, quarantined or retired
    HELLO_TIMEOUT = 4408  # no hello within HELLO_TIMEOUT_SECONDS
    REPLACED = 4409  # the same device connected again elsewhere; the older socket is closed
    TOO_LARGE = 4413  # a message above the size limit
    UPGRADE_REQUIRED = 4426  # a protocol version the server no longer accepts
    TOO_CHATTY = 4429  # heartbeats far more often than the interval, again and again
    SERVER_RESTART = 1012  # the server is restarting: reconnect with backoff

    # Codes after which reconnecting as-is cannot succeed until something changes on the server.
    WAIT_FOR_OPERATOR = frozenset({NOT_ALLOWED, UPGRADE_REQUIRED})


def b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64decode(text: str, *, limit: int = 4096) -> bytes:
    if not isinstance(text, str) or len(text) > limit:
        raise ValueError("not a base64 string")
    padded = text + "=" * (-len(text) % 4)
    try:
        return base64.b64decode(padded.encode("ascii"), altchars=b"-_", validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise ValueError("not a base64 string") from exc


def canonical_json(payload: dict[str, Any], *, protocol: int = PROTOCOL_VERSION) -> bytes:
    """The bytes that are signed: RFC 8785 from protocol 2 on (ValueError for what it cannot represent exactly:
    NaN, infinities, whole numbers beyond 2**53), protocol 1's sorted compact JSON before."""
    if protocol >= 2:
        try:
            return rfc8785.dumps(payload)
        except rfc8785.CanonicalizationError as exc:
            raise ValueError(f"not canonicalizable (RFC 8785): {exc}") from None
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def hello_payload(*, nonce: str, device_id: str, protocol: int = PROTOCOL_VERSION) -> dict[str, Any]:
    """What a device signs to answer a WebSocket challenge."""
    return {"purpose": "agent-hello", "nonce": nonce, "device_id": device_id, "protocol": protocol}


def token_request_payload(*, nonce: str, device_id: str, protocol: int = PROTOCOL_VERSION) -> dict[str, Any]:
    """What a device signs to exchange a REST challenge for a short-lived API token."""
    return {"purpose": "device-token", "nonce": nonce, "device_id": device_id, "protocol": protocol}


def sign(private_key: Ed25519PrivateKey, payload: dict[str, Any], *, protocol: int = PROTOCOL_VERSION) -> str:
    return b64encode(private_key.sign(canonical_json(payload, protocol=protocol)))


def public_key_from_b64(text: str) -> Ed25519PublicKey:
    raw = b64decode(text)
    if len(raw) != 32:
        raise ValueError("an Ed25519 public key is 32 bytes")
    return Ed25519PublicKey.from_public_bytes(raw)


def verify(
    public_key: Ed25519PublicKey,
    payload: dict[str, Any],
    signature: str,
    *,
    protocols: tuple[int, ...] = SUPPORTED_PROTOCOLS,
) -> bool:
    """Whether ``signature`` is over ``payload``'s canonical form of one of ``protocols`` (newest tried first).
    Accepting either form is safe: both are one JSON text of the same object, so bytes signed in one form
    cannot mean another object in the other."""
    try:
        raw = b64decode(signature)
    except ValueError:
        return False
    if len(raw) != 64:
        return False
    tried: set[bytes] = set()
    for protocol in sorted(protocols, reverse=True):
        try:
            data = canonical_json(payload, protocol=protocol)
        except ValueError:
            continue
        if data in tried:
            continue
        tried.add(data)
        try:
            public_key.verify(raw, data)
        except InvalidSignature:
            continue
        return True
    return False


def encode(message_type: str, **fields: Any) -> str:
    return json.dumps({"type": message_type, **fields}, separators=(",", ":"), allow_nan=False)


def decode(text: str | bytes, *, limit: int, loads: Callable[[str], Any] = bounded_json.loads) -> dict[str, Any]:
    """Parse one message; raises ValueError with a short reason for anything malformed. ``loads`` parses the
    text once its size is known to be within ``limit`` (the agent's and the server's bound how deeply it nests);
    a ValueError it raises, other than not-JSON, reaches the caller with its own reason."""
    if isinstance(text, bytes):
        raise ValueError("binary frames are not accepted here")
    # Limits count UTF-8 bytes, as they travel (a character may take four); a lone surrogate counts as three.
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise OverflowError(f"message of {size} bytes exceeds the {limit}-byte limit")
    try:
        message = loads(text)
    except json.JSONDecodeError:
        raise ValueError("not valid JSON") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ValueError("a message must be a JSON object with a string 'type'")
    return message


def encode_chunk_frame(*, sha256: str, offset: int, data: bytes) -> bytes:
    """A ``delta_chunk`` as one binary frame: ``FPD1``, a 2-byte big-endian header length, the header
    (compact JSON ``{"offset": n, "sha256": "..."}``), then the raw bytes."""
    header = json.dumps({"offset": offset, "sha256": sha256}, separators=(",", ":"), sort_keys=True).encode()
    return CHUNK_FRAME_MAGIC + struct.pack(">H", len(header)) + header + data


def decode_chunk_frame(
    frame: bytes, *, limit: int = MAX_BINARY_MESSAGE_BYTES, loads: Callable[[bytes], Any] = bounded_json.loads
) -> tuple[str, int, bytes]:
    """``(sha256, offset, data)`` of a binary chunk frame; ValueError (OverflowError past ``limit``) otherwise.
    ``loads`` parses the header, as ``decode``'s parses a message."""
    if len(frame) > limit:
        raise OverflowError(f"binary message of {len(frame)} bytes exceeds the {limit}-byte limit")
    start = len(CHUNK_FRAME_MAGIC) + 2
    if len(frame) < start or frame[: len(CHUNK_FRAME_MAGIC)] != CHUNK_FRAME_MAGIC:
        raise ValueError("a binary frame must be a delta chunk (FPD1 header)")
    (header_size,) = struct.unpack(">H", frame[len(CHUNK_FRAME_MAGIC) : start])
    if header_size > MAX_CHUNK_FRAME_HEADER or len(frame) < start + header_size:
        raise ValueError("the binary chunk's header is too long or cut short")
    try:
        header = loads(frame[start : start + header_size])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("the binary chunk's header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ValueError("the binary chunk's header must be a JSON object")
    unlisted = sorted(set(header) - CHUNK_FRAME_HEADER_FIELDS)
    if unlisted:
        raise ValueError(f"the binary chunk's header has fields the protocol does not list: {unlisted}")
    sha256, offset = header.get("sha256"), header.get("offset")
    if not isinstance(sha256, str) or len(sha256) != 64 or not isinstance(offset, int) or isinstance(offset, bool):
        raise ValueError("the binary chunk's header needs sha256 (64 hex characters) and an integer offset")
    if offset < 0:
        raise ValueError("the binary chunk's offset must not be negative")
    data = frame[start + header_size :]
    if len(data) > DELTA_BINARY_CHUNK_BYTES:
        raise OverflowError(f"a binary chunk of {len(data)} bytes exceeds the {DELTA_BINARY_CHUNK_BYTES}-byte limit")
    return sha256, offset, data
