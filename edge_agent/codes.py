"""Every code the server sends a device, with what it means and what the device should do about it.

``docs/protocol/reference.md`` is generated from this table (``python -m fleet.protocol_docs``), and
``tests/protocol/test_documents.py`` fails when the server's code uses a code this table does not list.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a device does about a code, in the words the specification uses.
RETRY = "retry"  # the same request again, with backoff
FIX = "fix"  # the request is wrong: change it before sending again; a repeat is refused the same way
WAIT = "wait"  # wait (retry_after, or the slowest backoff) and try again
GIVE_UP = "give up"  # this delta or manifest is done with: drop it
REENROLL = "re-enroll"  # the device's identity is no longer usable: enroll again (new key, new token)
STOP = "stop"  # the device is retired: stop syncing
UPGRADE = "upgrade"  # the agent must speak a newer protocol


@dataclass(frozen=True)
class Code:
    code: str
    where: str  # how it reaches the device
    meaning: str
    action: str
    detail: str = ""  # the action in words, when the one word is not enough


_SOCKET_CLOSE = "socket error + close"
_DELTA_ERROR = "delta_error (REST: the error body)"
_REJECTION = "delta_state.rejection_code / delta_result.code"
_REST = "REST error body"
_MANIFEST = "the agent's own refusal (reported in the assignment report's reason)"

CODES: tuple[Code, ...] = (
    # --- the socket ---
    Code(
        "malformed",
        _SOCKET_CLOSE + " 4400",
        "a frame that is not JSON, not an object, nested deeper than 64 levels, of an unknown type, or "
        "with a field the message's schema refuses (the message names it)",
        FIX,
        "fix the message; reconnect with backoff",
    ),
    Code(
        "too_large",
        _SOCKET_CLOSE + " 4413",
        "a frame above the limit (4 KiB before the hello, 64 KiB after, "
        "binary chunk frames 512 KiB + header), counted in UTF-8 bytes",
        FIX,
    ),
    Code(
        "auth_failed",
        _SOCKET_CLOSE + " 4401 / REST 401",
        "unknown device, or a signature that does not verify with its enrolled key",
        REENROLL,
        "retry with backoff once (a clock or key-file problem); if it persists, the "
        "device's key is not the enrolled one: enroll again",
    ),
    Code("hello_timeout", _SOCKET_CLOSE + " 4408", "no hello within 10 s of the challenge", RETRY),
    Code(
        "protocol_unsupported",
        _SOCKET_CLOSE + " 4426 / REST 403",
        "the hello or token request names a protocol the server no longer accepts",
        UPGRADE,
    ),
    Code(
        "too_chatty",
        _SOCKET_CLOSE + " 4429",
        "HEARTBEAT_EARLY_LIMIT heartbeats in a row came sooner than half the interval",
        FIX,
        "send heartbeats every heartbeat_interval (± 10 %); reconnect with backoff",
    ),
    Code(
        "device_pending",
        _SOCKET_CLOSE + " 4403 / REST 403",
        "an operator has not approved the device yet",
        WAIT,
        "reconnect at the slowest backoff until approved",
    ),
    Code(
        "device_quarantined",
        _SOCKET_CLOSE + " 4403 / REST 403",
        "an operator quarantined the device",
        WAIT,
        "reconnect at the slowest backoff; an operator may release it",
    ),
    Code("device_retired", _SOCKET_CLOSE + " 4403 / REST 403", "an operator retired the device", STOP),
    Code(
        "closed_by_server",
        _SOCKET_CLOSE + " (4409 or 1012)",
        "a newer socket of the same device replaced this one (4409), or the server is restarting (1012)",
        RETRY,
    ),
    # --- REST device authentication ---
    Code(
        "nonce_invalid",
        _REST + " 401",
        "a REST challenge nonce that is unknown, expired, used, or another device's",
        RETRY,
        "ask for a new challenge",
    ),
    Code("token_expired", _REST + " 401", "the device token has expired", RETRY, "exchange a new challenge"),
    # --- assignments ---
    Code(
        "assignment_superseded",
        _REST + " 409",
        "a report (delivered, installed, failed) on an assignment that a newer assignment, or the end of its "
        "rollout, withdrew while the device worked on it: an expected race, nothing was recorded",
        GIVE_UP,
        "drop that assignment (do not install it, or keep what was installed); the newer assignment, if any, follows",
    ),
    # --- delta uploads, at the door ---
    Code(
        "malformed_envelope",
        _DELTA_ERROR,
        "the envelope or its signature does not fit the schema (the message names the field)",
        FIX,
    ),
    Code("malformed_metrics", _DELTA_ERROR, "delta_begin's metrics do not fit their schema", FIX),
    Code("wrong_device", _DELTA_ERROR, "the envelope names another device", FIX),
    Code(
        "bad_signature",
        _DELTA_ERROR + "; also " + _REJECTION,
        "the envelope's signature does not verify with the device's key",
        GIVE_UP,
        "sign the envelope again (canonical form of the protocol in use); a delta whose "
        "signature is refused is dropped",
    ),
    Code(
        "bad_created_at",
        _DELTA_ERROR,
        "created_at is outside the window around the server's clock",
        GIVE_UP,
        "check the device clock; a delta older than the window is dropped",
    ),
    Code(
        "too_many_uploads",
        _DELTA_ERROR,
        "the device has MAX_STAGED_PER_DEVICE unfinished uploads",
        WAIT,
        "finish or abort (delta_abort) one of them",
    ),
    Code(
        "too_many_begins",
        _DELTA_ERROR,
        "more than DELTA_BEGINS_PER_MINUTE delta_begin from this device",
        WAIT,
        "wait retry_after seconds",
    ),
    Code(
        "too_many_rejections",
        _DELTA_ERROR,
        "DELTA_REJECTIONS_PER_HOUR of this device's deltas were rejected in the last hour",
        WAIT,
        "wait retry_after seconds; find out why they were rejected",
    ),
    Code(
        "unknown_upload",
        _DELTA_ERROR,
        "a chunk or abort for an upload that was never begun (or is finished and gone)",
        FIX,
        "begin it again: the answer says where it stands",
    ),
    Code(
        "wrong_offset",
        _DELTA_ERROR,
        "a chunk that does not start at the offset the server holds",
        RETRY,
        "continue from the offset in the message (or begin again to be told it)",
    ),
    # --- delta verification (rejection codes; in the order the checks run) ---
    Code(
        "too_large",
        _DELTA_ERROR + "; also " + _REJECTION,
        "the declared size is over DELTA_MAX_BYTES (refused at "
        "the door), or more bytes than the envelope declares arrived (stored as a rejection)",
        GIVE_UP,
    ),
    Code(
        "hash_mismatch",
        _REJECTION,
        "the bytes are not the signed sha256 and size",
        RETRY,
        "upload the same file again: nothing was counted",
    ),
    Code("device_not_active", _REJECTION, "the device was not active when the delta was verified", GIVE_UP),
    Code("unknown_adapter", _REJECTION, "the envelope names no adapter the server has", GIVE_UP),
    Code("wrong_cohort", _REJECTION, "the device's cohort does not train this adapter", GIVE_UP),
    Code(
        "replayed_counter",
        _REJECTION,
        "another delta of this device used this counter",
        GIVE_UP,
        "counters are used once: never sign two deltas with one counter",
    ),
    Code("unknown_base_version", _REJECTION, "the base version does not exist or was revoked", GIVE_UP),
    Code(
        "stale_base_version",
        _REJECTION,
        "the base version is more than the adapter's max_staleness released versions behind the newest released one",
        GIVE_UP,
        "train on the newest version you are assigned",
    ),
    Code("header_too_large", _REJECTION, "the safetensors header is above its limit", GIVE_UP),
    Code("malformed", _REJECTION, "the safetensors framing or header, or the encoding's metadata, is broken", GIVE_UP),
    Code("duplicate_tensor", _REJECTION + "; also " + _MANIFEST, "the header names a tensor twice", GIVE_UP),
    Code("spec_mismatch", _REJECTION, "tensor names, shapes or dtypes differ from the adapter's spec", GIVE_UP),
    Code("not_finite", _REJECTION, "a value is NaN or infinite", GIVE_UP),
    Code("norm_too_large", _REJECTION, "the delta's L2 norm is above the adapter's bound", GIVE_UP),
    Code(
        "verification_failed",
        _REJECTION,
        "the server could not finish verifying it (not the device's fault; the counter is not used up)",
        GIVE_UP,
        "drop it; train and send a new delta",
    ),
    # --- manifests, refused by the agent itself ---
    Code("unsigned", _MANIFEST, "the manifest carries no signature", GIVE_UP),
    Code("bad_key_rotation", _MANIFEST, "the key rotation chain is broken", GIVE_UP),
    Code("expired", _MANIFEST, "expires_at has passed", GIVE_UP),
    Code("wrong_base_model", _MANIFEST, "the manifest is for another base model", GIVE_UP),
    Code("stale_sequence", _MANIFEST, "assignment_seq is not above the last accepted", GIVE_UP),
    Code("size_mismatch", _MANIFEST, "the downloaded file's size is not the manifest's", RETRY, "download again"),
)


def codes_by_name() -> dict[str, list[Code]]:
    found: dict[str, list[Code]] = {}
    for code in CODES:
        found.setdefault(code.code, []).append(code)
    return found
