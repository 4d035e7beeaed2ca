"""A fresh data folder, no SERVER_SIGNING_KEY, three web server processes, and 20 devices enrolling at the same
moment (as the demo fleet of a first `make run` does), each with a token of its own so that nothing queues them:
the signing key is created once, every enrollment succeeds, every response pins the same server key (the one in
the data folder), the database holds exactly the 20 devices under their keys, and every device holds working
credentials (it gets a device token with its own key). Before the key was created race-free, some of these
enrollments failed with a 500 and left their device behind."""

from __future__ import annotations

import json
import stat
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from devices.server_key import KEY_FILE_NAME, load_private_key, public_key_b64
from edge_agent.identity import public_key_b64 as device_public_key_b64
from edge_agent.protocol import sign, token_request_payload
from tests.e2e.support import drop_stack, free_port, stack_env, start_launcher, stop_launcher
from tests.e2e.test_agent_lifecycle import _Api
from tests.e2e.test_federated_round import _admin_token

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]
DEVICES = 20
WEB_PROCESSES = 3


def _post(base: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(  # noqa: S310  (our own http URL)
        base + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, {"raw": error.read().decode(errors="replace")[:500]}


def test_twenty_devices_enrolling_at_once_on_a_fresh_data_folder_all_pin_the_one_server_key(tmp_path):
    env = stack_env(tmp_path, ENROLLMENT_RATE="10000/min")
    env.pop("SERVER_SIGNING_KEY", None)
    env.pop("SERVER_SIGNING_KEY_FILE", None)
    data = tmp_path / "data"
    port = free_port()
    launcher = None
    try:
        launcher, output = start_launcher(env, port, web_workers=WEB_PROCESSES)
        assert not (data / KEY_FILE_NAME).exists()  # nothing made the key before the enrollments ask for it

        api = _Api(port, _admin_token(env))
        assert api.call("POST", "/cohorts/", {"name": "burst"})[0] == 201
        expires = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        tokens = []  # a token each: enrollments with one token queue on its row lock, these run side by side
        for index in range(DEVICES):
            status, issued = api.call(
                "POST",
                "/enrollment-tokens/",
                {"cohort": "burst", "name": f"b-{index}", "expires_at": expires, "uses": 1, "requires_approval": False},
            )
            assert status == 201, issued
            tokens.append(issued["token"])

        keys = [Ed25519PrivateKey.generate() for _ in range(DEVICES)]
        start = threading.Barrier(DEVICES)

        def enroll(index: int) -> tuple[int, dict]:
            body = {"token": tokens[index], "public_key": device_public_key_b64(keys[index]), "name": f"b-{index}"}
            start.wait()
            return _post(api.base, "/enroll/", body)

        with ThreadPoolExecutor(DEVICES) as pool:
            answers = list(pool.map(enroll, range(DEVICES)))
        assert [code for code, _ in answers] == [201] * DEVICES, answers

        key_file = data / KEY_FILE_NAME
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert [p.name for p in data.iterdir() if p.name.startswith(f".{KEY_FILE_NAME}")] == []  # no temporaries
        pinned = {body["server_public_key"] for _, body in answers}
        assert pinned == {public_key_b64(load_private_key(key_file.read_text()))}

        with psycopg.connect(env["DATABASE_URL"]) as conn:  # every device row, each under the key it sent
            rows = dict(conn.execute("SELECT id::text, public_key FROM devices_device").fetchall())
        assert rows == {body["device_id"]: device_public_key_b64(keys[i]) for i, (_, body) in enumerate(answers)}
        for index, (_, body) in enumerate(answers):  # each device's own key works with the server
            code, challenge = _post(api.base, "/device-auth/challenge/", {"device_id": body["device_id"]})
            assert code == 200, challenge
            signature = sign(keys[index], token_request_payload(nonce=challenge["nonce"], device_id=body["device_id"]))
            code, token = _post(
                api.base,
                "/device-auth/token/",
                {"device_id": body["device_id"], "nonce": challenge["nonce"], "signature": signature, "protocol": 2},
            )
            assert code == 200 and token["token"], token
        assert not [line for line in output.lines if "ImproperlyConfigured" in line or "Traceback" in line]
    finally:
        if launcher is not None:
            stop_launcher(launcher)
        drop_stack(env)
