"""``own_model.py``'s second part, its pieces: each device's wearer and sensor, the devices as ``bench/fleetlearn``'s
agents run them, and the product set up through its API as a team would, by hand: the ``.pt2`` and its card
uploaded, an adapter with the API's defaults, a cohort, an enrollment token, version 1 seeded, released and rolled
out to the whole cohort."""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request

import numpy as np

from bench.fleetlearn.fleet import FleetDevice
from bench.fleetlearn.measure import ApiReader
from bench.fleetlearn.split import DeviceData
from demo.sensor_model import CARD, windows

COHORT, ADAPTER, BASE = "wearables", "sensor-lora", "wrist-sensor"
# The demo's aggregation with issue 47's FedBuff buffer (bench/README.md, "fleet_learning.py"): rounds of 3 deltas,
# each round's version released and rolled out at once; the rest is the API's defaults.
AGGREGATION = {"strategy": "fedbuff", "buffer_size": 3, "min_deltas": 2, "round_timeout_seconds": 90,
               "auto_release": True}  # fmt: skip
TRAIN_WINDOWS, TEST_WINDOWS = (60, 150), 200

TOKEN_SCRIPT = r"""
import sys
import django
django.setup()
from accounts.roles import Role
from accounts.services import api_token_create, user_create
user = user_create(username=sys.argv[1], role=Role.ADMIN)
print(api_token_create(user=user, name="own_model bench").raw)
"""


class SensorData(DeviceData):
    """One wearer's windows through their own sensor (``transform``: offset, gain, noise)."""

    def describe(self) -> str:
        t = self.transform
        return f"offset {t['offset']:+.2f}, gain {t['gain']:.2f}, noise {t['noise']:.2f}"


class SensorDevice(FleetDevice):
    def app_samples(self, batch: dict) -> dict:
        return batch  # the sensor's windows as they come (the card's ``window``, and ``y``)


def sensor_split(seed: int, devices: int) -> list[SensorData]:
    """Per device, drawn from ``seed``: a sensor as ``demo.sensor_model.SENSORS`` has them (offset in [-1.2, 1.2],
    gain log-uniform in [0.5, 2.3], noise in [0.25, 0.6]), 60 to 150 windows to hand its agent and 200 held-out
    TEST windows of the same sensor, never handed over."""
    rng = np.random.default_rng(seed)
    out = []
    for index in range(devices):
        sensor = {"offset": float(rng.uniform(-1.2, 1.2)), "gain": float(np.exp(rng.uniform(np.log(0.5), np.log(2.3)))),
                  "noise": float(rng.uniform(0.25, 0.6))}  # fmt: skip
        count = int(rng.integers(TRAIN_WINDOWS[0], TRAIN_WINDOWS[1] + 1))
        train = windows(count, seed=seed * 10_000 + index, **sensor)
        test = windows(TEST_WINDOWS, seed=seed * 10_000 + 5_000 + index, **sensor)
        classes = {int(c): int((train["y"] == c).sum()) for c in np.unique(train["y"])}
        out.append(SensorData(index=index, group="sensor", small=False, train=train, test=test, transform=sensor,
                              classes=classes))  # fmt: skip
    return out


class ApiClient(ApiReader):
    """``ApiReader`` that also writes: JSON bodies, and the multipart upload of a base model."""

    def send(self, path: str, body: bytes, content_type: str) -> dict:
        request = urllib.request.Request(self.base_url + path, data=body, method="POST", headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": content_type})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=120) as response:  # noqa: S310  (our own server)
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"POST {path}: {error.code} {error.read().decode(errors='replace')}") from None

    def post(self, path: str, body: dict) -> dict:
        return self.send(path, json.dumps(body).encode(), "application/json")

    def post_files(self, path: str, fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> dict:
        boundary = secrets.token_hex(16)
        parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
                 for k, v in fields.items()]  # fmt: skip
        for name, (filename, data) in files.items():
            head = (f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                    "Content-Type: application/octet-stream\r\n\r\n")  # fmt: skip
            parts.append(head.encode() + data + b"\r\n")
        body = b"".join(parts) + f"--{boundary}--\r\n".encode()
        return self.send(path, body, f"multipart/form-data; boundary={boundary}")


def set_up(server, program: bytes, devices: int, say) -> tuple[ApiClient, dict]:
    """The product as an admin sets it up through the API for a team's own model; the ids and the enrollment
    token."""
    token = server.run_django(TOKEN_SCRIPT, f"bench-{server.run_id}", what="creating an admin").strip().splitlines()
    api = ApiClient(server.base_url, token[-1])
    base = api.post_files("/api/v1/base-models/", {"name": BASE, "family": "exported-program",
                          "family_config": json.dumps(CARD)}, {"weights": ("sensor.pt2", program)})  # fmt: skip
    modules = api.get(f"/api/v1/base-models/{base['id']}/modules/")["modules"]
    say(f"uploaded {BASE}: {base['parameter_count']:,} parameters, {len(program):,} bytes; modules "
        + ", ".join(f"{m['name']} {m['shape']}" for m in modules))  # fmt: skip
    api.post("/api/v1/cohorts/", {"name": COHORT})
    adapter = api.post("/api/v1/adapters/", {"name": ADAPTER, "base_model": BASE, "cohorts": [COHORT],
                                             "aggregation": AGGREGATION})  # fmt: skip
    say(f"adapter {ADAPTER}: rank {adapter['rank']}, alpha {adapter['alpha']}, targets {adapter['target_modules']}, "
        f"modules to save {adapter['modules_to_save']}")  # fmt: skip
    version = api.post(f"/api/v1/adapters/{adapter['id']}/versions/seed/", {"seed": 1, "note": "own_model bench"})
    version = api.post(f"/api/v1/adapter-versions/{version['id']}/release/", {"reason": "own_model bench"})
    rollout = api.post("/api/v1/rollouts/", {"version": version["id"], "cohort": COHORT, "phases": [{"percent": 100}]})
    api.post(f"/api/v1/rollouts/{rollout['id']}/start/", {})
    enrollment = api.post("/api/v1/enrollment-tokens/", {"name": "own_model bench", "cohort": COHORT,
                                                         "uses_left": devices, "requires_approval": False})  # fmt: skip
    say(f"version {version['number']} {version['state']}, rolled out to {COHORT} (rollout {rollout['id']})")
    return api, {"base_model": base, "modules": modules, "adapter": adapter, "version": version,
                 "tokens": {COHORT: enrollment["token"]}}  # fmt: skip
