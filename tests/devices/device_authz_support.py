"""The device authorization matrix's fleet (tests/devices/test_device_authz_*.py): the role matrix's world plus
what the devices hold (their REST tokens and half an upload of bravo's), and the small helpers the matrix's
modules share."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from devices import presence
from edge_agent.delta import encode_delta, sign_delta
from tests.authz_routes import DEVICE_ROUTES
from tests.authz_support import World, build_world
from tests.devices.test_device_rest_auth import challenge, exchange
from tests.training.test_rounds import make_delta_tensors

DEVICE_ROUTE_METHODS = [(name, method) for name, methods in DEVICE_ROUTES.items() for method in methods]


@dataclass
class Fleet:
    world: World
    tokens: dict  # "alpha" / "bravo" -> their REST device token
    issued_at: float  # when the tokens were issued
    staging: Path  # DELTA_STAGING_DIR
    staged: dict  # bravo's unfinished upload: "signed" (envelope and signature), "data", "offset"

    @property
    def staged_sha(self) -> str:
        return self.staged["signed"]["envelope"]["sha256"]

    def bravo_folder(self) -> dict[str, bytes]:
        """What bravo has staged, file by file (its unfinished upload, with its envelope and lock)."""
        folder = self.staging / self.world.bravo.id
        return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def build_fleet(staging: Path) -> Fleet:
    """The world, the devices' tokens (through the real signed challenge) and half an upload of bravo's."""
    from training.federation.intake import upload_append, upload_begin

    world = build_world()
    issued_at = time.time()
    tokens = {
        name: exchange(device.id, challenge(device.id), device.key).json()["token"]
        for name, device in (("alpha", world.alpha), ("bravo", world.bravo))
    }
    data = encode_delta(make_delta_tensors(world.adapter, seed=2))
    signed = sign_delta(
        world.bravo.key,
        data,
        device_id=world.bravo.id,
        adapter=world.adapter.name,
        base_version=1,
        num_samples=8,
        counter=2,
    )
    bravo = world.bravo.device
    upload_begin(device=bravo, envelope=signed["envelope"], signature=signed["signature"], channel="rest")
    half = len(data) // 2
    sha = signed["envelope"]["sha256"]
    assert upload_append(device=bravo, sha256=sha, offset=0, data=data[:half], channel="rest").offset == half
    return Fleet(world, tokens, issued_at, Path(staging), {"signed": signed, "data": data, "offset": half})


def error_code(response) -> str:
    return response.json()["error"]["code"]


def presence_of(device_id: str):
    """What Redis holds for a device's presence: its last heartbeat's state and when it was last seen."""
    client = presence.sync_client()
    return client.hget(presence.key("state"), device_id), client.zscore(presence.key("seen"), device_id)


def _bravo_finished_upload(world: World) -> tuple[bytes, dict]:
    """The bytes and signed envelope of bravo's received delta, as bravo sent them."""
    from training.registry.blobs import blob_read

    delta = world.bravo_delta
    return blob_read(delta.blob_sha256), {"envelope": delta.envelope, "signature": delta.signature}
