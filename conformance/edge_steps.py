"""The conformance suite's steps at the server's edges: what it must refuse however it arrives (docs/protocol/
README.md, "Enrollment" and "Encodings"). Every public key of vectors/weak-keys.json is refused at enrollment
with its reason; JSON nested deeper than 64 levels is refused over REST and on the socket; a name with a
character screens and logs act on is refused, at enrollment and in a hello; a binary chunk frame whose header has a
field the protocol does not list, or that carries more than 512 KiB of the file, closes the socket (4400, 4413).

``EdgeSteps`` is a part of ``conformance.suite.Suite``: it uses the suite's state, operator and sockets.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conformance.client import Client
from conformance.transport import SCHEMA_DIR, Http, Socket, check

if TYPE_CHECKING:  # for the annotation only: conformance.suite imports this module (Suite extends EdgeSteps)
    from conformance.suite import Operator, State

WEAK_KEYS = SCHEMA_DIR.parent / "vectors" / "weak-keys.json"
MAX_JSON_DEPTH = 64
CHUNK_BYTES = 512 * 1024  # the most of the file one binary chunk frame may carry (reference.md, "Limits")


def _too_deep(prefix: str, levels: int) -> str:
    """A JSON object whose field after ``prefix`` nests ``levels`` arrays."""
    return "{" + prefix + "[" * levels + "]" * levels + "}"


class EdgeSteps:
    """The edge steps of ``Suite`` (which provides these attributes, ``open_socket`` and ``client_factory``)."""

    state: State
    http: Http
    operator: Operator
    client_factory: Callable[[], Client]
    open_socket: Callable[[], tuple[Socket, dict[str, Any]]]

    def _enroll_refused(self, body: dict[str, Any] | bytes) -> dict[str, Any]:
        status, _, raw = self.http.request("POST", "/api/v1/enroll/", body)
        check(status == 400, f"HTTP {status}, expected 400: {raw[:300]!r}")
        error = json.loads(raw).get("error") or {}
        check({"code", "message", "details"} <= set(error), f"not the documented error body: {raw[:300]!r}")
        return error

    def enroll_weak_keys(self, vectors: Path = WEAK_KEYS) -> str:
        weak = json.loads(vectors.read_text())["keys"]
        token = self.operator.enrollment_token()
        for key in weak:
            body = {"token": token, "public_key": key["public_key"], "name": f"conformance-{uuid.uuid4().hex[:8]}"}
            error = self._enroll_refused(body)
            what = f"the public key {key['hex']} ({key['is']})"
            check(error["code"] == "invalid_public_key", f"{what}: code {error['code']!r}, not invalid_public_key")
            check(
                error["details"].get("reason") == key["reason"],
                f"{what}: reason {error['details'].get('reason')!r}, expected {key['reason']!r}",
            )
        return f"{len(weak)} keys refused, each for its reason"

    def enroll_too_deep(self) -> None:
        body = _too_deep('"token": "x", "public_key": "x", "name": ', 2 * MAX_JSON_DEPTH).encode()
        error = self._enroll_refused(body)
        check(error["code"] == "json_too_deep", f"code {error['code']!r}, expected json_too_deep")
        check(error["details"].get("max_depth") == MAX_JSON_DEPTH, f"details {error['details']}, max_depth 64")

    def enroll_control_characters(self) -> str:
        token = self.operator.enrollment_token()
        names = {"U+202E": "phone\u202egpj.exe", "ESC": "phone\x1b[31m", "LF": "phone\nlogin: admin"}
        for what, name in names.items():
            body = {"token": token, "public_key": self.client_factory().public_key(), "name": name}
            error = self._enroll_refused(body)
            check("name" in error["details"], f"a name with {what}: the error does not name the field: {error}")
        return f"names with {', '.join(names)} refused"

    def socket_too_deep_before_hello(self) -> str:
        socket, _ = self.open_socket()
        try:
            frame = _too_deep('"type": "hello", "pad": ', 2000)  # under 4 KiB: the depth refuses it, not the size
            check(len(frame.encode()) < 4096, "the test frame is not what it should be")
            socket.send(frame)
            code, received = socket.expect_close()
        finally:
            socket.close()
        errors = [m for m in received if m["type"] == "error"]
        check(errors and errors[0]["code"] == "malformed", f"expected an error malformed, got {received}")
        check(code == 4400, f"closed with {code}, expected 4400")
        return "2,000 levels: 4400"

    def socket_control_characters_in_hello(self) -> None:
        socket, challenge = self.open_socket()
        try:
            hello = self.state.client.hello(nonce=challenge["nonce"], device_id=self.state.device_id)
            socket.send({**hello, "agent_version": "1.0\x1b[2J"})  # agent_version is not signed: the server's check
            code, received = socket.expect_close()
        finally:
            socket.close()
        errors = [m for m in received if m["type"] == "error"]
        check(errors and errors[0]["code"] == "malformed", f"expected an error malformed, got {received}")
        check(code == 4400, f"closed with {code}, expected 4400")

    def _chunk_frame_refused(self, header: dict[str, Any], data: bytes) -> tuple[int | None, list[dict[str, Any]]]:
        """Send one binary chunk frame with ``header`` and ``data`` after a hello; the close code and messages."""
        socket, _ = self.hello()
        try:
            raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
            socket.send(b"FPD1" + len(raw).to_bytes(2, "big") + raw + data)
            return socket.expect_close()
        finally:
            socket.close()

    def chunk_header_unlisted_field(self) -> str:
        header = {"offset": 0, "sha256": "0" * 64, "note": "x"}
        code, received = self._chunk_frame_refused(header, b"data")
        errors = [m for m in received if m["type"] == "error"]
        check(errors and errors[0]["code"] == "malformed", f"expected an error malformed, got {received}")
        check(code == 4400, f"closed with {code}, expected 4400")
        return "a header with an unlisted field: 4400"

    def chunk_frame_too_large(self) -> str:
        header = {"offset": 0, "sha256": "0" * 64}  # a short header: the frame stays under the frame limit
        code, received = self._chunk_frame_refused(header, b"\0" * (CHUNK_BYTES + 1))
        errors = [m for m in received if m["type"] == "error"]
        check(errors and errors[0]["code"] == "too_large", f"expected an error too_large, got {received}")
        check(code == 4413, f"closed with {code}, expected 4413")
        return f"{CHUNK_BYTES + 1} bytes of file in one frame: 4413"
