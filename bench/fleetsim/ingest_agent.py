"""A simulated device of the fleet simulator: protocol-level (``edge_agent.protocol`` and ``websockets``, no
Django, no torch), thousands of them on one event loop.

Each agent holds its socket (challenge, signed hello, welcome), heartbeats on a jittered interval (the first at
a random offset), and reconnects with the agent's own backoff (``edge_agent.connection.Backoff``: exponential,
full jitter) after a drop. When the simulator's scheduler picks it, it uploads its delta (a fresh signed upload
each time, ``deltas.AgentDelta``) one of two ways:

- ``ws``: over its socket, as ``edge_agent.connection.DeltaUploader`` does: ``delta_begin``, then one
  binary chunk frame (512 KiB of raw bytes, ``encode_chunk_frame``) per ``delta_state`` answer, each
  acknowledged with the new offset.
  After a drop the next session begins again and the server says from which offset to go on.
- ``rest``: ``PUT /api/v1/device/deltas/<sha256>/`` with a device token (``/device-auth/challenge/`` +
  ``/token/``), the whole file in one body.

Either way the agent learns the verification outcome from the ``delta_result`` command the server pushes on
its socket; when none came ``result_timeout`` seconds after the server held every byte (the agent was offline
at that moment, or the push was lost), it asks: ``delta_begin`` again over the socket, or
``GET /api/v1/device/deltas/<sha256>/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from dataclasses import dataclass

from websockets.exceptions import ConnectionClosed

from bench.fleetsim.agent import HandshakeFailed, failure_reason, handshake, heartbeat_message
from bench.fleetsim.deltas import AgentDelta
from bench.fleetsim.http_client import request
from edge_agent.connection import Backoff
from edge_agent.protocol import (
    DELTA_BINARY_CHUNK_BYTES,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    MessageType,
    b64encode,
    canonical_json,
    decode,
    encode,
    encode_chunk_frame,
    sign,
    token_request_payload,
)

FINAL_STATES = ("accepted", "rejected", "aggregated")


@dataclass
class IngestConfig:
    mode: str  # "ws" or "rest"
    ws_url: str
    base_url: str
    adapter: str
    base_version: int
    interval: float  # heartbeat seconds, until the welcome says otherwise
    handshake_timeout: float
    compression: str
    result_timeout: float
    backoff_cap: float
    num_samples: int = 64
    chunk_bytes: int = DELTA_BINARY_CHUNK_BYTES  # bytes per binary chunk frame (the edge agent sends 512 KiB)


class IngestStats:
    """What every agent of a phase records; ``recording`` also drives the loop-health probes."""

    def __init__(self) -> None:
        self.recording = False
        self.lag_ms: list[float] = []
        self.gc_pauses_ms: list[float] = []
        # (first byte sent, server held every byte, outcome known, state, rejection code, how it was learnt, sha256)
        self.completions: list[tuple[float, float, float, str, str, str, str]] = []
        self.errors: list[tuple[float, str]] = []
        self.heartbeats: list[tuple[float, float]] = []  # (sent, round trip ms)
        self.started: list[float] = []  # when each upload began
        self.connected = 0
        self.handshakes = 0
        self.drops = 0  # sockets the simulator cut on purpose
        self.cut_uploads: list[tuple[float, str, int]] = []  # (when, sha256, bytes sent) of sockets cut mid-upload
        self.interrupted: list[tuple[float, str]] = []  # (when, sha256): a socket lost with an upload unfinished
        self.polls = 0

    def error(self, kind: str) -> None:
        self.errors.append((time.perf_counter(), kind))

    def error_counts(self, since: float = 0.0, until: float = float("inf")) -> Counter[str]:
        return Counter(kind for at, kind in self.errors if since <= at <= until)


class IdlePool:
    """Connected agents with no upload in progress, for O(1) random picks by the scheduler."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.items: list[IngestAgent] = []
        self.where: dict[int, int] = {}

    def add(self, agent: IngestAgent) -> None:
        if agent.index not in self.where:
            self.where[agent.index] = len(self.items)
            self.items.append(agent)

    def discard(self, agent: IngestAgent) -> None:
        position = self.where.pop(agent.index, None)
        if position is None:
            return
        last = self.items.pop()
        if last is not agent:
            self.items[position] = last
            self.where[last.index] = position

    def pop_random(self) -> IngestAgent | None:
        if not self.items:
            return None
        agent = self.items[self.rng.randrange(len(self.items))]
        self.discard(agent)
        return agent

    def __len__(self) -> int:
        return len(self.items)


class IngestAgent:
    def __init__(self, index: int, device_id: str, key, delta: AgentDelta, cfg: IngestConfig, stats, pool):
        self.index, self.device_id, self.key, self.delta = index, device_id, key, delta
        self.cfg, self.stats, self.pool = cfg, stats, pool
        self.socket = None
        self.upload = None
        self.first_byte = 0.0
        self.transferred: float | None = None
        self.last_poll = 0.0
        self.dropping = False
        self.closing = False
        self.token: str | None = None
        self.token_expires = 0.0
        self.beats: dict[int, float] = {}
        self.tasks: set[asyncio.Task] = set()
        self.cut_after_chunks: int | None = None  # armed: cut the socket right after sending this many chunks

    # --- connection ---

    async def run(self, stop: asyncio.Event) -> None:
        backoff = Backoff(cap=self.cfg.backoff_cap)
        while not stop.is_set():
            try:
                done = await handshake(
                    self.cfg.ws_url,
                    self.device_id,
                    self.key,
                    timeout=self.cfg.handshake_timeout,
                    compression=self.cfg.compression,
                    close_timeout=5.0,
                )
            except HandshakeFailed as failed:
                self.stats.error(f"handshake at {failed.stage}: {failure_reason(failed.cause)}")
            else:
                backoff.reset()
                await self._session(done.socket, float(done.welcome.get("heartbeat_interval") or self.cfg.interval))
            if stop.is_set():
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=backoff.next_delay())

    async def _session(self, socket_, interval: float) -> None:
        self.socket = socket_
        self.stats.handshakes += 1
        self.stats.connected += 1
        beating = asyncio.create_task(self._heartbeats(socket_, interval))
        try:
            if self.upload is not None and self.cfg.mode == "ws":
                await self._send_begin()  # resume the upload, or learn what became of it
            elif self.upload is None:
                self.pool.add(self)
            async for raw in socket_:
                await self._on_message(decode(raw, limit=MAX_MESSAGE_BYTES))
            if not self.closing:
                self.stats.error("socket closed by the server (1000)")
        except ConnectionClosed as exc:
            if not (self.dropping or self.closing):
                code = exc.rcvd.code if exc.rcvd is not None else "no close frame"
                self.stats.error(f"socket closed ({code})")
        except Exception as exc:
            self.stats.error(f"socket: {failure_reason(exc)}")
        finally:
            if self.upload is not None and not self.closing:
                self.stats.interrupted.append((time.perf_counter(), self.upload.sha256))
            if self.dropping:
                self.stats.drops += 1
                self.dropping = False
            beating.cancel()
            self.stats.connected -= 1
            self.socket = None
            self.beats.clear()
            self.pool.discard(self)
            with contextlib.suppress(Exception):
                await socket_.close()

    async def _heartbeats(self, socket_, interval: float) -> None:
        rng = random.Random()
        await asyncio.sleep(rng.uniform(0, interval))
        seq = 0
        with contextlib.suppress(ConnectionClosed):
            while True:
                seq += 1
                self.beats[seq] = time.perf_counter()
                await socket_.send(heartbeat_message(seq, rng))
                await asyncio.sleep(interval * rng.uniform(0.9, 1.1))

    def drop(self) -> bool:
        """Cut the socket as a lost network would (no close frame); the agent reconnects with backoff."""
        if self.socket is None or self.dropping:
            return False
        self.dropping = True
        self.socket.transport.abort()
        return True

    async def close(self) -> None:
        self.closing = True
        for task in list(self.tasks):
            task.cancel()
        if self.socket is not None:
            with contextlib.suppress(Exception):
                await self.socket.close()

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # --- messages ---

    async def _on_message(self, message: dict) -> None:
        kind = message["type"]
        if kind == MessageType.HEARTBEAT_ACK:
            sent = self.beats.pop(message.get("seq"), None)
            if sent is not None and self.stats.recording:
                self.stats.heartbeats.append((sent, (time.perf_counter() - sent) * 1000))
        elif kind == MessageType.DELTA_STATE:
            await self._on_state(message)
        elif kind == MessageType.DELTA_ERROR:
            await self._on_delta_error(message)
        elif kind == MessageType.COMMAND:
            if message.get("command") == "delta_result":
                args = message.get("args") or {}
                self._on_outcome(args.get("sha256"), args.get("state"), args.get("code") or "", "pushed")
            await self.socket.send(encode(MessageType.ACK, id=message.get("id"), ok=True, detail=None))
        elif kind == MessageType.ERROR:
            self.stats.error(f"server error message: {message.get('code')}")

    async def _on_state(self, message: dict) -> None:
        upload = self.upload
        if upload is None or message.get("sha256") != upload.sha256:
            return
        state = message.get("state")
        if state == "uploading":
            offset = int(message.get("offset", 0))
            chunk = bytes(self.delta.data[offset : offset + self.cfg.chunk_bytes])
            await self.socket.send(encode_chunk_frame(sha256=upload.sha256, offset=offset, data=chunk))
            if self.cut_after_chunks is not None and offset + len(chunk) < upload.size:
                self.cut_after_chunks -= 1
                if self.cut_after_chunks <= 0:  # the chunk just sent is still in flight: a cut mid-upload
                    self.cut_after_chunks = None
                    if self.drop():
                        self.stats.cut_uploads.append((time.perf_counter(), upload.sha256, offset + len(chunk)))
        else:
            self._on_outcome(upload.sha256, state, message.get("rejection_code") or "", "state")

    async def _on_delta_error(self, message: dict) -> None:
        upload = self.upload
        if upload is None or message.get("sha256") != upload.sha256:
            return
        code = message.get("code", "")
        self.stats.error(f"delta_error {code}")
        if code == "wrong_offset":
            await self._send_begin()
        else:
            self._idle()

    def _on_outcome(self, sha256: str | None, state: str | None, code: str, how: str) -> None:
        upload = self.upload
        if upload is None or sha256 != upload.sha256:
            return
        now = time.perf_counter()
        if self.transferred is None:
            self.transferred = now
        if state not in FINAL_STATES:
            return  # received: the result is pushed once the worker has verified it
        self.stats.completions.append((self.first_byte, self.transferred, now, state, code, how, sha256))
        self._idle()

    def _idle(self) -> None:
        self.upload = None
        self.transferred = None
        if self.socket is not None:
            self.pool.add(self)

    # --- uploads ---

    def start_upload(self) -> None:
        self.upload = self.delta.next_upload(
            self.key,
            device_id=self.device_id,
            adapter=self.cfg.adapter,
            base_version=self.cfg.base_version,
            num_samples=self.cfg.num_samples,
        )
        self.first_byte = time.perf_counter()
        self.transferred = None
        self.last_poll = 0.0
        self.stats.started.append(self.first_byte)
        self._spawn(self._send_begin() if self.cfg.mode == "ws" else self._rest_put())

    async def _send_begin(self) -> None:
        upload, socket_ = self.upload, self.socket
        if upload is None or socket_ is None:
            return
        with contextlib.suppress(ConnectionClosed):  # the session notices the drop and resumes later
            await socket_.send(
                encode(MessageType.DELTA_BEGIN, envelope=upload.envelope, signature=upload.signature, metrics={})
            )

    async def _device_token(self, renew: bool = False) -> str:
        if renew or self.token is None or time.monotonic() > self.token_expires - 60:
            base = self.cfg.base_url
            challenge = await request(
                base, "POST", "/api/v1/device-auth/challenge/", json_body={"device_id": self.device_id}
            )
            if challenge.status != 200:
                raise RuntimeError(f"challenge {challenge.status} {challenge.error_code}")
            nonce = challenge.json()["nonce"]
            signature = sign(self.key, token_request_payload(nonce=nonce, device_id=self.device_id))
            answer = await request(
                base,
                "POST",
                "/api/v1/device-auth/token/",
                json_body={
                    "device_id": self.device_id,
                    "nonce": nonce,
                    "signature": signature,
                    "protocol": PROTOCOL_VERSION,
                },
            )
            if answer.status != 200:
                raise RuntimeError(f"token {answer.status} {answer.error_code}")
            body = answer.json()
            self.token, self.token_expires = body["token"], time.monotonic() + body["expires_in"]
        return self.token

    async def _rest_put(self) -> None:
        upload = self.upload
        path = f"/api/v1/device/deltas/{upload.sha256}/"
        try:
            for attempt in range(2):
                headers = {
                    "Authorization": f"Device {await self._device_token(renew=attempt > 0)}",
                    "Content-Type": "application/octet-stream",
                    "X-Delta-Envelope": b64encode(canonical_json(upload.envelope)),
                    "X-Delta-Signature": upload.signature,
                }
                if attempt == 0:
                    self.first_byte = time.perf_counter()  # the token is not part of the upload
                response = await request(self.cfg.base_url, "PUT", path, body=bytes(self.delta.data), headers=headers)
                if response.status != 401:
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.error(f"rest PUT: {failure_reason(exc)}")
            if self.upload is upload:
                self._idle()
            return
        if response.status not in (200, 201):
            self.stats.error(f"rest PUT: {response.status} {response.error_code}")
            if self.upload is upload:
                self._idle()
            return
        body = response.json()
        self._on_outcome(upload.sha256, body.get("state"), body.get("rejection_code") or "", "state")

    async def poll(self) -> None:
        """No result came in time: ask for the upload's state (it may also resume the transfer)."""
        upload = self.upload
        self.last_poll = time.perf_counter()
        self.stats.polls += 1
        if upload is None:
            return
        if self.cfg.mode == "ws":
            await self._send_begin()
            return
        try:
            token = await self._device_token()
            response = await request(
                self.cfg.base_url,
                "GET",
                f"/api/v1/device/deltas/{upload.sha256}/",
                headers={"Authorization": f"Device {token}"},
            )
        except Exception as exc:
            self.stats.error(f"rest GET: {failure_reason(exc)}")
            return
        if response.status == 200:
            body = response.json()
            self._on_outcome(upload.sha256, body.get("state"), body.get("rejection_code") or "", "polled")

    def overdue(self, now: float) -> bool:
        """An upload the server holds whose outcome is late (while sending, a drop is noticed by the session,
        which begins again on reconnect; asking then would start a second chain of chunks)."""
        if self.upload is None or self.socket is None or self.transferred is None:
            return False
        since = max(self.transferred or self.first_byte, self.last_poll)
        return now - since > self.cfg.result_timeout
