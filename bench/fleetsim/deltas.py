"""The simulated agents' deltas: one valid delta file per agent, made before the timed phase, and a fresh
signed upload of it for every send.

Each agent's file is a real delta for the adapter's tensor spec (float32 values drawn from N(0, 0.01), seeded
by the agent's index, encoded by ``edge_agent.delta.encode_delta``). The server acknowledges a file it already
holds by sha256 instead of counting it again, so every upload must be new bytes: upload ``n`` writes ``n`` as
a float32 into the file's last 4 bytes (the last value of one of its tensors: still finite, still within the
norm bound) and signs an envelope with counter ``n``. The sha256 of everything before those 4 bytes is
computed once, so an upload costs a 4-byte hash update and one Ed25519 signature.
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass, field

from edge_agent.delta import envelope_payload
from edge_agent.protocol import sign


@dataclass
class Upload:
    """One signed upload: the bytes as they are for it, its envelope and signature."""

    sha256: str
    size: int
    envelope: dict
    signature: str
    counter: int


@dataclass
class AgentDelta:
    data: bytearray
    prefix_hash: object  # hashlib sha256 of data[:-4]
    uploads: int = 0
    current: Upload | None = field(default=None, repr=False)

    def next_upload(self, key, *, device_id: str, adapter: str, base_version: int, num_samples: int) -> Upload:
        """The next fresh upload of this file (its bytes updated in place) with its signed envelope."""
        self.uploads += 1
        counter = self.uploads
        tail = struct.pack("<f", counter * 1e-6)
        self.data[-4:] = tail
        digest = self.prefix_hash.copy()
        digest.update(tail)
        envelope = envelope_payload(
            device_id=device_id,
            adapter=adapter,
            base_version=base_version,
            sha256=digest.hexdigest(),
            size=len(self.data),
            num_samples=num_samples,
            counter=counter,
            created_at=time.time(),
        )
        self.current = Upload(envelope["sha256"], len(self.data), envelope, sign(key, envelope), counter)
        return self.current


def make_delta(tensor_spec: dict, index: int) -> AgentDelta:
    """A delta file for an adapter with ``tensor_spec`` ({name: {"shape", "dtype"}}), deterministic per index."""
    import numpy as np
    import torch

    from edge_agent.delta import encode_delta

    rng = np.random.default_rng([index, 20261123])
    tensors = {
        name: torch.from_numpy(rng.normal(0.0, 0.01, size=tuple(entry["shape"])).astype(np.float32))
        for name, entry in sorted(tensor_spec.items())
    }
    data = bytearray(encode_delta(tensors))
    return AgentDelta(data=data, prefix_hash=hashlib.sha256(bytes(data[:-4])))
