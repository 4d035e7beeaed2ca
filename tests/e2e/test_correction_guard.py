"""Users' corrections guard a rollout end to end (issue 52), real processes only: three agents run version 1
(trained, mostly right) and their users confirm most of its answers through ``Agent.feedback``; version 2 (its
classifier head scrambled, mostly wrong) goes out through a rollout guarded by ``correction_rate_change``; the
users correct most of its answers, the agents' heartbeats carry the counts, and the server's rollout tick rolls
version 2 back, saying which metric breached."""

from __future__ import annotations

import pytest
import torch

from edge_agent.api import Agent
from edge_agent.families.digits import load_split
from tests.e2e.support import product_stack
from tests.e2e.test_agent_lifecycle import _Api, _say
from tests.e2e.test_federated_round import _admin_token
from tests.e2e.test_rollout_lifecycle import _import, _running, _wait, enroll_agents, released_digits_adapter, run_agent

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
DEVICES = 3
ANSWERS = 10  # each user's answers on each version: 5 make a rate


def _users_answer(homes: list, version: int, start: int) -> tuple[int, int]:
    """Each device's user asks for ``ANSWERS`` predictions of the served ``version`` and gives every answer its
    true label (confirming it, or correcting it); returns (confirmed, corrected) over the devices."""
    _, test = load_split()
    x, y = test["x"][start : start + ANSWERS].clamp(0, 1).numpy(), test["y"][start : start + ANSWERS].tolist()
    outcomes = []
    for home in homes:
        agent = Agent(home)
        _wait(lambda agent=agent: agent.served()[1]["version"] == version, f"v{version} served", timeout=30)
        answer = agent.predict({"x": x})
        outcomes += [agent.feedback(i, int(label))["outcome"] for i, label in zip(answer["ids"], y, strict=True)]
    return outcomes.count("confirmed"), outcomes.count("corrected")


def test_a_version_users_correct_far_more_often_is_rolled_back_by_its_guard(tmp_path):
    with product_stack(tmp_path) as stack:
        api = _Api(stack.port, _admin_token(stack.env))
        adapter, good, v1 = released_digits_adapter(api)
        homes, device_ids = enroll_agents(api, tmp_path, stack.port, DEVICES)
        stack.agents += [run_agent(home, stack.env) for home in homes]

        # 1. Version 1 everywhere; its users confirm most of its answers.
        rollout = {"version": v1["id"], "cohort": "ring", "phases": [{"percent": 100, "min_soak_seconds": 0}]}
        status, first = api.call("POST", "/rollouts/", rollout)
        assert status == 201 and api.call("POST", f"/rollouts/{first['id']}/start/", {})[0] == 200, first
        _wait(lambda: api.call("GET", f"/rollouts/{first['id']}/")[1]["state"] == "completed", "v1 rollout")
        _wait(lambda: all(r.get("number") == v1["number"] for r in _running(api, device_ids)), "v1 installed")
        confirmed, corrected = _users_answer(homes, v1["number"], 0)
        _say(f"v1: users confirmed {confirmed} answers and corrected {corrected}")
        assert corrected <= DEVICES * ANSWERS * 0.3

        # 2. Version 2, mostly wrong (the head's rows shuffled), out through a rollout guarded on corrections.
        shuffle = torch.randperm(10, generator=torch.Generator().manual_seed(0))
        worse = {k: v[shuffle] if k.startswith("base_model.model.head") else v for k, v in good.items()}
        v2 = _import(api, adapter["id"], worse)
        override = {"reason": "to see users' corrections roll it back", "override": True}
        assert api.call("POST", f"/adapter-versions/{v2['id']}/release/", override)[0] == 200
        guard = {"metric": "correction_rate_change", "max": 0.1, "min_reports": 2}
        rollout = {"version": v2["id"], "cohort": "ring", "on_breach": "rollback", "guards": [guard],
                   "phases": [{"percent": 100, "min_soak_seconds": 600}]}  # fmt: skip
        status, second = api.call("POST", "/rollouts/", rollout)
        assert status == 201 and api.call("POST", f"/rollouts/{second['id']}/start/", {})[0] == 200, second
        _wait(lambda: all(r.get("number") == v2["number"] for r in _running(api, device_ids)), "v2 installed")
        assert api.call("GET", f"/rollouts/{second['id']}/")[1]["state"] == "running"  # no answers yet: no breach

        # 3. Its users correct most of its answers; the heartbeats carry the counts and the guard rolls it back.
        confirmed, corrected = _users_answer(homes, v2["number"], ANSWERS)
        _say(f"v2: users confirmed {confirmed} answers and corrected {corrected}")
        assert corrected >= DEVICES * ANSWERS * 0.6
        final = _wait(
            lambda: (lambda r: r if r["state"] == "rolled_back" else None)(
                api.call("GET", f"/rollouts/{second['id']}/")[1]
            ),
            "the guard's rollback",
            timeout=60,
        )
        _say(f"v2 rolled back: {final['state_reason']}")
        assert "correction_rate_change" in final["state_reason"] and "vs max 0.1" in final["state_reason"]
        shown = api.device(device_ids[0])["feedback"]  # (v2 then v1, or v1 again then v2 once it is back)
        assert {shown["current"]["version"], shown["previous"]["version"]} == {v1["number"], v2["number"]}
        assert shown["current"]["answered"] == shown["previous"]["answered"] == ANSWERS
