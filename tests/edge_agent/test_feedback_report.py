"""The heartbeat's ``feedback`` object (issue 52, "Operators see it"): the answers users confirmed and corrected of
the installed version and of the version the device ran before, and the samples feedback made, built from the
agent's own answers file and adapter store; what it builds is what the wire schema accepts. Real files, real agent
objects, no mocks."""

from __future__ import annotations

import numpy as np

from edge_agent.api import Agent
from edge_agent.feedback import Answers, heartbeat_feedback
from edge_agent.wire import HeartbeatState, validated
from tests.edge_agent.personal_support import device, install, training_manifest


def _give(agent: Agent, x: np.ndarray, *, corrected: int) -> None:
    """Predict ``x`` and answer every answer: the first ``corrected`` with another label, the rest confirmed."""
    answer = agent.predict({"x": x})
    for index, (answer_id, label) in enumerate(zip(answer["ids"], answer["labels"], strict=True)):
        agent.feedback(answer_id, (label + 1) % 10 if index < corrected else label)


def test_the_heartbeat_reports_the_installed_and_the_previous_version_s_counts_and_the_samples(app_home, digits):
    family, train, _ = digits
    x = train["x"][:20].clamp(0, 1).numpy()
    runtime = device(app_home, scenario="none")
    assert runtime.heartbeat()["feedback"] == {  # installed, no answer yet: zeros, no version before
        "adapter": "digits-lora",
        "current": {"version": 1, "confirmed": 0, "corrected": 0},
        "previous": None,
        "feedback_samples": 0,
        "samples": 0,
        "unlabeled_samples": 0,
    }
    agent = Agent(app_home)
    _give(agent, x[:6], corrected=1)
    agent.predict({"x": x[6:8]})  # answers no user answered count nowhere
    training = training_manifest(family, {"method": "none"})
    install(app_home, family.build({"seed": 0}), family, version=2, training=training)
    agent = Agent(app_home)  # (one that served v1 builds v2 in the background, answering with v1 meanwhile)
    _give(agent, x[8:16], corrected=6)
    agent.add_samples({"x": x[16:19]})  # without labels
    beat = runtime.heartbeat()
    assert beat["feedback"] == {
        "adapter": "digits-lora",
        "current": {"version": 2, "confirmed": 2, "corrected": 6},
        "previous": {"version": 1, "confirmed": 5, "corrected": 1},
        "feedback_samples": 14,
        "samples": 14,
        "unlabeled_samples": 3,
    }
    assert validated(HeartbeatState, {"seq": 1, **beat}).to_dict()["feedback"] == beat["feedback"]


def test_no_report_before_a_version_is_installed_and_none_of_another_adapter_s_previous_version(tmp_path, digits):
    assert heartbeat_feedback(Answers(tmp_path), {}, 0) is None
    assert not (tmp_path / "answers.sqlite3").exists()  # reading made no file
    state = {
        "current": {"adapter": "digits-lora", "version": 3},
        "previous": {"adapter": "other-lora", "version": 2},
    }
    assert heartbeat_feedback(Answers(tmp_path), state, 7)["previous"] is None
    state["previous"] = {"adapter": "digits-lora", "version": 3}  # the same version installed again
    assert heartbeat_feedback(Answers(tmp_path), state, 7)["previous"] is None
