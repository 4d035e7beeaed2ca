"""The server's Ed25519 identity: devices pin its public key at enrollment and verify what it signs.

The key comes from ``SERVER_SIGNING_KEY`` (or ``SERVER_SIGNING_KEY_FILE``): a PEM private key or a
base64url 32-byte seed. Without it, a key file is created once in the data folder (mode 0600) and reused;
every process of one deployment must see the same data folder or the same variable.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from edge_agent.protocol import b64decode, b64encode
from fleet.env import env_secret


def _load_from_text(text: str) -> Ed25519PrivateKey:
    text = text.strip()
    if text.startswith("-----BEGIN"):
        key = serialization.load_pem_private_key(text.encode(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ImproperlyConfigured("SERVER_SIGNING_KEY must be an Ed25519 private key")
        return key
    try:
        seed = b64decode(text)
    except ValueError:
        seed = b""
    if len(seed) != 32:
        raise ImproperlyConfigured("SERVER_SIGNING_KEY must be a PEM Ed25519 key or a base64url 32-byte seed")
    return Ed25519PrivateKey.from_private_bytes(seed)


def _load_or_create_file(path: Path) -> Ed25519PrivateKey:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(pem)
            handle.flush()
            os.fsync(handle.fileno())
        try:  # link() never replaces: when processes start at once, exactly one complete key wins
            os.link(temporary, path)
        except FileExistsError:
            pass
        finally:
            temporary.unlink()
    return _load_from_text(path.read_text())


@cache
def server_private_key() -> Ed25519PrivateKey:
    configured = env_secret("SERVER_SIGNING_KEY")
    if configured:
        return _load_from_text(configured)
    return _load_or_create_file(Path(settings.DATA_DIR) / "server_signing_key.pem")


def server_public_key_b64() -> str:
    raw = server_private_key().public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return b64encode(raw)
