"""The device's identity on disk: its Ed25519 key (mode 0600) and what enrollment told it.

Layout of the agent home (default ``~/.fleet-agent``, or ``--home`` / ``FLEET_AGENT_HOME``):
    device_key.pem   the private key, 0600, written atomically
    agent.json       device id, server URL, the pinned server public key, cohort, heartbeat interval
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_agent.protocol import b64encode

KEY_FILE = "device_key.pem"
STATE_FILE = "agent.json"


def default_home() -> Path:
    return Path(os.environ.get("FLEET_AGENT_HOME") or Path.home() / ".fleet-agent")


def atomic_write(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Write, fsync, rename: after a power loss the file is either the old one or the new one, whole."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def load_or_create_key(home: Path) -> Ed25519PrivateKey:
    path = home / KEY_FILE
    if path.exists():
        if path.stat().st_mode & 0o077:
            raise PermissionError(f"{path} is readable by others; fix with: chmod 600 {path}")
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path} does not hold an Ed25519 key")
        return key
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    atomic_write(path, pem, mode=0o600)
    return key


def public_key_b64(key: Ed25519PrivateKey) -> str:
    return b64encode(key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


@dataclass
class AgentState:
    server: str
    device_id: str
    server_public_key: str
    cohort: str
    status: str
    websocket_path: str
    heartbeat_interval: int

    def save(self, home: Path) -> None:
        atomic_write(home / STATE_FILE, json.dumps(asdict(self), indent=2).encode(), mode=0o600)

    @classmethod
    def load(cls, home: Path) -> AgentState:
        path = home / STATE_FILE
        if not path.exists():
            raise FileNotFoundError(f"not enrolled: {path} is missing; run `edge-agent enroll --server URL --token T`")
        return cls(**json.loads(path.read_text()))
