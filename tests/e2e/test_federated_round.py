"""The heart of the product end to end, real processes only: three `edge-agent run` devices get version 1
through a rollout, train it on their own non-IID digits shards, upload signed deltas over the socket; the
server verifies them in its Celery worker, closes the round at K = 3, aggregates, and the new version's
tensors equal the sample-weighted mean of exactly those deltas added to version 1 (fedavg's reference).
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import time
import uuid
import zipfile
from datetime import UTC, datetime, timedelta

import pytest
import torch
from safetensors.torch import load as load_safetensors

from edge_agent.delta import decode_tensor, read_encoding
from tests.e2e.support import ROOT, drop_stack, free_port, kill, spawn, stack_env, start_launcher, stop_launcher
from tests.e2e.test_agent_lifecycle import _agent, _Api, _say

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
DEVICES = 3


def _admin_token(env) -> str:
    name = f"e2e-admin-{uuid.uuid4().hex[:6]}"
    shell = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "shell",
            "-c",
            "from accounts.services import api_token_create, user_create; "
            f"user = user_create(username={name!r}, role='admin'); "
            "print('TOKEN=' + api_token_create(user=user, name='e2e').raw)",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shell.returncode == 0, shell.stdout + shell.stderr
    return next(line for line in shell.stdout.splitlines() if line.startswith("TOKEN=")).split("=", 1)[1]


def _download(api: _Api, path: str) -> bytes:
    import urllib.request

    request = urllib.request.Request(api.base + path, headers={"Authorization": f"Bearer {api.token}"})  # noqa: S310
    with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
        return response.read()


def _decoded(path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        encoding, scales = read_encoding(handle.metadata())
        return {k: decode_tensor(handle.get_tensor(k), encoding=encoding, scale=scales.get(k)) for k in handle.keys()}  # noqa: SIM118


def test_agents_train_upload_and_a_worker_aggregates_the_fedavg_of_their_deltas(tmp_path):
    env = stack_env(tmp_path, HEARTBEAT_INTERVAL_SECONDS="2", ROLLOUT_TICK_SECONDS="1", PRESENCE_FLUSH_SECONDS="1")
    port = free_port()
    launcher = output = None
    agents: list = []
    try:
        launcher, output = start_launcher(env, port)
        api = _Api(port, _admin_token(env))
        assert api.call("POST", "/cohorts/", {"name": "fed-lab"})[0] == 201
        status, base = api.call("POST", "/base-models/", {"name": "digits", "family": "digits-cnn"})
        assert status == 201, base
        status, adapter = api.call(
            "POST",
            "/adapters/",
            {"name": "digits-lora", "base_model": "digits", "rank": 4, "alpha": 8.0, "cohorts": ["fed-lab"]},
        )
        assert status == 201, adapter
        status, body = api.call(
            "PUT",
            f"/adapters/{adapter['id']}/aggregation/",
            {"aggregation": {"strategy": "fedavg", "buffer_size": DEVICES, "min_deltas": DEVICES}},
        )
        assert status == 200, body
        status, v1 = api.call("POST", f"/adapters/{adapter['id']}/versions/seed/", {"seed": 7})
        assert status == 201, v1
        assert api.call("POST", f"/adapter-versions/{v1['id']}/release/", {"reason": "e2e"})[0] == 200
        status, rollout = api.call(
            "POST", "/rollouts/", {"version": v1["id"], "cohort": "fed-lab", "phases": [{"percent": 100}]}
        )
        assert status == 201, rollout
        assert api.call("POST", f"/rollouts/{rollout['id']}/start/", {"reason": "e2e"})[0] == 200
        expires = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        status, issued = api.call(
            "POST",
            "/enrollment-tokens/",
            {"cohort": "fed-lab", "name": "bench", "expires_at": expires, "uses": 10, "requires_approval": False},
        )
        assert status == 201, issued

        homes = [tmp_path / f"device-{i}" for i in range(DEVICES)]
        for i, home in enumerate(homes):
            done = _agent(
                home, "enroll", "--server", f"http://127.0.0.1:{port}", "--token", issued["token"], "--name", f"dev-{i}"
            )
            assert done.returncode == 0, done.stdout + done.stderr
            configured = _agent(
                home,
                "configure",
                "--simulate-device",
                f"{i}/{DEVICES}",
                "--alpha",
                "0.5",
                "--min-new-samples",
                "48",
                "--train-interval",
                "1",
            )
            assert configured.returncode == 0, configured.stderr
            agents.append(
                spawn([sys.executable, "-m", "edge_agent", "--home", str(home), "run", "--max-backoff", "2"], env)
            )
        _say("3 agents running; waiting for the round to complete")

        deadline = time.monotonic() + 240
        version2 = None
        while time.monotonic() < deadline and version2 is None:
            status, rounds = api.call("GET", "/rounds/?state=completed")
            if status == 200 and rounds["results"]:
                version2 = rounds["results"][0]
            time.sleep(1)
        assert version2 is not None, "no round completed:\n" + output.tail() + "\n" + agents[0][1].tail()
        round_id = version2["id"]
        status, deltas = api.call("GET", f"/deltas/?round={round_id}&page_size=50")
        assert status == 200 and deltas["count"] == DEVICES, deltas
        assert all(d["state"] == "aggregated" and d["channel"] == "ws" for d in deltas["results"])
        _say(f"round {round_id} completed from {DEVICES} deltas into v{version2['result_version']}")

        # The reference: v1 + sum(n_i * delta_i) / sum(n_i), from the very files the devices uploaded.
        files = {}
        for home in homes:
            for path in (home / "outbox").glob("*.delta"):
                files[hashlib.sha256(path.read_bytes()).hexdigest()] = path
        total = sum(d["num_samples"] for d in deltas["results"])
        v1_zip = zipfile.ZipFile(io.BytesIO(_download(api, f"/adapter-versions/{v1['id']}/export/")))
        v1_tensors = load_safetensors(v1_zip.read("adapter_model.safetensors"))
        status, versions = api.call("GET", f"/adapters/{adapter['id']}/versions/")
        v2 = next(v for v in versions["results"] if v["number"] == version2["result_version"])
        v2_zip = zipfile.ZipFile(io.BytesIO(_download(api, f"/adapter-versions/{v2['id']}/export/")))
        v2_tensors = load_safetensors(v2_zip.read("adapter_model.safetensors"))
        assert json.loads(v2_zip.read("adapter_config.json"))["r"] == 4
        for name, start in v1_tensors.items():
            reference = start.clone()
            for d in deltas["results"]:
                reference += _decoded(files[d["sha256"]])[name] * (d["num_samples"] / total)
            torch.testing.assert_close(v2_tensors[name], reference, rtol=1e-5, atol=1e-6)
        assert "eval_accuracy" in v2["metrics"], v2
        for home in homes:
            status_report = json.loads(_agent(home, "status").stdout)
            assert status_report["last_training"]["status"] in ("trained", "skipped", "discarded")
    finally:
        for process, _ in agents:
            kill(process)
        if launcher is not None:
            stop_launcher(launcher)
        drop_stack(env)
