"""`edge-agent run` stops promptly on SIGTERM: it says so, ends the training pass in progress at its next step with a
checkpoint there (taken up again at the next start), closes its socket and exits within about two seconds. It took
10 to 25 s, silently, finishing the whole pass first.

The real agent process, connected to the real server (uvicorn), a digits version installed and a long pass running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time

import pytest
from cryptography.hazmat.primitives import serialization

from devices.server_key import server_public_key_b64
from edge_agent.checkpoint import CheckpointManager
from edge_agent.families import get_family
from edge_agent.identity import KEY_FILE, AgentState, atomic_write
from edge_agent.runtime import TRAINING_RUN_FILE, AgentConfig
from tests.asgi_server import asgi_server
from tests.e2e.support import kill, spawn, wait_for
from tests.edge_agent.personal_support import install, training_manifest

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
STOP_WITHIN = 2.5  # seconds from SIGTERM to the process gone (the agent's own bound is 1.5 s, plus exiting)


def _agent_argv(home, *command: str) -> list[str]:
    return [sys.executable, "-m", "edge_agent", "--home", str(home), *command]


def _home(tmp_path, server_url: str, device, cohort) -> object:
    home = tmp_path / "agent"
    family = get_family("digits-cnn")
    install(home, family.build({"seed": 0}), family, version=1, training=training_manifest(family, {"method": "none"}))
    pem = device.key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    atomic_write(home / KEY_FILE, pem, mode=0o600)
    AgentState(server=server_url, device_id=device.id, server_public_key=server_public_key_b64(), cohort=cohort.name,
               status="active", websocket_path="/ws/agent/", heartbeat_interval=30).save(home)  # fmt: skip
    AgentConfig(
        data={"kind": "simulated", "device_index": 0, "num_devices": 4, "per_poll": 400, "wrap": False},
        power={"kind": "simulated", "level": 100.0, "charging": True},
        policy={"min_new_samples": 16, "min_battery_percent": 30.0},
        train={"epochs": 2000, "patience": 2000, "lr": 0.01},  # a pass far longer than the test
        train_interval_seconds=0.5,
    ).save(home)
    return home


def test_sigterm_stops_the_agent_within_two_seconds_mid_training_with_a_checkpoint_where_it_stood(
    cohort, enrolled, tmp_path
):
    device = enrolled("active")
    with asgi_server("agent-stop", tmp_path / "server") as server:
        home = _home(tmp_path, server.url, device, cohort)
        agent, output = spawn(_agent_argv(home, "run"), {**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            connected, _ = wait_for(lambda: any("connected as" in line for line in output.lines), 60)
            training, _ = wait_for(lambda: CheckpointManager(home / "checkpoints").paths(), 90)
            assert connected and training, output.tail()
            signalled = time.monotonic()
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=30)
            took = time.monotonic() - signalled
        finally:
            kill(agent)
    output._thread.join(timeout=5)
    lines = output.lines
    assert agent.returncode == 0, output.tail()
    assert took < STOP_WITHIN, f"stopped {took:.2f}s after SIGTERM\n{output.tail()}"
    assert any("stopping (SIGTERM)" in line for line in lines), output.tail()
    assert lines[-1].endswith("stopped"), output.tail()
    stopped = next(re.search(r"training stopped \(stopped at step (\d+) of", line) for line in lines
                   if "training stopped" in line)  # fmt: skip
    # The pass ended at a step boundary with a checkpoint there, and waits to be taken up on the same samples.
    assert max(step for step, _ in CheckpointManager(home / "checkpoints").paths()) == int(stopped[1])
    assert json.loads((home / TRAINING_RUN_FILE).read_text())["count"] > 0
    assert json.loads((home / "status.json").read_text())["error"] == "stopped"  # the socket was closed, not cut


def test_sigterm_while_a_step_cannot_end_by_itself_exits_within_the_bound_all_the_same(cohort, enrolled, tmp_path):
    """A server that accepts the connection and never answers: the agent is stuck in the WebSocket handshake
    (15 s before it gives up). The stop does not wait for it: the process exits STOP_GRACE_SECONDS after the signal,
    saying what it did."""
    device = enrolled("active")
    with socket.create_server(("127.0.0.1", 0)) as silent:
        home = _home(tmp_path, f"http://127.0.0.1:{silent.getsockname()[1]}", device, cohort)
        agent, output = spawn(_agent_argv(home, "run", "--no-training"), {**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            silent.settimeout(60)
            accepted = silent.accept()  # the agent is in its handshake now
            time.sleep(0.3)
            signalled = time.monotonic()
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=30)
            took = time.monotonic() - signalled
            accepted[0].close()
        finally:
            kill(agent)
    output._thread.join(timeout=5)
    assert agent.returncode == 0, output.tail()
    assert took < STOP_WITHIN, f"stopped {took:.2f}s after SIGTERM\n{output.tail()}"
    assert any("stopping (SIGTERM)" in line for line in output.lines), output.tail()
    assert "still busy 1.5s after the stop: exiting now" in output.lines[-1], output.tail()
