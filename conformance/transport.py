"""What the conformance suite talks through and checks with: the protocol's JSON Schemas (docs/protocol/schemas),
REST over HTTP and one WebSocket session, each received message validated; a step's failure (``StepFailed``,
``check``); and the small tensors a test delta carries.

Only the standard library, ``websockets`` and ``jsonschema`` here (and conformance.client).
"""

from __future__ import annotations

import json
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jsonschema
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from conformance.client import Tensors

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "docs" / "protocol" / "schemas"

# Server -> agent messages by type (commands by their "command").
SERVER_MESSAGES = {
    "challenge": "Challenge",
    "welcome": "Welcome",
    "heartbeat_ack": "HeartbeatAck",
    "delta_state": "DeltaState",
    "delta_error": "DeltaError",
    "error": "Error",
}
COMMANDS = {"assignment": "AssignmentCommand", "delta_result": "DeltaResultCommand"}


class StepFailed(Exception):
    pass


def check(condition: Any, message: str) -> None:
    if not condition:
        raise StepFailed(message)


class Schemas:
    def __init__(self, directory: Path = SCHEMA_DIR):
        self.validators: dict[str, jsonschema.Draft202012Validator] = {}
        for path in sorted(directory.glob("*.json")):
            schema = json.loads(path.read_text())
            jsonschema.Draft202012Validator.check_schema(schema)
            self.validators[path.stem] = jsonschema.Draft202012Validator(schema)

    def validate(self, name: str, value: Any, *, what: str = "") -> None:
        errors = sorted(self.validators[name].iter_errors(value), key=lambda e: list(e.absolute_path))
        if errors:
            where = "/".join(str(p) for p in errors[0].absolute_path) or "(root)"
            raise StepFailed(f"{what or name} does not fit {name}.json at {where}: {errors[0].message}")

    def server_message(self, message: Any) -> str:
        """Validate a server socket message; returns the schema's name."""
        check(isinstance(message, dict), f"a server message that is not a JSON object: {message!r}"[:300])
        kind = message.get("type")
        name = COMMANDS.get(message.get("command")) if kind == "command" else SERVER_MESSAGES.get(kind)
        check(name, f"an undocumented server message: {json.dumps(message)[:300]}")
        self.validate(name, message, what=f"the server's {kind} {message.get('command') or ''}".strip())
        return name


# --- transport helpers ------------------------------------------------------------------------------------


class Http:
    def __init__(self, base_url: str):
        self.base_url = base_url.rstrip("/")

    def request(
        self, method: str, path: str, body: Any = None, *, token: str | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()  # bytes: as they are
        request = urllib.request.Request(self.base_url + path, data=data, method=method)  # noqa: S310
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if token:
            request.add_header("Authorization", f"Device {token}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 (the server under test)
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    def json(self, method: str, path: str, body: Any = None, *, token: str | None = None, expect=(200,)) -> Any:
        status, _, raw = self.request(method, path, body, token=token)
        check(status in expect, f"{method} {path}: HTTP {status} (expected {expect}): {raw[:300]!r}")
        return json.loads(raw) if raw else None


class Socket:
    """One WebSocket connection; every received message is validated against its schema. Messages read while
    waiting for another are kept, in order, for later ``expect`` calls."""

    def __init__(self, url: str, schemas: Schemas):
        self.schemas = schemas
        self._stack = ExitStack()
        self.ws: ClientConnection = self._stack.enter_context(
            connect(url, compression=None, open_timeout=10, max_size=2**22)
        )
        self.backlog: list[dict[str, Any]] = []
        self.closed_with: int | None = None

    def send(self, message: dict[str, Any] | str | bytes) -> None:
        self.ws.send(message if isinstance(message, str | bytes) else json.dumps(message, separators=(",", ":")))

    def _receive(self, timeout: float) -> dict[str, Any]:
        try:
            raw = self.ws.recv(timeout=timeout)
        except TimeoutError:
            raise StepFailed(f"no message from the server within {timeout:.0f} s") from None
        except ConnectionClosed as closed:
            self.closed_with = closed.rcvd.code if closed.rcvd else None
            raise StepFailed(f"the server closed the socket ({self.closed_with})") from None
        check(isinstance(raw, str), "the server sent a binary frame (none is documented server -> agent)")
        try:
            message = json.loads(raw)
        except json.JSONDecodeError:
            raise StepFailed(f"the server sent a frame that is not JSON: {raw[:200]!r}") from None
        self.schemas.server_message(message)
        return message

    def expect(self, predicate: Callable[[dict], bool], what: str, timeout: float = 10) -> dict[str, Any]:
        for index, message in enumerate(self.backlog):
            if predicate(message):
                return self.backlog.pop(index)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            check(left > 0, f"no {what} within {timeout:.0f} s (got: {[m.get('type') for m in self.backlog]})")
            try:
                message = self._receive(left)
            except StepFailed as exc:
                raise StepFailed(f"waiting for {what}: {exc}") from None
            if predicate(message):
                return message
            self.backlog.append(message)

    def expect_type(self, kind: str, timeout: float = 10) -> dict[str, Any]:
        return self.expect(lambda m: m.get("type") == kind, kind, timeout)

    def expect_close(self, timeout: float = 10) -> tuple[int | None, list[dict[str, Any]]]:
        """Read until the server closes; the close code and the messages before it."""
        received, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                received.append(self._receive(deadline - time.monotonic()))
            except StepFailed:
                if self.closed_with is not None or self.ws.close_code is not None:
                    return self.closed_with or self.ws.close_code, received
                raise
        raise StepFailed(f"the server did not close the socket within {timeout:.0f} s")

    def close(self) -> None:
        self._stack.close()


def safetensors_tensors(data: bytes) -> dict[str, dict[str, Any]]:
    """The tensor entries (name -> dtype, shape, data_offsets) of a safetensors file's header."""
    check(len(data) >= 8, "the adapter file is shorter than a safetensors header")
    (length,) = struct.unpack("<Q", data[:8])
    check(8 + length <= len(data), "the adapter file's safetensors header length is past its end")
    header = json.loads(data[8 : 8 + length])
    return {name: entry for name, entry in header.items() if name != "__metadata__"}


def small_tensors(spec: dict[str, dict[str, Any]], salt: int) -> Tensors:
    """Small finite f32 values, different per ``salt``, for the installed adapter's tensors."""
    tensors: Tensors = {}
    for name, entry in spec.items():
        count = 1
        for dim in entry["shape"]:
            count *= dim
        values = [((index * 7 + salt * 13) % 11 - 5) * 1e-4 for index in range(count)]
        tensors[name] = (list(entry["shape"]), values)
    return tensors
