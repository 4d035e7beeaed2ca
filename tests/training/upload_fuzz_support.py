"""The upload fuzzer's harness: the fleet it attacks, the request it sends, and how it judges each answer
(used by ``test_upload_fuzz.py``)."""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import struct
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from urllib.parse import quote

import torch
from django.db import transaction
from safetensors.torch import load as load_safetensors

from edge_agent.delta import sign_delta
from edge_agent.protocol import b64encode
from edge_agent.safetensors_header import loads_noting_repeats, repeat_refusal
from training.federation.intake import upload_state
from training.federation.verification import delta_verify
from training.models import Delta
from training.registry.artifacts import MAX_HEADER_BYTES, MAX_TENSORS

SEED = 20_240_611
CREATED_AT = 1_700_000_000.5
CONTROL_COUNTER = 1
SMALL_LIMIT = 16 * 1024  # DELTA_MAX_BYTES for the oversized family: above the control (9 KiB), cheap to exceed
# Uploads per family. Refusals at the door cost a few milliseconds, uploads that reach verification several
# times that: the split keeps the module within a few minutes on two cores.
QUOTAS = {
    "envelope_bits": 2200,
    "envelope_fields": 900,
    "signature_bits": 800,
    "body_bits_unsigned": 800,
    "body_bits_signed": 700,
    "swapped_device": 700,
    "replay": 500,
    "truncated": 600,
    "oversized": 400,
    "header_bomb": 400,
    "dtype_shape": 500,
    "non_finite": 600,
    "url_sha": 1100,
}
# Checks that come before the counter is claimed (README.md, "Deltas, verification and rounds"): failing one
# never uses up a counter.
UNCLAIMED_CODES = {
    "too_large",
    "hash_mismatch",
    "bad_signature",
    "device_not_active",
    "unknown_adapter",
    "wrong_cohort",
}
_CODE = re.compile(r"^[a-z][a-z0-9_]{2,40}$")
SUMMARY: dict[str, dict[str, Counter]] = {}


class Bug(AssertionError):
    """The server did something no mutated upload may cause."""


def framed(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def split(data: bytes) -> tuple[dict, bytes]:
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def flip_bits(data: bytes, rng: random.Random, *, flips: int, start: int = 0, end: int | None = None) -> bytes:
    out = bytearray(data)
    end = len(out) if end is None else end
    for _ in range(flips):
        position = rng.randrange(start, end)
        out[position] ^= 1 << rng.randrange(8)
    return bytes(out)


def flip_text(text: str, rng: random.Random, *, flips: int) -> str:
    """Bit flips in a header value, kept within the 8-bit characters an HTTP header can carry."""
    return flip_bits(text.encode("latin-1"), rng, flips=flips).decode("latin-1")


def still_a_valid_delta(data: bytes, spec: dict, bound: float) -> bool:
    """The format's own reading, independent of the server's checks: safetensors loads the file, the names,
    shapes and dtypes are the adapter's for the declared encoding, every value is finite and the norm is within
    the bound. A signed mutant that passes this is a legitimate delta, not an attack, and is drawn again."""
    try:
        header, _ = split(data)
        if int.from_bytes(data[:8], "little") > MAX_HEADER_BYTES or len(header) > MAX_TENSORS + 1:
            return False  # the documented limits ("the safetensors header parses within limits")
        if repeat_refusal(loads_noting_repeats(data[8 : 8 + int.from_bytes(data[:8], "little")])[1]):
            return False  # a tensor or key named twice: which entry counts is the reader's guess
        tensors = load_safetensors(data)
        metadata = header.get("__metadata__") or {}
        encoding = metadata.get("encoding", "f32")
        dtype = {"f32": torch.float32, "f16": torch.float16, "int8": torch.int8}[encoding]
        scales = json.loads(metadata["scales"]) if encoding == "int8" else {}
    except Exception:
        return False
    if set(tensors) != set(spec) or (encoding == "int8" and set(scales) != set(tensors)):
        return False
    squares = 0.0
    for name, raw in tensors.items():
        if list(raw.shape) != list(spec[name]["shape"]) or raw.dtype != dtype:
            return False
        scale = scales.get(name, 1.0)
        if not isinstance(scale, int | float) or isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0:
            return False
        value = raw.to(torch.float32) * scale
        if not bool(torch.isfinite(value).all()):
            return False
        squares += float(value.double().square().sum())
    return math.sqrt(squares) <= bound


@dataclass
class Fleet:
    """One adapter trained by one cohort, three enrolled devices with REST tokens, and the accepted control."""

    adapter: object
    a: object  # the device that uploads
    b: object  # another enrolled device, for identity swaps
    quarantined: object  # enrolled, got a token, then quarantined by an operator
    clients: dict
    good: bytes  # the control's bytes
    control: Delta
    bound: float


def envelope_text(signed: dict) -> str:
    return b64encode(json.dumps(signed["envelope"]).encode())


def put(client, body: bytes, url_sha: str, envelope: str, signature: str, **headers):
    return client.put(
        f"/api/v1/device/deltas/{quote(url_sha, safe='')}/",  # a client escapes what it puts in a path
        data=body,
        content_type="application/octet-stream",
        HTTP_X_DELTA_ENVELOPE=envelope,
        HTTP_X_DELTA_SIGNATURE=signature,
        **headers,
    )


@dataclass
class Harness:
    """Sends mutants, judges each outcome, and keeps the tally and every failure (so one run shows them all)."""

    fleet: Fleet
    rng: random.Random
    tally: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    failures: list[str] = field(default_factory=list)
    sent: set[str] = field(default_factory=set)  # sha256 of every signed mutant, so none is a repeat
    seen: set[int] = field(default_factory=set)
    counter: int = 1000
    fresh_index: int = 0
    redraws: int = 0
    partials: int = 0

    # --- building uploads ---------------------------------------------------------------------------------

    def sign(self, data: bytes, *, key=None, device=None, counter=None, **overrides) -> dict:
        """An envelope for ``data`` as a device signs it (by default device A with its own key, a new counter)."""
        device = device or self.fleet.a
        if counter is None:
            self.counter += 1
            counter = self.counter
        fields = {"adapter": self.fleet.adapter.name, "base_version": 1, "num_samples": 32, **overrides}
        return sign_delta(
            key or device.key, data, device_id=device.id, counter=counter, created_at=CREATED_AT, **fields
        )

    def fresh(self) -> bytes:
        """A good delta no one uploaded yet: the control with its last value changed to a new tiny number."""
        self.fresh_index += 1
        return self.fleet.good[:-4] + struct.pack("<f", self.fresh_index * 1e-7)

    def new_signed_mutant(self, make) -> bytes:
        """``make()`` until it gives a file that is not a valid delta and was not sent before."""
        for _ in range(200):
            data = make()
            digest = hashlib.sha256(data).hexdigest()
            if digest not in self.sent and not still_a_valid_delta(
                data, self.fleet.adapter.tensor_spec, self.fleet.bound
            ):
                self.sent.add(digest)
                return data
            self.redraws += 1
        raise AssertionError("no invalid mutant in 200 draws: the mutation is too gentle")

    def client(self, device=None):
        return self.fleet.clients[(device or self.fleet.a).id]

    # --- sending and judging ------------------------------------------------------------------------------

    def send_signed(self, kind: str, data: bytes, **sign_overrides) -> None:
        signed = self.sign(data, **sign_overrides)
        self.send(kind, data, envelope_text(signed), signed["signature"], signed["envelope"]["sha256"])

    def send(self, kind, body, envelope, signature, url_sha, *, device=None, headers=None, resume=None) -> None:
        """One mutated upload; ``resume`` is what the device sends after a partial upload (junk by default)."""
        device = device or self.fleet.a
        try:
            with transaction.atomic():  # a server failure must not poison the rest of the run
                outcome = self._attempt(body, envelope, signature, url_sha, device, headers or {}, resume)
        except Exception as exc:
            outcome = f"FAILED: {type(exc).__name__}"
            where = "".join(traceback.format_exception(exc)[-3:])
            self.failures.append(f"[{kind}] {type(exc).__name__}: {str(exc)[:300]}\n{where}")
        self.tally[kind][outcome] += 1

    def _attempt(self, body, envelope, signature, url_sha, device, headers, resume) -> str:
        client = self.client(device)
        response = put(client, body, url_sha, envelope, signature, **headers)
        outcome = self._judge(response)
        if outcome == "uploading":  # the bytes so far are held for a resume: send the rest
            state = response.json()
            rest = resume if resume is not None else self.rng.randbytes(state["size"] - state["offset"])
            end = state["offset"] + len(rest) - 1
            response = put(
                client,
                rest,
                url_sha,
                envelope,
                signature,
                HTTP_CONTENT_RANGE=f"bytes {state['offset']}-{end}/{state['size']}",
            )
            outcome = "partial, then " + self._judge(response)
            if outcome.endswith("uploading"):
                raise Bug("a resumed upload was still incomplete after all its bytes")
        elif response.status_code in (409, 413):
            # Refused after the upload began (a wrong offset, a body over the limit): the envelope's upload stays
            # open for a resume, as it should; finish it with junk so it does not hold one of the device's slots.
            staged = upload_state(device=device.device, sha256=url_sha)
            if staged is not None and staged.delta is None:
                self.partials += 1
                filler = self.rng.randbytes(staged.size - staged.offset)
                range_ = f"bytes {staged.offset}-{staged.size - 1}/{staged.size}"
                closing = self._judge(put(client, filler, url_sha, envelope, signature, HTTP_CONTENT_RANGE=range_))
                if closing == "uploading":
                    raise Bug("could not finish a refused upload's open partial")
        return outcome

    def _judge(self, response) -> str:
        if response.status_code >= 500:
            raise Bug(f"HTTP {response.status_code}: {response.content[:300]!r}")
        if response.headers.get("Content-Type") != "application/json":
            raise Bug(f"HTTP {response.status_code} {response.request['PATH_INFO']!r}: {response.content[:200]!r}")
        body = response.json()
        if response.status_code >= 400:
            error = body.get("error") or {}
            readable(error.get("code"), error.get("message"))
            return f"HTTP {response.status_code} {error['code']}"
        if response.status_code not in (200, 201):
            raise Bug(f"unexpected HTTP {response.status_code}: {body}")
        if body["state"] == "uploading":
            return "uploading"
        delta = Delta.objects.get(pk=body["delta_id"])
        if delta.pk == self.fleet.control.pk:
            if body["state"] != "accepted":
                raise Bug(f"the control was reported {body['state']}")
            return "acknowledged as the control: no_op"
        repeat = "repeat of " if delta.pk in self.seen else ""
        self.seen.add(delta.pk)
        where = "stored at upload"
        if delta.state == Delta.State.RECEIVED:
            delta, where = delta_verify(delta_id=delta.pk), "verified"
        elif body["rejection_code"] != delta.rejection_code or body["rejection_detail"] != delta.rejection_detail:
            raise Bug(f"the response says {body['rejection_code']!r}, the delta {delta.rejection_code!r}")
        if delta.state != Delta.State.REJECTED:
            raise Bug(f"delta {delta.pk} ended {delta.state} (code {delta.rejection_code!r})")
        readable(delta.rejection_code, delta.rejection_detail)
        if delta.round_id is not None:
            raise Bug(f"rejected delta {delta.pk} is in round {delta.round_id}")
        if delta.counter_claimed and delta.rejection_code in UNCLAIMED_CODES:
            raise Bug(f"delta {delta.pk} rejected as {delta.rejection_code} claimed counter {delta.counter}")
        return f"{repeat}{where}: {delta.rejection_code}"


def readable(code, message) -> None:
    """A stable code and a sentence a person can act on."""
    if not isinstance(code, str) or not _CODE.match(code):
        raise Bug(f"no usable rejection code: {code!r} ({message!r})")
    if not isinstance(message, str) or len(message) < 10 or " " not in message.strip():
        raise Bug(f"rejection {code} has no readable message: {message!r}")
