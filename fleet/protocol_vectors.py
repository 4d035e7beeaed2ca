"""Test vectors of the device protocol, as libsodium and Noise publish theirs: fixed keys and inputs, and every
byte the protocol derives from them, so a team writing a client in another language can check each step.

Written to ``docs/protocol/vectors/`` by ``python -m fleet.protocol_docs`` and recomputed by
``tests/protocol/test_documents.py`` (a vector that no longer matches the code fails the test). Every input is
fixed: Ed25519 signatures are deterministic, and the delta files are the product's own canonical safetensors.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from safetensors.torch import load

from edge_agent import wire
from edge_agent.delta import decode_tensor, encode_delta, envelope_payload, read_encoding
from edge_agent.protocol import (
    b64encode,
    canonical_json,
    encode_chunk_frame,
    hello_payload,
    sign,
    token_request_payload,
)
from edge_agent.safetensors_header import loads_noting_repeats

DEVICE_ID = "6f1c2b9e-8d4a-4e3b-9c1f-2a7b5d0e8f13"
NONCE = b64encode(bytes(range(32)))
CREATED_AT = 1764040000.25
ISSUED_AT = 1764040000.125
LORA_A = "base_model.model.fc1.lora_A.weight"
LORA_B = "base_model.model.fc1.lora_B.weight"


def _key(label: str) -> Ed25519PrivateKey:
    """A fixed key: its 32-byte seed is sha256 of the label (published below, so anyone can rebuild it)."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(label.encode()).digest())


def _public(key: Ed25519PrivateKey) -> str:
    return b64encode(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))


KEYS = {label: _key(label) for label in ("fleet vector: device", "fleet vector: server 1", "fleet vector: server 2")}


def _keys() -> dict:
    return {
        label: {
            "seed_hex": hashlib.sha256(label.encode()).hexdigest(),
            "seed_is": f"sha256 of the ASCII text {label!r}",
            "public_key": _public(key),
        }
        for label, key in KEYS.items()
    }


def _signed(key: Ed25519PrivateKey, payload: dict, protocol: int) -> dict:
    return {
        "canonical": canonical_json(payload, protocol=protocol).decode(),
        "signature": sign(key, payload, protocol=protocol),
    }


# Numbers and text on which the two canonical forms differ (or agree): what a client's JCS library must do.
CANONICAL_CASES: tuple[Any, ...] = (
    {"b": 1, "a": 2, "é": 3, "z": 4},
    {"alpha": 8.0, "dropout": 0.05, "lr": 1e-05, "lambda": 0.1},
    {"big": 1e21, "max_safe_integer": 9007199254740991, "negative_zero": -0.0, "third": 1 / 3},
    {"text": 'line\nbreak "quoted" \u00e9 \u2028 \U0001f600', "control": "\u0001"},
    {"created_at": 1764040000.0, "nested": {"y": [3, 2.5, True, None], "x": {}}},
)


def _canonical() -> dict:
    return {
        "about": "value: the object; protocol_2: its RFC 8785 bytes (UTF-8); protocol_1: the form protocol 1 signed",
        "cases": [
            {
                "value": case,
                "protocol_2": canonical_json(case, protocol=2).decode(),
                "protocol_1": canonical_json(case, protocol=1).decode(),
            }
            for case in CANONICAL_CASES
        ],
    }


def _hello() -> dict:
    device = KEYS["fleet vector: device"]
    challenge = wire.Challenge(nonce=NONCE, protocol=2, protocols=[1, 2], server_time=ISSUED_AT)
    payload = wire.HelloPayload(nonce=NONCE, device_id=DEVICE_ID, protocol=2).to_dict()
    assert payload == hello_payload(nonce=NONCE, device_id=DEVICE_ID)
    signed = _signed(device, payload, 2)
    hello = wire.Hello(device_id=DEVICE_ID, signature=signed["signature"], protocol=2, agent_version="1.0.0")
    legacy = hello_payload(nonce=NONCE, device_id=DEVICE_ID, protocol=1)
    return {
        "device_key": "fleet vector: device",
        "challenge": json.loads(challenge.to_json()),
        "payload": payload,
        **signed,
        "hello": json.loads(hello.to_json()),
        "protocol_1": {"payload": legacy, **_signed(device, legacy, 1)},
    }


def _token() -> dict:
    device = KEYS["fleet vector: device"]
    payload = token_request_payload(nonce=NONCE, device_id=DEVICE_ID)
    wire.validated(wire.TokenPayload, payload)
    signed = _signed(device, payload, 2)
    request = wire.DeviceTokenRequest(device_id=DEVICE_ID, nonce=NONCE, signature=signed["signature"], protocol=2)
    return {"device_key": "fleet vector: device", "payload": payload, **signed, "request": request.to_dict()}


def _manifest() -> dict:
    old, new = KEYS["fleet vector: server 1"], KEYS["fleet vector: server 2"]
    statement = wire.KeyRotationStatement(
        seq=1, old_public_key=_public(old), new_public_key=_public(new), issued_at=1764000000
    ).to_dict()
    link = {"statement": statement, "signature": sign(old, statement), "new_signature": sign(new, statement)}
    manifest = wire.Manifest(
        device_id=DEVICE_ID,
        adapter="digits-lora",
        version=3,
        sha256=hashlib.sha256(b"adapter file").hexdigest(),
        size=12,
        base_model_sha256=hashlib.sha256(b"base weights").hexdigest(),
        assignment_seq=7,
        issued_at=ISSUED_AT,
        expires_at=ISSUED_AT + 7 * 86400,
        training={
            "family": "digits-cnn",
            "family_config": {},
            "rank": 4,
            "alpha": 8.0,
            "dropout": 0.05,
            "target_modules": ["conv2", "fc1"],
            "modules_to_save": ["fc2"],
            "ffa": False,
            "personalization": {
                "method": "ditto",
                "lambda": 0.1,
                "private_modules": [],
                "epochs": 2,
                "lr": 0.05,
                "margin": 0.0,
                "min_val_samples": 10,
                "release_classes": True,
            },
            "class_accuracy": [0.972222, 1.0, 0.5, None, 0.333333],
        },
    ).to_dict()
    signed = _signed(new, manifest, 2)
    envelope = {"manifest": manifest, "signature": signed["signature"], "key_rotations": [link]}
    wire.validated(wire.ManifestEnvelope, envelope)
    return {
        "pinned_key": "fleet vector: server 1 (the key the device pinned at enrollment)",
        "signing_key": "fleet vector: server 2 (reached through key_rotations)",
        "rotation_statement_canonical": canonical_json(statement).decode(),
        "manifest": manifest,
        **signed,
        "envelope": envelope,
        "protocol_1": _signed(new, manifest, 1),
    }


def _tensors(*, ffa: bool) -> dict[str, torch.Tensor]:
    a = torch.tensor([[0.5, -0.25, 0.125, 0.0], [-1.0, 0.75, 0.0625, 0.3]], dtype=torch.float32)
    b = torch.tensor([[0.01, -0.02], [0.5, 0.25], [-0.125, 1.0], [0.0, -0.75]], dtype=torch.float32)
    return {LORA_B: b} if ffa else {LORA_A: a, LORA_B: b}


DELTAS = (("delta-f32.safetensors", "f32", False), ("delta-f16.safetensors", "f16", False),
          ("delta-int8.safetensors", "int8", False), ("delta-ffa-f32.safetensors", "f32", True))  # fmt: skip


def _delta_files() -> dict[str, bytes]:
    return {name: encode_delta(_tensors(ffa=ffa), encoding=encoding) for name, encoding, ffa in DELTAS}


def _deltas(files: dict[str, bytes]) -> dict:
    device = KEYS["fleet vector: device"]
    out = []
    for counter, (name, encoding, ffa) in enumerate(DELTAS, start=1):
        data = files[name]
        header, _ = loads_noting_repeats(data[8 : 8 + int.from_bytes(data[:8], "little")].decode())
        _, scales = read_encoding(header.get("__metadata__"))
        decoded = {
            key: decode_tensor(raw, encoding=encoding, scale=scales.get(key)).tolist()
            for key, raw in sorted(load(data).items())  # safetensors loads in no fixed order
        }
        envelope = envelope_payload(
            device_id=DEVICE_ID,
            adapter="digits-lora",
            base_version=3,
            sha256=hashlib.sha256(data).hexdigest(),
            size=len(data),
            num_samples=40,
            counter=counter,
            created_at=CREATED_AT,
        )
        wire.validated(wire.DeltaEnvelope, envelope)
        signed = _signed(device, envelope, 2)
        begin = wire.DeltaBegin(envelope=envelope, signature=signed["signature"], metrics={"loss": 0.42, "epochs": 1})
        out.append(
            {
                "file": name,
                "encoding": encoding,
                "ffa": ffa,
                "sha256": envelope["sha256"],
                "size": len(data),
                "header": header,
                "decoded_values": decoded,
                "envelope": envelope,
                **signed,
                "delta_begin": json.loads(begin.to_json()),
                "chunk_frame_hex": encode_chunk_frame(sha256=envelope["sha256"], offset=0, data=data[:64]).hex(),
                "chunk_frame_is": "the first 64 bytes of the file at offset 0, as a binary frame",
            }
        )
    return {"device_key": "fleet vector: device", "deltas": out}


_ORDER_8_Y = ("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
              "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a")  # fmt: skip
_SIGN_BIT = 0x80  # the top bit of the last byte: the sign of x

# 32-byte encodings a server refuses as a device's public key, each with the point (or non-point) it is and the
# reason (devices.ed25519_points): the eight points of small order (the identity among them), the encodings
# of y = 0 and y = 1 with y + p, x = 0 with its sign bit set, all ones, and a y with no x on the curve.
WEAK_KEYS: tuple[tuple[str, str, str], ...] = (
    ("01" + "00" * 31, "the identity point (0, 1), order 1", "small_order"),
    ("ec" + "ff" * 30 + "7f", "(0, -1), order 2", "small_order"),
    ("00" * 32, "all zero: y = 0, x the even square root of -1: order 4", "small_order"),
    ("00" * 31 + "80", "y = 0, x the odd square root of -1: order 4", "small_order"),
    (_ORDER_8_Y[0], "y = y8, x even: order 8", "small_order"),
    (_ORDER_8_Y[0][:-2] + f"{int(_ORDER_8_Y[0][-2:], 16) | _SIGN_BIT:02x}", "y = y8, x odd: order 8", "small_order"),
    (_ORDER_8_Y[1], "y = -y8, x even: order 8", "small_order"),
    (_ORDER_8_Y[1][:-2] + f"{int(_ORDER_8_Y[1][-2:], 16) | _SIGN_BIT:02x}", "y = -y8, x odd: order 8", "small_order"),
    ("ed" + "ff" * 30 + "7f", "y = p: y = 0 written as y + p", "non_canonical"),
    ("ed" + "ff" * 31, "y = p with the sign bit set", "non_canonical"),
    ("ee" + "ff" * 30 + "7f", "y = p + 1: the identity written as y + p", "non_canonical"),
    ("ee" + "ff" * 31, "y = p + 1 with the sign bit set", "non_canonical"),
    ("ff" * 32, "all ones: y = 2^255 - 1 = p + 18", "non_canonical"),
    ("01" + "00" * 30 + "80", "the identity with the sign bit set (x = 0 has no negative)", "non_canonical"),
    ("02" + "00" * 31, "y = 2: no x puts it on the curve", "not_on_curve"),
)


def _weak_keys() -> dict:
    return {
        "about": "public keys enrollment refuses with 400 invalid_public_key; error.details.reason says why "
        "(RFC 8032 section 5.1.3 decoding, then [8]P is the identity for a point of small order)",
        "keys": [
            {"hex": hex_key, "public_key": b64encode(bytes.fromhex(hex_key)), "is": what, "reason": reason}
            for hex_key, what, reason in WEAK_KEYS
        ],
        "accepted": {"public_key": _public(KEYS["fleet vector: device"]), "is": "fleet vector: device"},
    }


def vector_files() -> dict[str, bytes]:
    """Every vector file's name and bytes."""
    files = _delta_files()
    documents = {
        "keys.json": _keys(),
        "canonical.json": _canonical(),
        "hello.json": _hello(),
        "token.json": _token(),
        "manifest.json": _manifest(),
        "deltas.json": _deltas(files),
        "weak-keys.json": _weak_keys(),
    }
    out = {name: (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode() for name, doc in documents.items()}
    return {**out, **files}
