"""The upload fuzzer's families that attack what an upload claims rather than its file: bit flips and bad
fields in the envelope, bad signatures, another device's identity, replays of the accepted control, and a
URL naming another file. One function each: ``family(harness, n)`` sends n mutated uploads."""

from __future__ import annotations

import hashlib
import json

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_agent.protocol import b64decode, b64encode
from tests.training.upload_fuzz_support import CONTROL_COUNTER, CREATED_AT, Harness, envelope_text, flip_bits, flip_text


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
