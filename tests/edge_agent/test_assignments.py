"""The agent applying assignments against the real server: verify, download, swap, keep previous, report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devices.models import Device
from devices.server_key import server_public_key_b64
from edge_agent.assignments import AdapterStore, AssignmentHandler
from edge_agent.identity import AgentState
from edge_agent.rest import DeviceSession
from training.models import Assignment
from training.registry.blobs import blob_read
from training.registry.services import version_create_seeded
from training.rollouts.lifecycle import assignment_create, rollout_create, rollout_start, rollout_tick

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def agent(enrolled, live_server, tmp_path, adapter, cohort):
    adapter.cohorts.add(cohort)
    device = enrolled("active")
    state = AgentState(
        server=live_server.url,
        device_id=device.id,
        server_public_key=server_public_key_b64(),
        cohort=cohort.name,
        status="active",
        websocket_path="/ws/agent/",
        heartbeat_interval=30,
    )
    session = DeviceSession(server=live_server.url, device_id=device.id, key=device.key)
    evaluated = []

    def evaluate(previous, candidate, manifest=None):
        evaluated.append((previous, candidate))
        return {"val_accuracy": 0.91, "val_loss": 0.3}

    handler = AssignmentHandler(home=tmp_path / "agent", state=state, session=session, evaluate=evaluate)
    handler.device, handler.evaluated = device, evaluated
    return handler


def _roll_out(version, cohort, make_user):
    operator = make_user("operator")
    rollout = rollout_create(
        version=version, cohort=cohort, phases=[{"percent": 100, "min_soak_seconds": 0}], actor=operator
    )
    rollout_start(rollout=rollout, actor=operator)
    # One phase, no soak: every device is assigned at once, and the rollout waits for them to install.
    assert rollout_tick(rollout=rollout) == "waiting"
    return rollout


def test_agent_installs_an_assignment_reports_metrics_and_keeps_the_previous_version(agent, adapter, cohort, make_user):
    first, second = version_create_seeded(adapter=adapter, seed=1), version_create_seeded(adapter=adapter, seed=2)
    first_rollout = _roll_out(first, cohort, make_user)
    message = agent.session.get("/api/v1/device/assignment/")
    assert agent.apply(message) == {"status": "installed", "version": 1}
    store = AdapterStore(agent.home)
    current = store.state()["current"]
    assert current["version"] == 1 and Path(current["path"]).read_bytes() == blob_read(first.blob_sha256)
    assert store.base_path(adapter.base_model.weights_sha256).read_bytes() == blob_read(
        adapter.base_model.weights_sha256
    )
    installed = Assignment.objects.get(device=agent.device.device)
    assert installed.state == "installed" and installed.metrics == {"val_accuracy": 0.91, "val_loss": 0.3}
    assert Device.objects.get(pk=agent.device.id).running_version == first
    assert agent.session.get("/api/v1/device/assignment/") is None  # nothing pending any more
    assert rollout_tick(rollout=first_rollout) == "completed"  # its one device installed

    _roll_out(second, cohort, make_user)
    assert agent.apply(agent.session.get("/api/v1/device/assignment/"))["status"] == "installed"
    state = store.state()
    assert state["current"]["version"] == 2 and state["previous"]["version"] == 1 and state["last_seq"] == 2
    assert Path(state["previous"]["path"]).read_bytes() == blob_read(first.blob_sha256)  # kept to fall back to
    assert agent.evaluated[-1][0] is not None  # evaluated against the version it replaces


def test_a_tampered_or_replayed_manifest_is_refused_and_the_refusal_is_visible_on_the_server(
    agent, adapter, cohort, make_user
):
    version = version_create_seeded(adapter=adapter, seed=1)
    _roll_out(version, cohort, make_user)
    message = agent.session.get("/api/v1/device/assignment/")
    tampered = json.loads(json.dumps(message))
    tampered["envelope"]["manifest"]["sha256"] = "0" * 64
    assert agent.apply(tampered) == {"status": "refused", "code": "bad_signature"}
    assignment = Assignment.objects.get(device=agent.device.device)
    assert assignment.state == "failed" and assignment.reason.startswith("refused: bad_signature")
    assert AdapterStore(agent.home).state()["current"] is None  # nothing was swapped in

    # A newer assignment arrives and is installed; replaying the older message is refused as stale.
    newer = version_create_seeded(adapter=adapter, seed=5)
    assignment_create(device=agent.device.device, version=newer)
    fresh = agent.session.get("/api/v1/device/assignment/")
    assert agent.apply(fresh)["status"] == "installed"
    assert agent.apply(message) == {"status": "refused", "code": "stale_sequence"}
    assert AdapterStore(agent.home).state()["current"]["sha256"] == newer.blob_sha256
