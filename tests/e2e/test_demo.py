"""The demo a new user sees: the run command seeds a setup and a fleet of 12 simulated devices running the
real agent code; within five minutes at least three rounds complete and the adapter's accuracy on the
server's evaluation set rises above version 1's (checked through the API the dashboard's chart reads)."""

from __future__ import annotations

import time

import pytest

from tests.e2e.support import drop_stack, free_port, stack_env, start_launcher, stop_launcher
from tests.e2e.test_agent_lifecycle import _Api, _say
from tests.e2e.test_federated_round import _admin_token

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]


def test_the_run_command_brings_up_a_demo_fleet_that_completes_rounds_and_improves_accuracy(tmp_path):
    env = stack_env(tmp_path, ROLLOUT_TICK_SECONDS="2")
    port = free_port()
    launcher = output = None
    try:
        started = time.monotonic()
        launcher, output = start_launcher(env, port, demo_devices=12)
        assert any("demo fleet: 12 simulated devices" in line for line in output.lines), output.tail()
        api = _Api(port, _admin_token(env))
        deadline = started + 300
        completed, versions = 0, []
        while time.monotonic() < deadline:
            status, rounds = api.call("GET", "/rounds/?state=completed&page_size=100")
            completed = rounds.get("count", 0) if status == 200 else 0
            status, listing = api.call("GET", "/adapter-versions/?adapter__name=digits-lora&page_size=200")
            versions = sorted(listing.get("results", []), key=lambda v: v["number"]) if status == 200 else []
            accuracies = [v["metrics"].get("eval_accuracy") for v in versions]
            if completed >= 3 and len(accuracies) > 1 and max(accuracies[1:]) > accuracies[0] + 0.1:
                break
            time.sleep(5)
        _say(
            f"after {time.monotonic() - started:.0f}s: {completed} rounds; accuracy by version: "
            + ", ".join(f"v{v['number']}={v['metrics'].get('eval_accuracy')}" for v in versions)
        )
        assert completed >= 3, output.tail(80)
        assert versions[0]["metrics"]["eval_accuracy"] is not None
        best = max(v["metrics"]["eval_accuracy"] for v in versions[1:])
        assert best > versions[0]["metrics"]["eval_accuracy"] + 0.1, versions
        status, rejected = api.call("GET", "/deltas/?state=rejected")
        assert status == 200 and rejected["count"] >= 1  # the misbehaving device is caught
        assert {d["rejection_code"] for d in rejected["results"]} == {"norm_too_large"}
        status, devices = api.call("GET", "/devices/?page_size=50")
        assert devices["count"] == 12
    finally:
        if launcher is not None:
            stop_launcher(launcher)
        drop_stack(env)
