"""The server's Ed25519 identity: devices pin its public key at enrollment and verify what it signs.

The key comes from ``SERVER_SIGNING_KEY`` (or ``SERVER_SIGNING_KEY_FILE``): a PEM private key or a
base64url 32-byte seed. Without it, a key file is created once in the data folder (mode 0600) and reused;
every process of one deployment must see the same data folder or the same variable. Creating it is safe when
many processes and threads ask at once (a fresh ``make run`` enrolls its demo devices in parallel): each writes
a complete key to a temporary file of its own and links it into place, link() never replaces an existing file,
so exactly one key wins and every caller reads that one, never a half-written file.

Rotation (``manage.py rotate_signing_key``, README "Rotating the server's signing key"): a statement naming the
old and the new public key, signed by both, is stored as a ``ServerKeyRotation``; every manifest the server
signs carries the chain of statements that leads to the key that signed it, so a device that pinned an older
key follows it link by link and trusts the new key only because the key it already trusted said so.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from core.env import env_secret
from edge_agent.manifest import ROTATION_PURPOSE
from edge_agent.protocol import b64decode, b64encode, sign

logger = logging.getLogger(__name__)
KEY_FILE_NAME = "server_signing_key.pem"
NEXT_KEY_FILE_NAME = "server_signing_key.next.pem"
_CHAIN_TTL_SECONDS = 30.0
_chains: dict[str, tuple[float, list[dict]]] = {}
_key_lock = threading.Lock()  # one thread of a process loads (or creates) the key; the others wait for it
_key: Ed25519PrivateKey | None = None


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


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def write_private_file(path: Path, data: bytes) -> Path:
    """Write ``data`` to a new 0600 file beside ``path`` (fsynced) and return that temporary path.

    The name is this call's own (process, thread and a random part) and the file is created exclusively, so
    concurrent callers never write into, link or delete each other's file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    unique = f"{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(8)}"
    temporary = path.with_name(f".{path.name}.{unique}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return temporary


def _sync_folder(folder: Path) -> None:
    """Make a new name in ``folder`` durable (a key that devices pin must not vanish in a power cut)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_or_create_file(path: Path) -> Ed25519PrivateKey:
    """The key in ``path``, created first if there is none. Safe to call from many threads and processes at
    once: every caller gets the same key, whichever caller's link() won."""
    if not path.exists():
        temporary = write_private_file(path, private_key_pem(Ed25519PrivateKey.generate()))
        try:  # link() never replaces: a complete key appears under the name at once, and only one does
            os.link(temporary, path)
            _sync_folder(path.parent)
        except FileExistsError:
            pass  # another process or thread won: its key is the one
        finally:
            temporary.unlink()
    try:
        return _load_from_text(path.read_text())
    except (ImproperlyConfigured, ValueError) as exc:
        raise ImproperlyConfigured(
            f"the server signing key file {path} is not a complete Ed25519 key ({exc}); devices pinned the key it "
            "held, so restore it from a backup rather than deleting it"
        ) from None


def load_private_key(text: str) -> Ed25519PrivateKey:
    """A key as ``SERVER_SIGNING_KEY`` takes it (PEM or base64url seed); ImproperlyConfigured otherwise."""
    return _load_from_text(text)


def key_file() -> Path | None:
    """The data-folder key file the server signs with, or None when the key comes from the environment."""
    return None if env_secret("SERVER_SIGNING_KEY") else Path(settings.DATA_DIR) / KEY_FILE_NAME


def server_private_key() -> Ed25519PrivateKey:
    """The key this process signs with, loaded (or created) once per process, by one thread only."""
    global _key
    key = _key
    if key is None:
        with _key_lock:
            if _key is None:
                configured = env_secret("SERVER_SIGNING_KEY")
                if configured:
                    _key = _load_from_text(configured)
                else:
                    _key = _load_or_create_file(Path(settings.DATA_DIR) / KEY_FILE_NAME)
            key = _key
    return key


def public_key_b64(key: Ed25519PrivateKey) -> str:
    return b64encode(key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def server_public_key_b64() -> str:
    return public_key_b64(server_private_key())


def key_rotations(public_key: str | None = None) -> list[dict]:
    """The chain of rotation statements (oldest first) that ends at ``public_key`` (the current key by
    default), as manifests carry it; [] when the key was never rotated to. Cached for 30 s per process."""
    from devices.models import ServerKeyRotation

    public_key = public_key or server_public_key_b64()
    cached = _chains.get(public_key)
    if cached and time.monotonic() - cached[0] < _CHAIN_TTL_SECONDS:
        return cached[1]
    rows = {row.new_public_key: row for row in ServerKeyRotation.objects.all()}
    if any(row.old_public_key == public_key for row in rows.values()):
        logger.error(
            "the server signs with a retired key (%s): devices that followed the rotation refuse its manifests; "
            "configure the new key and restart every process",
            public_key,
        )
    chain, key = [], public_key
    while key in rows and len(chain) < len(rows):
        chain.append(rows[key].as_link())
        key = rows[key].old_public_key
    chain.reverse()
    _chains[public_key] = (time.monotonic(), chain)
    return chain


def forget_cached_keys() -> None:
    """Drop this process's cached key and chains (after a rotation in this process; tests)."""
    global _key
    with _key_lock:
        _key = None
    _chains.clear()


def rotation_sign(old: Ed25519PrivateKey, new: Ed25519PrivateKey, *, seq: int) -> dict:
    """The rotation statement from ``old`` to ``new``, signed by both (``edge_agent.manifest`` checks it)."""
    statement = {
        "purpose": ROTATION_PURPOSE,
        "seq": seq,
        "old_public_key": public_key_b64(old),
        "new_public_key": public_key_b64(new),
        # A whole number: with only whole numbers and ASCII text, protocol 1's and RFC 8785's canonical forms
        # are the same bytes, so agents of either protocol check the statement alike.
        "issued_at": int(time.time()),
    }
    return {"statement": statement, "signature": sign(old, statement), "new_signature": sign(new, statement)}


def rotate_server_key(new: Ed25519PrivateKey | None = None, *, next_key_path: Path | None = None):
    """Record the rotation from the current key to ``new`` (a fresh key by default) and install it.

    Key in the data folder: the new key is written beside it first (``server_signing_key.next.pem``), the
    statement is stored, then the file is swapped in with one rename; running this again after a crash
    finishes the same rotation. Key from the environment: the new key is written to ``next_key_path`` and the
    operator points ``SERVER_SIGNING_KEY``/``_FILE`` at it. Either way every web and worker process must be
    restarted to sign with it (a process still on the old key keeps serving the old chain, which devices that
    have not rotated yet accept). Returns ``(ServerKeyRotation, path of the new key file)``."""
    from django.db import IntegrityError, transaction
    from django.db.models import Max

    from devices.models import ServerKeyRotation

    old = server_private_key()
    current = key_file()
    target = current.with_name(NEXT_KEY_FILE_NAME) if current else next_key_path
    if target is None:
        raise ImproperlyConfigured(
            "the signing key comes from SERVER_SIGNING_KEY: name a file for the new key (--new-key-file)"
        )
    recorded = ServerKeyRotation.objects.filter(old_public_key=public_key_b64(old)).first()
    if recorded is not None:
        if current is None or not target.exists():
            raise ImproperlyConfigured(
                f"the current key was already rotated (rotation #{recorded.seq}) to {recorded.new_public_key}: "
                "configure that key and restart, instead of rotating the retired one again"
            )
        new = _load_from_text(target.read_text())
        if public_key_b64(new) != recorded.new_public_key:
            raise ImproperlyConfigured(f"{target} is not the key rotation #{recorded.seq} introduced")
        rotation = recorded  # an interrupted rotation: finish installing its key
    else:
        new = new or Ed25519PrivateKey.generate()
        if public_key_b64(new) == public_key_b64(old):
            raise ImproperlyConfigured("the new signing key is the current one")
        if ServerKeyRotation.objects.filter(new_public_key=public_key_b64(new)).exists() or (
            ServerKeyRotation.objects.filter(old_public_key=public_key_b64(new)).exists()
        ):
            raise ImproperlyConfigured("the new signing key has been used before: generate a fresh one")
        os.replace(write_private_file(target, private_key_pem(new)), target)
        try:
            with transaction.atomic():
                seq = (ServerKeyRotation.objects.aggregate(last=Max("seq"))["last"] or 0) + 1
                link = rotation_sign(old, new, seq=seq)
                rotation = ServerKeyRotation.objects.create(
                    seq=seq,
                    old_public_key=link["statement"]["old_public_key"],
                    new_public_key=link["statement"]["new_public_key"],
                    statement=link["statement"],
                    signature=link["signature"],
                    new_signature=link["new_signature"],
                )
        except IntegrityError:
            raise ImproperlyConfigured("another rotation was recorded at the same time; run this again") from None
    if current is not None:
        os.replace(target, current)
        target = current
    forget_cached_keys()
    logger.warning(
        "server signing key rotated (#%s): %s -> %s", rotation.seq, rotation.old_public_key, rotation.new_public_key
    )
    return rotation, target
