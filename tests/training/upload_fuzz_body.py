"""The upload fuzzer's families that attack the body in transit: bits flipped after the device signed it,
bodies cut short or resumed wrongly, and files or bodies larger than allowed or declared. One function each:
``family(harness, n)`` sends n mutated uploads."""

from __future__ import annotations

import json

from edge_agent.protocol import b64encode
from tests.training.upload_fuzz_support import SMALL_LIMIT, Harness, envelope_text, flip_bits


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
