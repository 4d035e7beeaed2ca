"""The agent applying assignments against the real server: verify, download, swap, keep previous, report."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from devices.models import Device
from devices.server_key import server_public_key_b64
from edge_agent.assignments import AdapterStore, AssignmentHandler
from edge_agent.identity import AgentState
from edge_agent.rest import DeviceSession, ServerError
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


class _Records(logging.Handler):
    """The records a logger emits, whatever its propagation (Django's loggers do not propagate to the root)."""

    def __init__(self, name: str):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.logger = logging.getLogger(name)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self):
        self.logger.addHandler(self)
        return self.records

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


def test_an_assignment_superseded_while_the_device_works_on_it_is_an_expected_outcome_on_both_ends(
    agent, adapter, cohort, caplog
):
    """The server assigned v1, then v2 before the device reported on v1 (a new round's version, say): the device's
    reports on v1 are answered 409 assignment_superseded; the device drops v1 (nothing downloaded or installed),
    logs it at INFO without "could not", and installs v2 next. The server logs no warning for the 409s."""
    first, second, third = (version_create_seeded(adapter=adapter, seed=seed) for seed in (1, 2, 3))
    assignment_create(device=agent.device.device, version=first)
    message = agent.session.get("/api/v1/device/assignment/")
    assignment_create(device=agent.device.device, version=second)  # while the device holds v1's message

    with caplog.at_level(logging.INFO), _Records("django.request") as server_warnings:
        assert agent.apply(message) == {"status": "superseded", "version": 1}
        assert AdapterStore(agent.home).state()["current"] is None  # neither downloaded nor installed
        assert not (agent.home / "adapters" / adapter.name).exists()

        # Superseded after it was delivered, while it installs (here: while it is evaluated): installed locally,
        # and the installed report is answered as the delivered one was.
        newer = agent.session.get("/api/v1/device/assignment/")
        agent.evaluate = lambda previous, candidate, manifest: (
            assignment_create(device=agent.device.device, version=third) and {"val_accuracy": 0.9}
        )
        assert agent.apply(newer) == {"status": "installed", "version": 2}
        agent.evaluate = None
        assert agent.apply(agent.session.get("/api/v1/device/assignment/")) == {"status": "installed", "version": 3}

    agent_lines = [r for r in caplog.records if r.name.startswith("edge_agent")]
    assert not [r for r in agent_lines if r.levelno >= logging.WARNING or "could not" in r.getMessage()], [
        r.getMessage() for r in agent_lines
    ]
    withdrawn = [r.getMessage() for r in agent_lines if "withdrawn by the server" in r.getMessage()]
    assert len(withdrawn) == 2 and "delivered" in withdrawn[0] and "installed" in withdrawn[1], withdrawn
    assert not [r for r in server_warnings if r.levelno >= logging.WARNING], [r.getMessage() for r in server_warnings]
    answered = [r.getMessage() for r in caplog.records if r.name == "core.api"]
    assert len(answered) == 2 and all("(assignment_superseded)" in line for line in answered), answered
    states = dict(Assignment.objects.filter(device=agent.device.device).values_list("version__number", "state"))
    assert states == {1: "superseded", 2: "superseded", 3: "installed"}


def test_a_report_on_a_superseded_assignment_is_a_409_with_its_own_code_and_other_conflicts_still_warn(agent, adapter):
    first, second = (version_create_seeded(adapter=adapter, seed=seed) for seed in (1, 2))
    old = assignment_create(device=agent.device.device, version=first)
    assignment_create(device=agent.device.device, version=second)
    path = f"/api/v1/device/assignments/{old.pk}/report/"
    with _Records("django.request") as server_warnings:
        with pytest.raises(ServerError) as refused:
            agent.session.post(path, {"status": "installed", "reason": "", "metrics": {}})
        assert (refused.value.status, refused.value.code) == (409, "assignment_superseded")
        assert "assignment 1 is superseded (superseded by assignment 2)" in refused.value.message
        assert not server_warnings
        current = Assignment.objects.get(device=agent.device.device, state="pending")
        agent.session.post(f"/api/v1/device/assignments/{current.pk}/report/", {"status": "installed"})
        with pytest.raises(ServerError) as again:  # installed twice: a client's mistake, still a warning
            agent.session.post(f"/api/v1/device/assignments/{current.pk}/report/", {"status": "installed"})
        assert again.value.code == "invalid_transition"
        assert [r.levelno for r in server_warnings] == [logging.WARNING]
