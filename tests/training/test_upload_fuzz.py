"""Fuzzing the delta upload: over 10,000 deterministically mutated uploads through the real REST endpoint
(``PUT /api/v1/device/deltas/<sha256>/``) and the real verification service (``delta_verify``, run in process).

Proven for every mutated upload: it is not accepted; the server does not fail (no 5xx, no unhandled exception);
and the device is told why, with a stable code and a sentence, either in the HTTP error body or as the delta's
stored rejection code and detail. The one answer that is not a rejection is by design: a resend of the accepted
control's own signed envelope is acknowledged as the control (the server has that file and reads no further),
which changes nothing. Proven for the fleet after each family of mutations: the only accepted delta
is the family's positive control (a good upload, accepted first, so the harness can be seen to accept and replays
have something to replay), only the control is counted in a round, and no envelope the device did not sign
itself has claimed one of its counters.

The mutations are those of an attacker or a broken device: bit flips in the envelope, the signature and the
file; another device's identity; replays; truncated and oversized bodies; header bombs; wrong dtypes and shapes;
NaN and Inf; a URL naming another file. A mutant the format still allows (a flip that changes nothing the
server reads, or a signed file that is still a valid delta) is drawn again, so every counted upload is one the
server must refuse. Seeds are fixed, so the mutations are the same every run; the devices' ids and keys are new
each run, so the flipped envelope and signature bytes (and a few outcomes among them) vary slightly. ``pytest -s``
prints the outcomes per kind and code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import re
import struct
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from urllib.parse import quote

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.db import transaction
from rest_framework.test import APIClient
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from edge_agent.delta import encode_delta, sign_delta
from edge_agent.protocol import b64decode, b64encode, public_key_from_b64, verify
from tests.training.test_delta_verification import small_delta
from training.aggregation_settings import aggregation_settings
from training.artifacts import MAX_HEADER_BYTES, MAX_TENSORS
from training.intake import upload_state
from training.models import Delta
from training.services import version_create_seeded
from training.verification import delta_verify

pytestmark = pytest.mark.django_db

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
# Checks that come before the counter is claimed (DESIGN.md "Verification"): failing one never uses up a counter.
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


@pytest.fixture
def fleet(adapter, cohort, enrolled, device_token):
    from devices.models import Device

    adapter.cohorts.add(cohort)
    version_create_seeded(adapter=adapter, seed=3)
    a, b, quarantined = enrolled("active", name="a"), enrolled("active", name="b"), enrolled("active", name="q")
    clients = {}
    for device in (a, b, quarantined):
        clients[device.id] = APIClient()
        clients[device.id].credentials(HTTP_AUTHORIZATION=f"Device {device_token(device)}")
    Device.objects.filter(pk=quarantined.device.pk).update(status="quarantined")
    good = encode_delta(small_delta(adapter))
    signed = sign_delta(
        a.key, good, device_id=a.id, adapter=adapter.name, base_version=1, num_samples=32, counter=CONTROL_COUNTER
    )
    response = put(clients[a.id], good, signed["envelope"]["sha256"], envelope_text(signed), signed["signature"])
    assert response.status_code == 201, response.content
    control = delta_verify(delta_id=response.json()["delta_id"])
    assert control.state == Delta.State.ACCEPTED and control.round_id is not None, control.rejection_detail
    return Fleet(adapter, a, b, quarantined, clients, good, control, aggregation_settings(adapter)["max_norm"])


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


# --- the families of mutations ------------------------------------------------------------------------------


def envelope_bits(h: Harness, n: int) -> None:
    """Bit flips in the envelope's JSON or in its base64 text; the URL names the original or the flipped sha256."""
    for _ in range(n):
        data = h.fresh()
        signed = h.sign(data)
        raw = json.dumps(signed["envelope"]).encode()
        while True:
            flips = h.rng.choice((1, 1, 2, 3, 4))
            if h.rng.random() < 0.6:
                kind, text = "envelope_bits/json", b64encode(flip_bits(raw, h.rng, flips=flips))
            else:
                kind, text = "envelope_bits/base64", flip_text(envelope_text(signed), h.rng, flips=flips)
            decoded = _decoded(text)
            if decoded != signed["envelope"]:
                break
            h.redraws += 1  # the flip changed nothing the server reads (e.g. a base64 padding bit)
        url = signed["envelope"]["sha256"]
        if isinstance(decoded, dict) and isinstance(decoded.get("sha256"), str) and h.rng.random() < 0.5:
            url = decoded["sha256"]  # follow the flipped sha256, so the URL check does not catch it first
        h.send(kind, data, text, signed["signature"], url)


def _decoded(text: str):
    try:
        return json.loads(b64decode(text))
    except Exception:
        return None


def envelope_fields(h: Harness, n: int) -> None:
    """Fields of the wrong type or out of range, missing or extra fields, non-objects, oversized and deeply
    nested envelopes, characters a database cannot store; metrics headers that are bombs of their own."""
    bad_values = {
        "purpose": ["delta", "", None, 1],
        "device_id": [None, 1, "", "x" * 65, " ", "a\u0000b", "\ud800"],
        "adapter": [None, 1, "", "x" * 65, "lora\u0000", "lora\ud800", "\udfff", "\x07bell", ["digits-lora"]],
        "base_version": [0, -1, 2**31, "1", 1.5, True, None],
        "size": [0, -1, 2**62, "9120", 9120.5, False, None],
        "num_samples": [0, -5, 2**31, "32", None, 3.2],
        "counter": [-1, 2**62, "1001", 1.0, True, None, [1]],
        "created_at": ["now", None, True, [1], {"t": 1}],
    }
    shapes = (
        "value",
        "value",
        "value",
        "missing",
        "extra",
        "not_an_object",
        "too_long",
        "nested",
        "non_finite_time",
        "metrics",
    )
    for _ in range(n):
        data = h.fresh()
        signed = h.sign(data)
        envelope, sha = dict(signed["envelope"]), signed["envelope"]["sha256"]
        shape = h.rng.choice(shapes)
        headers = {}
        if shape == "value":
            name = h.rng.choice(sorted(bad_values))
            envelope[name] = h.rng.choice(bad_values[name])
            text = b64encode(json.dumps(envelope).encode())
        elif shape == "missing":
            del envelope[h.rng.choice(sorted(envelope))]
            text = b64encode(json.dumps(envelope).encode())
        elif shape == "extra":
            envelope[h.rng.choice(["extra", "sha256 ", "Counter", "\u0000", "metrics"])] = h.rng.randrange(9)
            text = b64encode(json.dumps(envelope).encode())
        elif shape == "not_an_object":
            value = h.rng.choice([[envelope], "envelope", 1, None, True, [], "", 1e308])
            text = b64encode(json.dumps(value).encode())
        elif shape == "too_long":
            envelope["adapter"] = "x" * h.rng.randrange(3000, 9000)
            text = b64encode(json.dumps(envelope).encode())
        elif shape == "nested":
            depth = h.rng.randrange(900, 3000)
            opener = h.rng.choice(["[", '{"a":', '{"purpose":['])
            text = b64encode((opener * depth).encode()[:3000])
        elif shape == "non_finite_time":
            raw = json.dumps(envelope).replace(json.dumps(CREATED_AT), h.rng.choice(["NaN", "Infinity", "-Infinity"]))
            text = b64encode(raw.encode())
        else:  # a well-formed envelope with a forged signature, carrying a hostile metrics header
            text = envelope_text(signed)
            signed = {**signed, "signature": h.sign(data, key=Ed25519PrivateKey.generate())["signature"]}
            headers["HTTP_X_DELTA_METRICS"] = h.rng.choice(
                [
                    "[" * h.rng.randrange(1000, 20000),
                    '{"a":' * h.rng.randrange(1000, 5000),
                    '{"loss": NaN}',
                    '{"loss": Infinity, "acc": -Infinity}',
                    '{"note": "a\\u0000b"}',
                    '{"note": "\\ud800"}',
                    '{"\\u0000": 1}',
                    '{"\\udfff": "x"}',
                    json.dumps({f"k{i}": "v" * 50 for i in range(100)}),
                    "not json",
                    '"a string"',
                ]
            )
        h.send(f"envelope_fields/{shape}", data, text, signed["signature"], sha, headers=headers)


def signature_bits(h: Harness, n: int) -> None:
    """Bit flips in the signature's text or its bytes, and signatures cut short, stretched, empty or foreign."""
    for _ in range(n):
        data = h.fresh()
        signed = h.sign(data)
        original = signed["signature"]
        while True:
            shape = h.rng.choice(("text", "text", "bytes", "bytes", "length"))
            if shape == "text":
                signature = flip_text(original, h.rng, flips=h.rng.choice((1, 1, 2, 3)))
            elif shape == "bytes":
                signature = b64encode(flip_bits(b64decode(original), h.rng, flips=h.rng.choice((1, 2, 8))))
            else:
                signature = h.rng.choice(
                    [
                        original[: h.rng.randrange(len(original))],
                        original + h.rng.choice("Aa0_-"),
                        original * 2,
                        "",
                        "=" * 86,
                        original[:-2] + "==",
                        original[:40] + "\x00" + original[41:],  # NUL: no database text column can store it
                        original[:40] + "\xe9" + original[41:],
                        b64encode(h.rng.randbytes(64)),
                        b64encode(h.rng.randbytes(h.rng.randrange(1, 96))),
                    ]
                )
            if not _same_signature(signature, original):
                break
            h.redraws += 1
        h.send(f"signature_bits/{shape}", data, envelope_text(signed), signature, signed["envelope"]["sha256"])


def _same_signature(candidate: str, original: str) -> bool:
    try:
        return b64decode(candidate) == b64decode(original)
    except ValueError:
        return False


def body_bits_unsigned(h: Harness, n: int) -> None:
    """Bit flips in the file (header or data) after the device signed it: the bytes no longer match."""
    for _ in range(n):
        data = h.fresh()
        signed = h.sign(data)
        header_end = 8 + int.from_bytes(data[:8], "little")
        region = h.rng.choice(("header", "data", "data"))
        start, end = (0, header_end) if region == "header" else (header_end, len(data))
        mutant = data
        while mutant == data:
            mutant = flip_bits(data, h.rng, flips=h.rng.choice((1, 1, 2, 4, 8)), start=start, end=end)
        h.send(
            f"body_bits_unsigned/{region}",
            mutant,
            envelope_text(signed),
            signed["signature"],
            signed["envelope"]["sha256"],
        )


def body_bits_signed(h: Harness, n: int) -> None:
    """Bit flips in the file before the device signs it (a broken or hostile device): the header, or the top
    exponent bits of a value. Only flips that leave an invalid delta count."""
    header_end = 8 + int.from_bytes(h.fleet.good[:8], "little")
    values = (len(h.fleet.good) - header_end) // 4
    for _ in range(n):
        region = h.rng.choice(("header", "header", "length_prefix", "exponent"))

        def make(region=region):
            data = h.fresh()
            if region == "header":
                return flip_bits(data, h.rng, flips=h.rng.choice((1, 1, 2, 3)), start=8, end=header_end)
            if region == "length_prefix":
                return flip_bits(data, h.rng, flips=h.rng.choice((1, 2)), start=0, end=8)
            out = bytearray(data)
            for _ in range(h.rng.choice((1, 1, 3))):
                at = header_end + 4 * h.rng.randrange(values)
                bits = struct.unpack("<I", out[at : at + 4])[0] ^ (1 << h.rng.randrange(27, 31))
                out[at : at + 4] = struct.pack("<I", bits)
            return bytes(out)

        h.send_signed(f"body_bits_signed/{region}", h.new_signed_mutant(make))


def swapped_device(h: Harness, n: int) -> None:
    """Another enrolled device's identity: in the envelope, in the key, or in the authenticated request."""
    a, b, q = h.fleet.a, h.fleet.b, h.fleet.quarantined
    shapes = ("a_claims_b", "a_sends_bs_envelope", "b_sends_as_envelope", "b_claims_b_signed_by_a", "unknown_id")
    for _ in range(n):
        data = h.fresh()
        shape = h.rng.choice((*shapes, "quarantined_device"))
        device = a
        if shape == "a_claims_b":
            signed = h.sign(data, device=b, key=a.key)
        elif shape == "a_sends_bs_envelope":
            signed = h.sign(data, device=b)
        elif shape == "b_sends_as_envelope":
            signed, device = h.sign(data), b
        elif shape == "b_claims_b_signed_by_a":
            signed, device = h.sign(data, device=b, key=a.key), b
        elif shape == "unknown_id":
            signed = h.sign(data)
            other = h.rng.choice(["0", "1", f" {a.id}", a.id.upper(), a.id.replace("-", ""), f"{{{a.id}}}", a.id[:-1]])
            envelope = {**signed["envelope"], "device_id": other}
            signed = {"envelope": envelope, "signature": signed["signature"]}
        else:
            signed, device = h.sign(data, device=q), q
        h.send(
            f"swapped_device/{shape}",
            data,
            envelope_text(signed),
            signed["signature"],
            signed["envelope"]["sha256"],
            device=device,
        )


def replay(h: Harness, n: int) -> None:
    """The accepted control's envelope resent with a new body, re-pointed at a new file, through another
    device, or a new file signed with the control's counter."""
    control = h.fleet.control
    envelope, signature, sha = b64encode(json.dumps(control.envelope).encode()), control.signature, control.sha256
    for _ in range(n):
        data = h.fresh()
        shape = h.rng.choice(
            ("new_body", "new_body_new_url", "repointed_envelope", "reused_counter", "reused_counter", "via_b", "exact")
        )
        if shape == "new_body":  # acknowledged as the control: the server has that file and reads no further
            body = h.rng.choice([data, h.rng.randbytes(h.rng.randrange(1, 20000)), b""])
            h.send(f"replay/{shape}", body, envelope, signature, sha)
        elif shape == "new_body_new_url":
            h.send(f"replay/{shape}", data, envelope, signature, hashlib.sha256(data).hexdigest())
        elif shape == "repointed_envelope":
            forged = {**control.envelope, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
            h.send(f"replay/{shape}", data, b64encode(json.dumps(forged).encode()), signature, forged["sha256"])
        elif shape == "reused_counter":
            h.send_signed(f"replay/{shape}", data, counter=CONTROL_COUNTER)
        elif shape == "via_b":
            h.send(f"replay/{shape}", h.fleet.good, envelope, signature, sha, device=h.fleet.b)
        else:
            h.send(f"replay/{shape}", h.fleet.good, envelope, signature, sha)


def truncated(h: Harness, n: int) -> None:
    """Bodies cut short: resumed with junk or with too much, signed as cut, or with a lying Content-Range."""
    for _ in range(n):
        data = h.fresh()
        cut = h.rng.choice((0, h.rng.randrange(1, 8), h.rng.randrange(8, 700), h.rng.randrange(len(data))))
        shape = h.rng.choice(("resumed_with_junk", "resumed_with_too_much", "signed_as_cut", "lying_range"))
        signed = h.sign(data)
        text, signature, sha = envelope_text(signed), signed["signature"], signed["envelope"]["sha256"]
        if shape == "resumed_with_junk":
            h.send(f"truncated/{shape}", data[:cut], text, signature, sha)
        elif shape == "resumed_with_too_much":
            rest = data[cut:] + h.rng.randbytes(h.rng.randrange(1, 5000))
            h.send(f"truncated/{shape}", data[:cut], text, signature, sha, resume=rest)
        elif shape == "signed_as_cut":

            def make():
                data = h.fresh()
                return data[: h.rng.choice((h.rng.randrange(1, 8), h.rng.randrange(8, 700), h.rng.randrange(9000)))]

            h.send_signed(f"truncated/{shape}", h.new_signed_mutant(make))
        else:
            start = h.rng.randrange(1, len(data))
            total = h.rng.choice((len(data), len(data) + 1, len(data) - 1, 0, 2**63))
            form = h.rng.choice(("bytes {s}-{e}/{t}", "bytes {s}-{e}/*", "{s}-{e}/{t}", "bytes {s}-{e}/{t}x"))
            range_ = form.format(s=start, e=len(data) - 1, t=total)
            h.send(f"truncated/{shape}", data[start:], text, signature, sha, headers={"HTTP_CONTENT_RANGE": range_})


def oversized(h: Harness, n: int) -> None:
    """Files above DELTA_MAX_BYTES, declared honestly or not, and bodies longer than their envelope says."""
    limit = SMALL_LIMIT
    for _ in range(n):
        shape = h.rng.choice(("honest_envelope", "declared_huge", "body_past_declared", "body_past_limit"))
        if shape == "honest_envelope":
            data = h.fresh() + h.rng.randbytes(h.rng.randrange(limit - 9000, 3 * limit))
            h.send_signed(f"oversized/{shape}", data)
            continue
        data = h.fresh()
        signed = h.sign(data)
        if shape == "declared_huge":
            size = h.rng.choice((limit + 1, 2 * limit, 2**31, 2**62 - 1))
            forged = {**signed["envelope"], "size": size}
            h.send(
                f"oversized/{shape}",
                data,
                b64encode(json.dumps(forged).encode()),
                signed["signature"],
                forged["sha256"],
            )
            continue
        extra = h.rng.randrange(1, 4000) if shape == "body_past_declared" else h.rng.randrange(limit, 2 * limit)
        h.send(
            f"oversized/{shape}",
            data + h.rng.randbytes(extra),
            envelope_text(signed),
            signed["signature"],
            signed["envelope"]["sha256"],
        )


def header_bomb(h: Harness, n: int) -> None:
    """Safetensors headers built to hurt: lying length prefixes, deep nesting, huge headers, many or huge
    tensor entries, odd JSON types where the parser expects names and strings. All signed by the device."""
    name = sorted(h.fleet.adapter.tensor_spec)[0]

    def make(shape: str) -> bytes:
        r = h.rng
        header, tail = split(h.fresh())  # a new last value each time, so no two files are the same
        if shape == "length_prefix":
            size = r.choice((2**64 - 1, 2**63, 10**12, 1 << r.randrange(20, 64), len(h.fleet.good) - 7, 0))
            return struct.pack("<Q", size) + h.fresh()[8:]
        if shape == "deep_nesting":
            depth = r.randrange(1000, 100_000)
            inner = r.choice(["[" * depth, '{"a":' * depth, '{"__metadata__":' + "[" * depth])
            if r.random() < 0.5:
                inner = inner + inner.translate(str.maketrans("[{", "]}"))[::-1]
            return framed(inner.encode(), tail)
        if shape == "nested_in_entry":
            deep = "[" * r.randrange(1000, 5000)
            field_ = r.choice(["shape", "data_offsets", "dtype"])
            raw = json.dumps({**header, name: {**header[name], field_: "@"}}).replace('"@"', deep + "]" * len(deep))
            return framed(raw.encode(), tail)
        if shape == "huge_header":
            padding = "a" * (1024 * 1024 + r.randrange(1, 4096))
            return framed(json.dumps({**header, "__metadata__": {"encoding": "f32", "pad": padding}}).encode(), tail)
        if shape == "many_tensors":
            count = r.choice((10_001, 20_000, r.randrange(2, 3000)))
            extra = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(count)}
            return framed(json.dumps({**header, **extra}).encode(), tail)
        if shape == "huge_names":
            renamed = {(k if k != name else k + "x" * r.randrange(100, 200_000)): v for k, v in header.items()}
            return framed(json.dumps(renamed).encode(), tail)
        if shape == "huge_numbers":
            entry = dict(header[name])
            pick = r.choice(["shape", "offsets", "digits", "float"])
            if pick == "shape":
                entry["shape"] = [2**70, 2**70]
            elif pick == "offsets":
                entry["data_offsets"] = [0, 2**64 + r.randrange(99)]
            elif pick == "digits":
                entry["data_offsets"] = ["@"]
            else:
                entry["shape"] = [1e308, 4.0]
            raw = json.dumps({**header, name: entry}).replace('"@"', "9" * r.randrange(4400, 20_000))
            return framed(raw.encode(), tail)
        if shape == "odd_types":
            entry = dict(header[name])
            target, value = r.choice(
                [
                    ("dtype", ["F32"]),
                    ("dtype", {"F32": 1}),
                    ("dtype", 4),
                    ("dtype", None),
                    ("shape", "16"),
                    ("shape", [True, 4]),
                    ("shape", [-1, 4]),
                    ("data_offsets", [0]),
                    ("data_offsets", "0-4"),
                    ("entry", ["F32"]),
                    ("entry", None),
                ]
            )
            if target == "entry":
                return framed(json.dumps({**header, name: value}).encode(), tail)
            entry[target] = value
            return framed(json.dumps({**header, name: entry}).encode(), tail)
        if shape == "odd_metadata":
            metadata = r.choice(
                [
                    {"encoding": ["f32"]},
                    {"encoding": {"f32": 1}},
                    {"encoding": None},
                    {"encoding": "int8", "scales": "[" * r.randrange(1000, 5000)},
                    {"encoding": "int8", "scales": "{" + '"a":' * 3000},
                    {"encoding": "int8", "scales": {"a": 1}},
                    ["f32"],
                    "f32",
                    {"encoding": "f32" + "\u0000"},
                ]
            )
            return framed(json.dumps({**header, "__metadata__": metadata}).encode(), tail)
        # names a database or UTF-8 cannot hold
        odd = r.choice(["\u0000", "\ud800", "\udfff", "\x1b[31m", "\u202e", "a\u0000b"])
        if r.random() < 0.5:
            size = len(tail)
            extra = {odd: {"dtype": "F32", "shape": [1], "data_offsets": [size, size + 4]}}
            return framed(json.dumps({**header, **extra}).encode(), tail + b"\0" * 4)
        return framed(json.dumps({(odd if k == name else k): v for k, v in header.items()}).encode(), tail)

    shapes = [
        ("length_prefix", 8),
        ("deep_nesting", 8),
        ("nested_in_entry", 4),
        ("huge_header", 1),
        ("many_tensors", 2),
        ("huge_names", 2),
        ("huge_numbers", 4),
        ("odd_types", 8),
        ("odd_metadata", 8),
        ("odd_names", 6),
    ]
    kinds, weights = zip(*shapes, strict=True)
    for _ in range(n):
        shape = h.rng.choices(kinds, weights)[0]
        h.send_signed(f"header_bomb/{shape}", h.new_signed_mutant(lambda shape=shape: make(shape)))


def dtype_shape(h: Harness, n: int) -> None:
    """Wrong dtypes (also ones of the same width), wrong shapes, missing, extra and renamed tensors, and an
    encoding the tensors do not match. All signed by the device."""
    base = small_delta(h.fleet.adapter, seed=11)
    names = sorted(base)
    dtypes = [
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    ]

    def make(shape: str) -> bytes:
        r = h.rng
        tensors, encoding, name = dict(base), "f32", r.choice(names)
        value = tensors[name]
        if shape == "dtype":
            tensors[name] = value.to(r.choice(dtypes))
        elif shape == "shape":
            tensors[name] = r.choice(
                [
                    value.reshape(-1),
                    value.unsqueeze(0),
                    value.reshape(value.shape[::-1]).contiguous() if value.dim() > 1 else value.unsqueeze(1),
                    torch.cat([value, value[:1]]),
                    value[:-1] if value.shape[0] > 1 else value[:0],
                    value[:0],
                    torch.tensor(0.01),
                ]
            ).contiguous()
        elif shape == "missing":
            del tensors[name]
        elif shape == "extra":
            tensors[r.choice([name + ".extra", "base_model.model.evil.weight", "lora_A"])] = torch.zeros(
                r.randrange(1, 9)
            )
        elif shape == "renamed":
            tensors[name.replace("base_model.model.", "base_model.")] = tensors.pop(name)
        else:
            encoding = r.choice(["f16", "int8", "F32", "f64", "", "bf16"])
        metadata = {"encoding": encoding, "fuzz": str(r.random())}
        if encoding == "int8":
            metadata["scales"] = json.dumps(dict.fromkeys(tensors, 0.01))
        return save_safetensors(tensors, metadata=metadata)

    for _ in range(n):
        shape = h.rng.choice(("dtype", "dtype", "shape", "shape", "missing", "extra", "renamed", "encoding"))
        h.send_signed(f"dtype_shape/{shape}", h.new_signed_mutant(lambda shape=shape: make(shape)))


def non_finite(h: Harness, n: int) -> None:
    """NaN (quiet, signalling, negative, any payload), +-Inf and finite values too large for the norm bound,
    in f32, f16 and int8 files; int8 scales that are not positive finite numbers. All signed by the device."""
    adapter = h.fleet.adapter
    f32 = h.fleet.good
    f16 = encode_delta(small_delta(adapter, seed=12), encoding="f16")
    int8_header, int8_tail = split(encode_delta(small_delta(adapter, seed=13), encoding="int8"))

    def overwrite(data: bytes, width: int, patterns: list[int]) -> bytes:
        start = 8 + int.from_bytes(data[:8], "little")
        out = bytearray(data)
        for _ in range(h.rng.choice((1, 1, 1, 2, 50))):
            at = start + width * h.rng.randrange((len(data) - start) // width)
            out[at : at + width] = h.rng.choice(patterns).to_bytes(width, "little")
        return bytes(out)

    def make(shape: str) -> bytes:
        r = h.rng
        if shape == "f32_nan":
            payload = r.randrange(1, 1 << 23)
            return overwrite(f32, 4, [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7F800000 | payload, 0xFF800000 | payload])
        if shape == "f32_inf":
            return overwrite(f32, 4, [0x7F800000, 0xFF800000])
        if shape == "f32_huge":
            return overwrite(f32, 4, [0x7F7FFFFF, 0xFF7FFFFF, 0x5F000000 + r.randrange(1 << 23)])
        if shape == "f16_nan_inf":
            return overwrite(f16, 2, [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00 | r.randrange(1, 0x100)])
        if shape == "f16_huge":
            return overwrite(f16, 2, [0x7BFF, 0xFBFF])
        scales = json.loads(int8_header["__metadata__"]["scales"])
        victim = r.choice(sorted(scales))
        bad = r.choice(["NaN", "Infinity", "-Infinity", "1e999", "0", "-0.5", '"x"', "null", "true", "1e300", "[1]"])
        key = json.dumps(victim) + ": "
        raw = json.dumps(scales).replace(key + json.dumps(scales[victim]), key + bad)
        header = {**int8_header, "__metadata__": {**int8_header["__metadata__"], "scales": raw}}
        tail = bytearray(int8_tail)  # and one quantised value changed, so no two files are the same
        tail[r.randrange(len(tail))] = r.randrange(1, 255)
        return framed(json.dumps(header).encode(), bytes(tail))

    for _ in range(n):
        shape = h.rng.choice(("f32_nan", "f32_nan", "f32_inf", "f32_huge", "f16_nan_inf", "f16_huge", "int8_scale"))
        h.send_signed(f"non_finite/{shape}", h.new_signed_mutant(lambda shape=shape: make(shape)))


def url_sha(h: Harness, n: int) -> None:
    """A URL naming another file than the envelope: random, the body's, the control's, malformed."""
    for _ in range(n):
        data = h.fresh()
        signed = h.sign(data)
        sha = signed["envelope"]["sha256"]
        shape = h.rng.choice(("random", "flipped_digit", "control", "malformed", "malformed"))
        if shape == "random":
            url = h.rng.randbytes(32).hex()
        elif shape == "flipped_digit":
            at = h.rng.randrange(64)
            url = sha[:at] + h.rng.choice([c for c in "0123456789abcdef" if c != sha[at]]) + sha[at + 1 :]
        elif shape == "control":
            url = h.fleet.control.sha256
        else:
            url = h.rng.choice(
                [
                    sha.upper(),
                    sha[:-1],
                    sha + "0",
                    sha + "\n",
                    sha[:32],
                    sha + "/x",
                    "..",
                    "\x00" * 3,
                    "g" * 64,
                    " " + sha,
                ]
            )
        h.send(f"url_sha/{shape}", data, envelope_text(signed), signed["signature"], url)


FAMILIES = {
    "envelope_bits": envelope_bits,
    "envelope_fields": envelope_fields,
    "signature_bits": signature_bits,
    "body_bits_unsigned": body_bits_unsigned,
    "body_bits_signed": body_bits_signed,
    "swapped_device": swapped_device,
    "replay": replay,
    "truncated": truncated,
    "oversized": oversized,
    "header_bomb": header_bomb,
    "dtype_shape": dtype_shape,
    "non_finite": non_finite,
    "url_sha": url_sha,
}


# --- the tests ------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    """The fixtures create several users per test; the production hasher would cost seconds per family."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(scope="module", autouse=True)
def _summary():
    """Quiet the per-request 4xx warnings while fuzzing, and print the table of outcomes at the end."""
    request_log = logging.getLogger("django.request")
    level = request_log.level
    request_log.setLevel(logging.ERROR)
    yield
    request_log.setLevel(level)
    if SUMMARY:
        print("\n" + summary_table(SUMMARY))


def summary_table(summary: dict[str, dict[str, Counter]]) -> str:
    rows = [
        (kind, outcome, count)
        for family in summary.values()
        for kind, c in family.items()
        for outcome, count in c.items()
    ]
    rows.sort()
    by_code = Counter()
    for _, outcome, count in rows:
        code = outcome.rsplit(" ", 1)[-1]
        by_code["no_op (a replay acknowledged as the control)" if code == "no_op" else code] += count
    width = max(len(r[0]) for r in rows) + 2
    outcome_width = max(len(r[1]) for r in rows) + 2
    lines = [f"{'mutation kind':<{width}}{'outcome':<{outcome_width}}{'count':>7}"]
    lines += [f"{kind:<{width}}{outcome:<{outcome_width}}{count:>7}" for kind, outcome, count in rows]
    lines += ["", f"{'rejection code':<{width + outcome_width}}{'count':>7}"]
    lines += [f"{code:<{width + outcome_width}}{count:>7}" for code, count in sorted(by_code.items())]
    lines += [f"{'total mutated uploads':<{width + outcome_width}}{sum(r[2] for r in rows):>7}"]
    return "\n".join(lines)


def test_the_families_together_send_at_least_ten_thousand_mutated_uploads():
    assert set(QUOTAS) == set(FAMILIES)
    assert sum(QUOTAS.values()) >= 10_000


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_mutated_upload_is_rejected_with_a_code_and_message_and_changes_nothing(family, fleet, settings):
    if family == "oversized":
        settings.DELTA_MAX_BYTES = SMALL_LIMIT
    assert len(fleet.good) < settings.DELTA_MAX_BYTES
    harness = Harness(fleet, random.Random(f"{SEED}:{family}"))
    harness.sent.add(fleet.control.sha256)
    started = time.monotonic()
    FAMILIES[family](harness, QUOTAS[family])
    elapsed = time.monotonic() - started
    SUMMARY[family] = harness.tally
    total = sum(sum(c.values()) for c in harness.tally.values())
    print(
        f"\n{family}: {total} uploads in {elapsed:.1f}s ({harness.redraws} mutants redrawn as still valid or "
        f"unchanged, {harness.partials} refused uploads left open for a resume and closed with junk)"
    )

    assert not harness.failures, f"{len(harness.failures)} failures, first ones:\n" + "\n".join(harness.failures[:10])
    assert total == QUOTAS[family]

    # Nothing changed for a rejected upload: the control is the only accepted delta and the only one in a round,
    # and replays of it left it as it was (one row for its file, same bytes, same round).
    control = fleet.control
    accepted = Delta.objects.filter(state__in=(Delta.State.ACCEPTED, Delta.State.AGGREGATED))
    assert list(accepted.values_list("pk", flat=True)) == [control.pk]
    assert list(Delta.objects.filter(round__isnull=False).values_list("pk", flat=True)) == [control.pk]
    assert control.round.deltas.count() == 1
    assert list(Delta.objects.filter(sha256=control.sha256).values_list("pk", "blob_sha256", "round")) == [
        (control.pk, control.sha256, control.round_id)
    ]
    # A counter is claimed only by an envelope its device signed (never by a forgery, another device's
    # envelope, a replayed control or a corrupted transfer); the other devices have claimed none. A file the
    # device did sign and that fails a later check (contents, base version) uses up its own counter by design.
    for delta in Delta.objects.filter(counter_claimed=True).select_related("device"):
        key = public_key_from_b64(delta.device.public_key)
        assert verify(key, delta.envelope, delta.signature), f"delta {delta.pk} claimed counter {delta.counter}"
        assert delta.device_id == fleet.a.device.pk
    reused = Delta.objects.filter(device=fleet.a.device, counter=CONTROL_COUNTER, counter_claimed=True)
    assert list(reused.values_list("pk", flat=True)) == [control.pk]
    assert not Delta.objects.filter(counter_claimed=True, rejection_code__in=UNCLAIMED_CODES).exists()
