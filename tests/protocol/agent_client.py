"""Our edge agent's protocol functions behind the conformance suite's ``Client`` interface: our own agent must
pass the same suite as any other client."""

from __future__ import annotations

import time
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from conformance.client import Client, Tensors
from edge_agent.delta import encode_delta, sign_delta
from edge_agent.identity import public_key_b64
from edge_agent.manifest import trusted_server_key, verify_manifest
from edge_agent.protocol import PROTOCOL_VERSION, encode_chunk_frame, hello_payload, sign, token_request_payload


class AgentClient(Client):
    def __init__(self, key: Ed25519PrivateKey | None = None):
        self.key = key or Ed25519PrivateKey.generate()

    def public_key(self) -> str:
        return public_key_b64(self.key)

    def sign(self, payload: dict[str, Any]) -> str:
        return sign(self.key, payload)

    def hello(self, *, nonce: str, device_id: str) -> dict[str, Any]:
        signature = sign(self.key, hello_payload(nonce=nonce, device_id=device_id))
        return {
            "type": "hello",
            "device_id": device_id,
            "signature": signature,
            "protocol": PROTOCOL_VERSION,
            "agent_version": "edge-agent",
            "hardware": {},
        }

    def token_request(self, *, nonce: str, device_id: str) -> dict[str, Any]:
        signature = sign(self.key, token_request_payload(nonce=nonce, device_id=device_id))
        return {"device_id": device_id, "nonce": nonce, "signature": signature, "protocol": PROTOCOL_VERSION}

    def build_delta(self, tensors: Tensors) -> bytes:
        return encode_delta(
            {
                name: torch.tensor(values, dtype=torch.float32).reshape(shape)
                for name, (shape, values) in tensors.items()
            }
        )

    def delta_upload(self, data: bytes, **fields: Any) -> dict[str, Any]:
        return sign_delta(self.key, data, **fields)

    def chunk_frame(self, *, sha256: str, offset: int, data: bytes) -> bytes:
        return encode_chunk_frame(sha256=sha256, offset=offset, data=data)

    def verify_manifest(self, envelope: dict[str, Any], *, pinned_key: str) -> dict[str, Any]:
        manifest = envelope["manifest"]
        return verify_manifest(
            envelope,
            server_public_key=trusted_server_key(envelope, pinned_key),
            device_id=manifest.get("device_id"),
            base_model_sha256=manifest.get("base_model_sha256"),
            last_accepted_seq=0,
            now=time.time(),
        )
