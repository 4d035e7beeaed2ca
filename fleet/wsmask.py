"""Unmasking client WebSocket frames with one numpy XOR instead of wsproto's table look-ups.

Every frame a client sends is XOR-masked with a 4-byte key (RFC 6455, 5.3). wsproto, the WebSocket
implementation the web processes run (``fleet/launcher.py``: ``--ws wsproto``, for its memory per
connection), unmasks in Python: four strided slices, each copied, translated through a table and copied
back: a visible share of the web processes' CPU under delta uploads (bench/README.md).
``NumpyXorMasker`` does the same with one XOR over 32-bit words: same interface, same bytes out, the key
rotated the same way when a frame arrives in pieces. ``install()`` puts it in wsproto's place; the ASGI
application calls it at start-up.
"""

from __future__ import annotations

import numpy as np
from wsproto import frame_protocol

WSPROTO_MASKER = frame_protocol.XorMaskerSimple  # wsproto's own, kept for the tests to compare with


class NumpyXorMasker:
    """wsproto's ``XorMaskerSimple``: ``process`` unmasks the next piece of a frame's payload."""

    def __init__(self, masking_key: bytes | bytearray) -> None:
        self._key = bytes(masking_key)

    def process(self, data: bytes | bytearray) -> bytearray:
        out = bytearray(data)
        words, size = len(out) // 4, len(out)
        if words:
            view = np.frombuffer(out, dtype=np.uint32, count=words)  # a view of ``out``: XORed in place
            np.bitwise_xor(view, np.frombuffer(self._key, dtype=np.uint32)[0], out=view)
        for index in range(words * 4, size):
            out[index] ^= self._key[index % 4]
        rotation = size % 4  # the next piece goes on with the next byte of the key
        self._key = self._key[rotation:] + self._key[:rotation]
        return out


def install() -> None:
    frame_protocol.XorMaskerSimple = NumpyXorMasker
