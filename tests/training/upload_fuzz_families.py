"""The upload fuzzer's families of mutations, one function each: ``family(harness, n)`` sends n mutated uploads."""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import save as save_safetensors

from edge_agent.delta import encode_delta
from edge_agent.protocol import b64decode, b64encode
from tests.training.test_delta_verification import small_delta
from tests.training.upload_fuzz_support import (
    CONTROL_COUNTER,
    CREATED_AT,
    SMALL_LIMIT,
    Harness,
    envelope_text,
    flip_bits,
    flip_text,
    framed,
    split,
)

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
