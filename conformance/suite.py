"""Drive a live server through the device flow with a ``Client``, checking every server message against its
JSON Schema (docs/protocol/schemas). ``run(...)`` returns one ``Result`` per step and prints a line for each.
The transport and the schema checks are in ``conformance.transport``, the delta steps in
``conformance.delta_steps``, the refusals at the server's edges (weak keys, deep JSON, control characters) in
``conformance.edge_steps``.

Only the standard library, ``websockets`` and ``jsonschema`` here (and conformance.client).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from conformance.client import Client
from conformance.delta_steps import DeltaSteps
from conformance.edge_steps import EdgeSteps
from conformance.transport import SCHEMA_DIR, Http, Schemas, Socket, StepFailed, check, safetensors_tensors

__all__ = ["SCHEMA_DIR", "Operator", "Result", "Schemas", "Suite", "run"]


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


class Suite(DeltaSteps, EdgeSteps):
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
            s("enroll_weak_keys", self.enroll_weak_keys)
            s("enroll_too_deep", self.enroll_too_deep)
            s("enroll_control_characters", self.enroll_control_characters)
            s("rest_token", self.rest_token, "enroll")
            s("rest_device_and_heartbeat", self.rest_device_and_heartbeat, "rest_token")
            s("socket_handshake", self.socket_handshake, "enroll")
            s("socket_wrong_signature", self.socket_wrong_signature, "enroll")
            s("socket_oversized_before_hello", self.socket_oversized_before_hello, "enroll")
            s("socket_too_deep_before_hello", self.socket_too_deep_before_hello, "enroll")
            s("socket_control_characters_in_hello", self.socket_control_characters_in_hello, "enroll")
            s("chunk_header_unlisted_field", self.chunk_header_unlisted_field, "socket_handshake")
            s("chunk_frame_too_large", self.chunk_frame_too_large, "socket_handshake")
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


def run(
    server_url: str,
    client_factory: Callable[[], Client],
    operator: Operator,
    **options: Any,
) -> list[Result]:
    """Run every step against the server at ``server_url`` (http://host:port); see conformance/README.md."""
    return Suite(server_url, client_factory, operator, **options).run()
