"""The fleet simulator's baseline: a no-op server that speaks the same protocol on the same transport.

A bare ASGI app run by uvicorn with the product's flags (``fleet.serve.uvicorn_args``: ``--ws wsproto
--ws-ping-interval 60 --loop uvloop --http httptools``, the same number of processes, client frames unmasked
by ``fleet.wsmask`` as in the product). On ``/ws/agent/`` it sends a challenge, welcomes any hello,
acknowledges heartbeats, and takes ``delta_begin`` / ``delta_chunk`` like the product's consumer does at the
wire level (each message JSON-decoded, each chunk's base64 decoded, offsets checked), but stores nothing and
verifies nothing: the last chunk is answered with the state ``accepted`` at once. Over REST,
``PUT /api/v1/device/deltas/<sha256>/`` reads the whole body and answers ``accepted``; the device-auth
endpoints hand out a dummy token. So the same agents uploading the same bytes at the same rate show what the
transport alone costs and allows on this machine.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path

from edge_agent.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    MessageType,
    b64decode,
    decode,
    decode_chunk_frame,
    encode,
)
from fleet import wsmask
from fleet.serve import uvicorn_command

HEARTBEAT_INTERVAL = int(os.environ.get("HEARTBEAT_INTERVAL_SECONDS", "30"))
wsmask.install()  # as fleet/asgi.py does


def _state(sha256: str, size: int, offset: int, state: str) -> str:
    return encode(
        MessageType.DELTA_STATE,
        sha256=sha256,
        size=size,
        offset=offset,
        delta_id=None,
        state=state,
        rejection_code="",
        rejection_detail="",
    )


async def _websocket(scope, receive, send) -> None:
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    nonce = secrets.token_urlsafe(32)
    await send(
        {
            "type": "websocket.send",
            "text": encode(MessageType.CHALLENGE, nonce=nonce, protocol=PROTOCOL_VERSION, server_time=time.time()),
        }
    )
    uploads: dict[str, list[int]] = {}  # sha256 -> [size, bytes held]
    while True:
        event = await receive()
        if event["type"] == "websocket.disconnect":
            return
        if event.get("bytes") is not None:  # a binary delta chunk
            sha256, offset, data = decode_chunk_frame(event["bytes"])
            message = {"type": MessageType.DELTA_CHUNK, "sha256": sha256, "offset": offset}
        else:
            message = decode(event.get("text") or "", limit=MAX_MESSAGE_BYTES)
            data = None
        kind = message["type"]
        if kind == MessageType.HELLO:
            reply = encode(
                MessageType.WELCOME,
                device_id=message.get("device_id"),
                status="active",
                cohort="echo",
                heartbeat_interval=HEARTBEAT_INTERVAL,
                server_time=time.time(),
            )
        elif kind == MessageType.HEARTBEAT:
            reply = encode(MessageType.HEARTBEAT_ACK, seq=message["seq"], server_time=time.time())
        elif kind == MessageType.DELTA_BEGIN:
            envelope = message["envelope"]
            sha256, size = envelope["sha256"], envelope["size"]
            held = uploads.setdefault(sha256, [size, 0])
            reply = _state(sha256, size, held[1], "uploading" if held[1] < size else "accepted")
        elif kind == MessageType.DELTA_CHUNK:
            sha256 = message["sha256"]
            if data is None:
                data = b64decode(message["data"], limit=MAX_MESSAGE_BYTES)
            held = uploads.get(sha256)
            if held is None or message["offset"] != held[1]:
                reply = encode(MessageType.DELTA_ERROR, sha256=sha256, code="wrong_offset", message="")
            else:
                held[1] += len(data)
                reply = _state(sha256, held[0], held[1], "uploading" if held[1] < held[0] else "accepted")
        else:
            continue
        await send({"type": "websocket.send", "text": reply})


async def _http(scope, receive, send) -> None:
    path, method = scope["path"], scope["method"]
    size = 0
    while True:
        event = await receive()
        size += len(event.get("body", b""))
        if not event.get("more_body"):
            break
    status, body = 200, {"ok": True}
    if path.startswith("/api/v1/device/deltas/"):
        sha256 = path.rstrip("/").rsplit("/", 1)[-1]
        status = 201 if method == "PUT" else 200
        body = {"sha256": sha256, "size": size, "offset": size, "delta_id": None, "state": "accepted"}
    elif path == "/api/v1/device-auth/challenge/":
        body = {"nonce": secrets.token_urlsafe(32), "expires_in": 60}
    elif path == "/api/v1/device-auth/token/":
        body = {"token": "echo", "expires_in": 900}
    raw = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": raw})


async def app(scope, receive, send) -> None:
    if scope["type"] == "websocket":
        await _websocket(scope, receive, send)
    elif scope["type"] == "http":
        await _http(scope, receive, send)


class EchoServer:
    """The no-op server in its own uvicorn processes, started and stopped like the product."""

    def __init__(self, *, port: int, web_workers: int, interval: int, log_path: Path, base_dir: Path):
        self.port, self.log_path, self.base_dir = port, log_path, base_dir
        self.env = {**os.environ, "HEARTBEAT_INTERVAL_SECONDS": str(interval), "PYTHONUNBUFFERED": "1"}
        # The product's flags (fleet/serve.py), on this app; no --timeout-graceful-shutdown, as before.
        self.command = uvicorn_command(
            app="bench.fleetsim.echo_server:app", host="127.0.0.1", port=port, workers=web_workers
        )
        self.process: subprocess.Popen | None = None
        self.log = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        import urllib.request

        self.log = open(self.log_path, "w")  # noqa: SIM115  (closed in stop())
        self.process = subprocess.Popen(
            self.command, cwd=self.base_dir, env=self.env, stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the echo server exited with code {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/readyz", timeout=2) as response:  # noqa: S310
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"the echo server did not answer within {timeout:.0f}s; see {self.log_path}")

    def processes(self) -> list:
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except (psutil.NoSuchProcess, AttributeError):
            return []

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log is not None:
            self.log.close()
