"""The upload fuzzer's families of mutations by name (``FAMILIES``), in the order the fuzzer runs them; each is
``family(harness, n)``, which sends n mutated uploads. The families themselves are in upload_fuzz_envelope.py
(the envelope, signature, identity, replays, URL), upload_fuzz_body.py (the body in transit) and
upload_fuzz_signed_files.py (signed files that are no valid delta)."""

from __future__ import annotations

from tests.training.upload_fuzz_body import body_bits_unsigned, oversized, truncated
from tests.training.upload_fuzz_envelope import (
    envelope_bits,
    envelope_fields,
    replay,
    signature_bits,
    swapped_device,
    url_sha,
)
from tests.training.upload_fuzz_signed_files import body_bits_signed, dtype_shape, header_bomb, non_finite

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
