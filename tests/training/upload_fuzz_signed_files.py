"""The upload fuzzer's families of files the device signed but that are no valid delta: flipped header and
exponent bits, header bombs, wrong dtypes and shapes, NaN and Inf. One function each: ``family(harness, n)``
sends n mutated uploads."""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import save as save_safetensors

from edge_agent.delta import encode_delta
from tests.training.delta_support import small_delta
from tests.training.upload_fuzz_support import Harness, flip_bits, framed, split


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


def header_bomb(h: Harness, n: int) -> None:
    """Safetensors headers built to hurt: lying length prefixes, deep nesting, huge headers, many or huge
    tensor entries, odd JSON types where the parser expects names and strings, names and keys given twice. All
    signed by the device."""
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
        if shape == "duplicate_names":
            # A tensor named twice (with its own entry again, or another tensor's), or a metadata key twice: JSON
            # leaves the choice of entry to the reader, so the server refuses the file.
            names = sorted(k for k in header if k != "__metadata__")
            victim, pick = r.choice(names), r.choice(["same", "other", "metadata"])
            if pick == "metadata":
                raw = json.dumps(header).replace('"__metadata__": {', '"__metadata__": {"encoding": "f32", ', 1)
                return framed(raw.encode(), tail)
            entry = header[victim] if pick == "same" else header[r.choice(names)]
            return framed((json.dumps(header)[:-1] + f", {json.dumps(victim)}: {json.dumps(entry)}}}").encode(), tail)
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
        ("duplicate_names", 4),
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
