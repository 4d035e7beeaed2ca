"""The conformance suite's delta steps: uploads over the socket in binary and text frames, and the ways a
server must refuse one (a repeated begin, a wrong offset, a wrong hash, a replayed counter, a refusal at begin,
an abort), then the delta's result, re-sent after a reconnect until acknowledged (docs/protocol/README.md).

``DeltaSteps`` is a part of ``conformance.suite.Suite``: it uses the suite's state, schemas and session.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from typing import TYPE_CHECKING, Any

from conformance.client import b64url
from conformance.transport import Http, Schemas, StepFailed, check, safetensors_tensors, small_tensors

if TYPE_CHECKING:  # for the annotation only: conformance.suite imports this module (Suite extends DeltaSteps)
    from conformance.suite import State


class DeltaSteps:
    """The delta steps of ``Suite`` (which provides these attributes and ``hello``)."""

    state: State
    http: Http
    schemas: Schemas
    chunk_size: int
    result_timeout: float

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
