"""``fleet.wsmask``: the numpy unmasking gives wsproto's bytes for every length and every way a frame's payload
is split into pieces, and a frame through wsproto's own decoder comes out whole."""

from __future__ import annotations

import random

import pytest
from wsproto.frame_protocol import FrameProtocol, Opcode

from fleet.wsmask import WSPROTO_MASKER, NumpyXorMasker, install


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4, 5, 7, 8, 63, 64, 65, 1021, 4096, 300 * 1024 + 3])
def test_unmasking_gives_wsproto_s_bytes_whatever_the_pieces(size):
    rng = random.Random(size)
    key = rng.randbytes(4)
    payload = rng.randbytes(size)
    ours, theirs = NumpyXorMasker(key), WSPROTO_MASKER(key)
    position, out_ours, out_theirs = 0, bytearray(), bytearray()
    while position < size or position == 0:
        step = rng.choice([1, 2, 3, 5, 17, 4096, size or 1])
        piece = payload[position : position + step]
        out_ours += ours.process(piece)
        out_theirs += theirs.process(piece)
        position += max(step, 1)
        if size == 0:
            break
    assert bytes(out_ours) == bytes(out_theirs)
    assert bytes(NumpyXorMasker(key).process(bytes(out_ours))) == payload[: len(out_ours)]  # XOR twice: back


def test_a_masked_client_frame_decodes_whole_through_wsproto_with_the_numpy_masker():
    install()
    payload = random.Random(1).randbytes(300 * 1024 + 1)
    client = FrameProtocol(client=True, extensions=[])
    server = FrameProtocol(client=False, extensions=[])
    wire = client.send_data(payload, fin=True)
    received = bytearray()
    for start in range(0, len(wire), 65536 + 3):  # the bytes arrive in pieces, as over TCP
        server.receive_bytes(wire[start : start + 65536 + 3])
        for frame in server.received_frames():
            assert frame.opcode in (Opcode.BINARY, Opcode.CONTINUATION)
            received += frame.payload
    assert bytes(received) == payload
