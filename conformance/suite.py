"""Drive a live server through the device flow with a ``Client``, checking every server message against its
JSON Schema (docs/protocol/schemas). ``run(...)`` returns one ``Result`` per step and prints a line for each.

Only the standard library, ``websockets`` and ``jsonschema`` here (and conformance.client).
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jsonschema
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from conformance.client import Client, Tensors, b64url

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


class Operator(Protocol):
    """The operator-side steps a device cannot do (conformance.operator.RestOperator does them over REST)."""

    def enrollment_token(self) -> str:
        """A raw enrollment token (no approval needed) for a cohort that an adapter with a version serves."""

    def start_rollout(self, device_id: str) -> None:
        """Start a rollout, to 100 % at once, of that adapter's version to the device's cohort."""


@dataclass
class Result:
    step: str
    status: str  # PASS, FAIL or SKIP (a step it needs failed)
    detail: str = ""
    seconds: float = 0.0

    def __str__(self) -> str:
        text = f"{self.status} {self.step} ({self.seconds:.2f} s)"
        return f"{text}: {self.detail}" if self.detail else text


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
        data = None if body is None else json.dumps(body).encode()
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


# --- the suite ----------------------------------------------------------------------------------------------


@dataclass
class State:
    client: Client
    device_id: str = ""
    pinned_key: str = ""
    websocket_path: str = "/ws/agent/"
    token: str = ""
    socket: Socket | None = None
    assignment: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    adapter_file: bytes = b""
    uploads: dict[str, dict[str, Any]] = field(default_factory=dict)


class Suite:
    def __init__(
        self,
        server_url: str,
        client_factory: Callable[[], Client],
        operator: Operator,
        *,
        chunk_size: int = 0,
        result_timeout: float = 60,
        schemas: Schemas | None = None,
        out: Callable[[str], None] | None = print,
    ):
        self.http = Http(server_url)
        self.ws_base = "ws" + server_url.rstrip("/")[len("http") :]
        self.client_factory = client_factory
        self.operator = operator
        self.chunk_size = chunk_size
        self.result_timeout = result_timeout
        self.schemas = schemas or Schemas()
        self.out = out
        self.results: list[Result] = []
        self.state = State(client=client_factory())

    # -- running ---------------------------------------------------------------------------------------------

    def step(self, name: str, function: Callable[[], str | None], *needs: str) -> bool:
        passed = {r.step for r in self.results if r.status == "PASS"}
        missing = [n for n in needs if n not in passed]
        started = time.monotonic()
        if missing:
            result = Result(name, "SKIP", f"needs {', '.join(missing)}")
        else:
            try:
                result = Result(name, "PASS", function() or "")
            except StepFailed as exc:
                result = Result(name, "FAIL", str(exc))
            except Exception as exc:  # noqa: BLE001 (a client or transport error fails the step, not the suite)
                result = Result(name, "FAIL", f"{type(exc).__name__}: {exc}")
        result.seconds = time.monotonic() - started
        self.results.append(result)
        if self.out:
            self.out(str(result))
        return result.status == "PASS"

    def run(self) -> list[Result]:
        s = self.step
        try:
            s("enroll", self.enroll)
            s("enroll_required_fields_only", self.enroll_required_fields_only, "enroll")
            s("rest_token", self.rest_token, "enroll")
            s("rest_device_and_heartbeat", self.rest_device_and_heartbeat, "rest_token")
            s("socket_handshake", self.socket_handshake, "enroll")
            s("socket_wrong_signature", self.socket_wrong_signature, "enroll")
            s("socket_oversized_before_hello", self.socket_oversized_before_hello, "enroll")
            s("socket_session", self.socket_session, "socket_handshake")
            s("assignment", self.assignment_command, "socket_session")
            s("assignment_command_id", self.assignment_command_id, "assignment")
            s("assignment_rest", self.assignment_rest, "assignment", "rest_token")
            s("manifest", self.manifest_check, "assignment")
            s("download", self.download, "manifest", "rest_token")
            s("report_installed", self.report_installed, "download")
            s("ack_assignment", self.ack_assignment, "assignment")
            s("delta_binary", self.delta_binary, "download", "socket_session")
            s("delta_text", self.delta_text, "download", "socket_session")
            s("delta_repeat_begin", self.delta_repeat_begin, "delta_binary")
            s("delta_wrong_offset", self.delta_wrong_offset, "download", "socket_session")
            s("delta_hash_mismatch", self.delta_hash_mismatch, "download", "socket_session")
            s("delta_replayed_counter", self.delta_replayed_counter, "delta_binary")
            s("delta_refused_at_begin", self.delta_refused_at_begin, "download", "socket_session")
            s("delta_abort", self.delta_abort, "download", "socket_session")
            s("delta_result_after_reconnect", self.delta_result_after_reconnect, "download", "socket_session")
        finally:
            if self.state.socket:
                self.state.socket.close()
        return self.results

    # -- helpers ---------------------------------------------------------------------------------------------

    def open_socket(self) -> tuple[Socket, dict[str, Any]]:
        socket = Socket(self.ws_base + self.state.websocket_path, self.schemas)
        challenge = socket.expect_type("challenge", timeout=10)
        check(2 in (challenge.get("protocols") or [challenge["protocol"]]), "the server does not offer protocol 2")
        return socket, challenge

    def hello(self) -> tuple[Socket, dict[str, Any]]:
        socket, challenge = self.open_socket()
        hello = self.state.client.hello(nonce=challenge["nonce"], device_id=self.state.device_id)
        self.schemas.validate("Hello", hello, what="the client's hello")
        socket.send(hello)
        welcome = socket.expect(lambda m: m.get("type") in ("welcome", "error"), "welcome")
        check(welcome["type"] == "welcome", f"hello refused: {welcome}")
        check(welcome["device_id"] == self.state.device_id, "welcome names another device")
        check(welcome.get("protocol", 2) == 2, f"the session is protocol {welcome.get('protocol')}, not 2")
        return socket, welcome

    # -- REST: enrollment and device tokens ------------------------------------------------------------------

    def enroll(self) -> str:
        body = {
            "token": self.operator.enrollment_token(),
            "public_key": self.state.client.public_key(),
            "name": f"conformance-{uuid.uuid4().hex[:8]}",
            "agent_version": "conformance",
        }
        self.schemas.validate("EnrollRequest", body, what="the enroll request")
        answer = self.http.json("POST", "/api/v1/enroll/", body, expect=(201,))
        self.schemas.validate("EnrollResponse", answer, what="the enroll answer")
        check(answer["status"] == "active", f"enrolled as {answer['status']}, expected active")
        self.state.device_id = answer["device_id"]
        self.state.pinned_key = answer["server_public_key"]
        self.state.websocket_path = answer["websocket_path"]
        return f"device {self.state.device_id}"

    def enroll_required_fields_only(self) -> str:
        """A request with only the fields EnrollRequest.json requires must do (what the schema calls optional
        must be optional), for another device."""
        candidates = {
            "token": self.operator.enrollment_token(),
            "public_key": self.client_factory().public_key(),
            "name": f"conformance-{uuid.uuid4().hex[:8]}",
        }
        required = self.schemas.validators["EnrollRequest"].schema.get("required", [])
        body = {name: candidates[name] for name in required}
        self.schemas.validate("EnrollRequest", body, what="the enroll request")
        answer = self.http.json("POST", "/api/v1/enroll/", body, expect=(201,))
        self.schemas.validate("EnrollResponse", answer, what="the enroll answer")
        return f"with {sorted(body)}"

    def rest_token(self) -> str:
        body = {"device_id": self.state.device_id}
        challenge = self.http.json("POST", "/api/v1/device-auth/challenge/", body, expect=(200, 201))
        self.schemas.validate("DeviceChallenge", challenge, what="the REST challenge")
        request = self.state.client.token_request(nonce=challenge["nonce"], device_id=self.state.device_id)
        self.schemas.validate("DeviceTokenRequest", request, what="the client's token request")
        check(request.get("protocol") == 2, "the client's token request does not say protocol 2")
        token = self.http.json("POST", "/api/v1/device-auth/token/", request, expect=(200, 201))
        self.schemas.validate("DeviceToken", token, what="the device token")
        self.state.token = token["token"]
        again = self.http.request("POST", "/api/v1/device-auth/token/", request)[0]
        check(again == 401, f"a REST nonce used twice gave HTTP {again}, expected 401")
        return f"token for {token['expires_in']} s; a reused nonce is refused"

    def rest_device_and_heartbeat(self) -> None:
        me = self.http.json("GET", "/api/v1/device/", token=self.state.token)
        check(me.get("id") == self.state.device_id, f"GET /api/v1/device/ is not this device: {me.get('id')}")
        beat = {"seq": 1, "battery": 80.0, "charging": True, "free_memory_mb": 512, "metrics": {"temp": 31.5}}
        self.schemas.validate("HeartbeatState", beat, what="the REST heartbeat")
        self.http.json("POST", "/api/v1/device/heartbeat/", beat, token=self.state.token, expect=(200, 202, 204))
        status = self.http.request("GET", "/api/v1/device/")[0]
        check(status == 401, f"GET /api/v1/device/ without a token gave HTTP {status}, expected 401")

    # -- the socket --------------------------------------------------------------------------------------------

    def socket_handshake(self) -> str:
        socket, welcome = self.hello()
        try:
            socket.send({"type": "heartbeat", "seq": 1})
            ack = socket.expect_type("heartbeat_ack")
            check(ack["seq"] == 1, f"heartbeat_ack echoes seq {ack['seq']}, expected 1")
        finally:
            socket.close()
        return f"cohort {welcome['cohort']}, heartbeat every {welcome['heartbeat_interval']} s"

    def socket_wrong_signature(self) -> None:
        socket, challenge = self.open_socket()
        try:
            stranger = self.client_factory()  # another key: a valid signature, but not by the enrolled key
            socket.send(stranger.hello(nonce=challenge["nonce"], device_id=self.state.device_id))
            code, received = socket.expect_close()
        finally:
            socket.close()
        errors = [m for m in received if m["type"] == "error"]
        check(errors and errors[0]["code"] == "auth_failed", f"expected an error auth_failed, got {received}")
        check(code == 4401, f"closed with {code}, expected 4401")

    def socket_oversized_before_hello(self) -> str:
        socket, _ = self.open_socket()
        try:
            padding = "é" * 2100  # 2 bytes each in UTF-8: fewer than 4096 characters, more than 4096 bytes
            text = json.dumps({"type": "hello", "device_id": self.state.device_id, "pad": padding}, ensure_ascii=False)
            check(len(text) < 4096 < len(text.encode()), "the test frame is not what it should be")
            socket.send(text)
            code, _ = socket.expect_close()
        finally:
            socket.close()
        check(code == 4413, f"closed with {code}, expected 4413")
        return f"{len(text)} characters, {len(text.encode())} bytes: 4413"

    def socket_session(self) -> None:
        self.state.socket, _ = self.hello()

    # -- assignment ----------------------------------------------------------------------------------------------

    def assignment_command(self) -> str:
        self.operator.start_rollout(self.state.device_id)
        command = self.state.socket.expect(
            lambda m: m.get("type") == "command" and m.get("command") == "assignment", "an assignment command", 20
        )
        self.state.assignment = command
        return f"assignment {command['args']['assignment_id']}"

    def assignment_command_id(self) -> None:
        command = self.state.assignment
        expected = f"assignment-{command['args']['assignment_id']}"
        check(command["id"] == expected, f"the pushed command's id is {command['id']!r}, documented: {expected!r}")

    def assignment_rest(self) -> None:
        body = self.http.json("GET", "/api/v1/device/assignment/", token=self.state.token)
        self.schemas.validate("AssignmentMessage", body, what="GET /api/v1/device/assignment/")
        pushed = self.state.assignment["args"]
        for name in ("assignment_id", "download_path", "base_model"):
            check(body[name] == pushed[name], f"the REST assignment's {name} is not the pushed one's")
        # Each answer is signed when it is sent: the times and the signature may differ, nothing else.
        signed_now = ("issued_at", "expires_at")
        rest = {k: v for k, v in body["envelope"]["manifest"].items() if k not in signed_now}
        check(rest == {k: v for k, v in pushed["envelope"]["manifest"].items() if k not in signed_now},
              "the REST assignment's manifest is not the pushed one's")  # fmt: skip
        self.state.client.verify_manifest(body["envelope"], pinned_key=self.state.pinned_key)

    def manifest_check(self) -> str:
        args = self.state.assignment["args"]
        envelope = args["envelope"]
        manifest = self.state.client.verify_manifest(envelope, pinned_key=self.state.pinned_key)
        check(manifest == envelope["manifest"], "the client's verified manifest is not the one sent")
        check(manifest["device_id"] == self.state.device_id, "the manifest names another device")
        check(manifest["expires_at"] > time.time(), "the manifest has expired")
        check(manifest["base_model_sha256"] == args["base_model"]["sha256"], "base_model is not the manifest's")
        tampered = {**envelope, "manifest": {**manifest, "assignment_seq": manifest["assignment_seq"] + 1}}
        try:
            self.state.client.verify_manifest(tampered, pinned_key=self.state.pinned_key)
            accepted = True
        except Exception:  # noqa: BLE001 (any refusal will do)
            accepted = False
        check(not accepted, "the client accepted a manifest whose signed fields were changed")
        self.state.manifest = manifest
        return f"{manifest['adapter']} v{manifest['version']}, seq {manifest['assignment_seq']}"

    def _download(self, path: str, sha256: str, size: int) -> bytes:
        status, _, data = self.http.request("GET", path, token=self.state.token)
        check(status == 200, f"GET {path}: HTTP {status}")
        check(len(data) == size, f"{path}: {len(data)} bytes, expected {size}")
        check(hashlib.sha256(data).hexdigest() == sha256, f"{path}: the bytes are not sha256 {sha256}")
        return data

    def download(self) -> str:
        args, manifest = self.state.assignment["args"], self.state.manifest
        self.state.adapter_file = self._download(args["download_path"], manifest["sha256"], manifest["size"])
        base = args["base_model"]
        self._download(base["download_path"], base["sha256"], base["size"])
        status = self.http.request("GET", args["download_path"])[0]
        check(status in (401, 403), f"a download without a device token gave HTTP {status}")
        safetensors_tensors(self.state.adapter_file)
        return f"adapter {manifest['size']} bytes, base model {base['size']} bytes"

    def report_installed(self) -> None:
        report = {"status": "installed", "reason": "", "metrics": {"val_accuracy": 0.9}}
        self.schemas.validate("AssignmentReport", report, what="the report")
        path = f"/api/v1/device/assignments/{self.state.assignment['args']['assignment_id']}/report/"
        self.http.json("POST", path, report, token=self.state.token, expect=(200, 201, 204))

    def ack_assignment(self) -> None:
        ack = {"type": "ack", "id": self.state.assignment["id"], "ok": True, "detail": None}
        self.schemas.validate("Ack", ack)
        self.state.socket.send(ack)

    # -- deltas ----------------------------------------------------------------------------------------------

    def _signed(self, salt: int, counter: int) -> tuple[bytes, dict[str, Any]]:
        spec = safetensors_tensors(self.state.adapter_file)
        data = self.state.client.build_delta(small_tensors(spec, salt))
        check(safetensors_tensors(data).keys() == spec.keys(), "the delta's tensors are not the adapter's")
        signed = self.state.client.delta_upload(
            data,
            device_id=self.state.device_id,
            adapter=self.state.manifest["adapter"],
            base_version=self.state.manifest["version"],
            num_samples=10,
            counter=counter,
            created_at=time.time(),
        )
        self.schemas.validate("DeltaEnvelope", signed["envelope"], what="the client's envelope")
        check(signed["envelope"]["sha256"] == hashlib.sha256(data).hexdigest(), "the envelope's sha256 is wrong")
        return data, signed

    def _answer(self, sha256: str) -> dict[str, Any]:
        return self.state.socket.expect(
            lambda m: m.get("type") in ("delta_state", "delta_error") and m.get("sha256") == sha256,
            "delta_state or delta_error",
        )

    def _begin(self, signed: dict[str, Any]) -> dict[str, Any]:
        begin = {"type": "delta_begin", **signed, "metrics": {"loss": 0.5}}
        self.schemas.validate("DeltaBegin", begin, what="the client's delta_begin")
        self.state.socket.send(begin)
        return self._answer(signed["envelope"]["sha256"])

    def _upload(self, data: bytes, signed: dict[str, Any], *, binary: bool, final=("received",)) -> dict:
        sha = signed["envelope"]["sha256"]
        state = self._begin(signed)
        check(state["type"] == "delta_state", f"delta_begin refused: {state}")
        check(state["state"] == "uploading" and state["offset"] == 0, f"a new upload starts as {state}")
        check(state["size"] == len(data), f"delta_state size {state['size']}, expected {len(data)}")
        size = self.chunk_size or max(1, len(data) // 3 + 1)
        offset, chunks = 0, 0
        while offset < len(data):
            piece = data[offset : offset + size]
            if binary:
                frame = self.state.client.chunk_frame(sha256=sha, offset=offset, data=piece)
                self._check_frame(frame, sha, offset, piece)
                self.state.socket.send(frame)
            else:
                chunk = {"type": "delta_chunk", "sha256": sha, "offset": offset, "data": b64url(piece)}
                self.schemas.validate("DeltaChunk", chunk)
                self.state.socket.send(chunk)
            offset += len(piece)
            chunks += 1
            state = self._answer(sha)
            check(state["type"] == "delta_state", f"chunk at {offset - len(piece)} refused: {state}")
            check(state["offset"] == offset, f"after {offset} bytes the server holds {state['offset']}")
            if offset < len(data):
                check(state["state"] == "uploading", f"mid-upload state {state['state']}")
        check(chunks >= 2, "the upload did not take several chunks")
        check(state["state"] in final, f"after the last chunk the state is {state['state']}, expected {final}")
        if state["state"] == "received":
            check(isinstance(state["delta_id"], int), "a received delta has no delta_id")
        self.state.uploads[sha] = state
        return state

    def _check_frame(self, frame: bytes, sha: str, offset: int, piece: bytes) -> None:
        check(frame[:4] == b"FPD1", "the client's chunk frame does not start with FPD1")
        (length,) = struct.unpack(">H", frame[4:6])
        header = frame[6 : 6 + length]
        expected = json.dumps({"offset": offset, "sha256": sha}, sort_keys=True, separators=(",", ":")).encode()
        check(header == expected, f"the client's chunk frame header is {header!r}")
        self.schemas.validate("ChunkFrameHeader", json.loads(header))
        check(frame[6 + length :] == piece, "the client's chunk frame does not carry the bytes")

    def _result(self, sha256: str) -> dict[str, Any]:
        command = self.state.socket.expect(
            lambda m: m.get("command") == "delta_result" and m["args"]["sha256"] == sha256,
            "delta_result",
            self.result_timeout,
        )
        self.state.socket.send({"type": "ack", "id": command["id"], "ok": True})
        check(command["id"] == f"delta-{command['args']['delta_id']}", f"command id {command['id']!r}")
        return command["args"]

    def _outcome(self, sha256: str, state: dict[str, Any]) -> tuple[str, str]:
        """A delta's verification outcome: from its delta_state if final there, else from delta_result."""
        if state["state"] == "rejected":
            return "rejected", state["rejection_code"]
        result = self._result(sha256)
        return result["state"], result["code"]

    def delta_binary(self) -> str:
        data, signed = self._signed(salt=1, counter=1)
        state = self._upload(data, signed, binary=True)
        outcome, code = self._outcome(signed["envelope"]["sha256"], state)
        check(outcome in ("accepted", "aggregated"), f"the delta was {outcome} ({code})")
        check(code == "", f"an accepted delta carries code {code!r}")
        return f"{len(data)} bytes in binary frames: {outcome}"

    def delta_text(self) -> str:
        data, signed = self._signed(salt=2, counter=2)
        state = self._upload(data, signed, binary=False)
        outcome, code = self._outcome(signed["envelope"]["sha256"], state)
        check(outcome in ("accepted", "aggregated"), f"the delta was {outcome} ({code})")
        return f"{len(data)} bytes in text delta_chunk messages: {outcome}"

    def delta_repeat_begin(self) -> None:
        data, signed = self._signed(salt=1, counter=1)
        first = next(s for s in self.state.uploads.values() if s["sha256"] == signed["envelope"]["sha256"])
        again = self._begin(signed)  # the same file, envelope and counter: answered with where it stands
        check(again["type"] == "delta_state", f"a repeated delta_begin was refused: {again}")
        check(again["delta_id"] == first["delta_id"], f"a repeated delta_begin made delta {again['delta_id']}")
        check(again["offset"] == len(data), f"a finished upload answers offset {again['offset']}")
        check(again["state"] in ("received", "accepted", "aggregated"), f"state {again['state']}")

    def delta_wrong_offset(self) -> None:
        data, signed = self._signed(salt=3, counter=3)
        sha = signed["envelope"]["sha256"]
        state = self._begin(signed)
        check(state["type"] == "delta_state" and state["offset"] == 0, f"delta_begin answered {state}")
        self.state.socket.send({"type": "delta_chunk", "sha256": sha, "offset": 7, "data": b64url(data[7:20])})
        error = self._answer(sha)
        check(error["type"] == "delta_error", f"a chunk at a wrong offset was answered {error}")
        check(error["code"] == "wrong_offset", f"code {error['code']}, expected wrong_offset")
        # The socket stays open: the upload goes on from the offset the server holds.
        self.state.socket.send({"type": "delta_chunk", "sha256": sha, "offset": 0, "data": b64url(data)})
        state = self._answer(sha)
        check(state["type"] == "delta_state" and state["state"] == "received", f"then answered {state}")

    def delta_hash_mismatch(self) -> None:
        data, signed = self._signed(salt=4, counter=4)
        wrong = data[:-1] + bytes([data[-1] ^ 0x01])  # same size, other bytes than the signed sha256
        sha = signed["envelope"]["sha256"]
        state = self._begin(signed)
        check(state["type"] == "delta_state" and state["offset"] == 0, f"delta_begin answered {state}")
        self.state.socket.send(self.state.client.chunk_frame(sha256=sha, offset=0, data=wrong))
        state = self._answer(sha)
        check(state["type"] == "delta_state", f"the last chunk was answered {state}")
        outcome, code = self._outcome(sha, state)
        check((outcome, code) == ("rejected", "hash_mismatch"), f"outcome {outcome} ({code}), expected hash_mismatch")

    def delta_replayed_counter(self) -> None:
        data, signed = self._signed(salt=5, counter=1)  # counter 1 was used by the first delta
        state = self._upload(data, signed, binary=True, final=("received", "rejected"))
        outcome, code = self._outcome(signed["envelope"]["sha256"], state)
        check((outcome, code) == ("rejected", "replayed_counter"), f"outcome {outcome} ({code})")

    def delta_refused_at_begin(self) -> str:
        """Refusals at the door: delta_error, the socket stays open, nothing was begun (a chunk is unknown)."""
        data, signed = self._signed(salt=6, counter=6)
        sha = signed["envelope"]["sha256"]
        forged = {**signed, "signature": self.state.client.sign({**signed["envelope"], "counter": 7})}
        error = self._begin(forged)  # a signature over another envelope
        check(error["type"] == "delta_error" and error["code"] == "bad_signature", f"answered {error}")
        year_ago = time.time() - 400 * 86400
        old = self.state.client.delta_upload(
            data, device_id=self.state.device_id, adapter=self.state.manifest["adapter"],
            base_version=self.state.manifest["version"], num_samples=10, counter=6, created_at=year_ago,
        )  # fmt: skip
        error = self._begin(old)
        check(error["type"] == "delta_error" and error["code"] == "bad_created_at", f"a year-old delta: {error}")
        self.state.socket.send({"type": "delta_chunk", "sha256": sha, "offset": 0, "data": b64url(data)})
        error = self._answer(sha)
        check(error["type"] == "delta_error" and error["code"] == "unknown_upload", f"then a chunk: {error}")
        return "bad_signature, bad_created_at; nothing begun"

    def delta_abort(self) -> str:
        data, signed = self._signed(salt=7, counter=8)
        sha = signed["envelope"]["sha256"]
        state = self._begin(signed)
        check(state["type"] == "delta_state" and state["state"] == "uploading", f"delta_begin answered {state}")
        self.state.socket.send(self.state.client.chunk_frame(sha256=sha, offset=0, data=data[:10]))
        check(self._answer(sha)["offset"] == 10, "the first chunk was not taken")
        abort = {"type": "delta_abort", "sha256": sha}
        self.schemas.validate("DeltaAbort", abort)
        self.state.socket.send(abort)
        state = self._answer(sha)
        check(state["type"] == "delta_state" and state["state"] == "aborted", f"delta_abort answered {state}")
        again = self._begin(signed)  # begun again from nothing: the staged bytes are gone
        check(again["type"] == "delta_state" and again["offset"] == 0, f"a new begin after the abort: {again}")
        self.state.socket.send({"type": "delta_abort", "sha256": sha})
        check(self._answer(sha)["state"] == "aborted", "the second abort")
        return "aborted, begun again from offset 0"

    def delta_result_after_reconnect(self) -> str:
        """A result the device did not acknowledge comes again after the next welcome, with the same id; once
        acknowledged, it does not."""
        data, signed = self._signed(salt=8, counter=9)
        sha = signed["envelope"]["sha256"]
        state = self._upload(data, signed, binary=True)
        self.state.socket.close()  # gone before the result could be told (or told, and not acknowledged)
        deadline = time.monotonic() + self.result_timeout
        while True:  # until verification is done: then the next hello brings the result
            socket, _ = self.hello()
            try:
                command = socket.expect(
                    lambda m: m.get("command") == "delta_result" and m["args"]["sha256"] == sha, "delta_result", 2
                )
                break
            except StepFailed:
                socket.close()
                check(time.monotonic() < deadline, "no delta_result came after reconnecting")
        check(command["id"] == f"delta-{state['delta_id']}", f"command id {command['id']!r}")
        socket.send({"type": "ack", "id": command["id"], "ok": True})
        socket.send({"type": "heartbeat", "seq": 1})  # the ack is handled before this heartbeat is answered
        socket.expect_type("heartbeat_ack")
        socket.close()
        socket, _ = self.hello()
        try:
            repeat = socket.expect(
                lambda m: m.get("command") == "delta_result" and m["args"]["sha256"] == sha, "delta_result", 1.5
            )
        except StepFailed:
            repeat = None
        check(repeat is None, "an acknowledged delta_result was sent again")
        self.state.socket = socket
        return f"re-sent as {command['id']} until acknowledged"


def run(
    server_url: str,
    client_factory: Callable[[], Client],
    operator: Operator,
    **options: Any,
) -> list[Result]:
    """Run every step against the server at ``server_url`` (http://host:port); see conformance/README.md."""
    return Suite(server_url, client_factory, operator, **options).run()
