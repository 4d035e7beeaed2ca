"""A team's own model end to end, without a line of code on the server or the devices (issue 51): a 1-D CNN on
sensor windows saved with ``torch.export.save`` (``demo/sensor_model.py``) and its card are uploaded through the
API; an adapter is made with the defaults the base suggests; version 1 is rolled out; two ``edge-agent run``
devices, each wearing its own sensor, are fed by their application through ``edge-agent add-samples``; their
deltas are verified and aggregated into version 2; each device personalizes the model (its own model beats the
shared one on its own sensor), answers ``predict``, and exports its adapter with the card that says how to merge
it into the team's own model, which then gives the agent's answers.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from demo.sensor_model import CARD, SENSORS, export_bytes, trained_model, windows
from edge_agent.families.exported import merged_state_dict
from tests.e2e.support import multipart_post, product_stack, spawn, wait_for
from tests.e2e.test_agent_lifecycle import _agent, _Api, _say
from tests.e2e.test_federated_round import _admin_token
from tests.e2e.test_rollout_lifecycle import enroll_agents

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
DEVICES = 2


def test_an_uploaded_exported_model_is_trained_aggregated_personalized_and_exported_by_real_agents(tmp_path):
    model = trained_model(seed=0)
    with product_stack(tmp_path) as stack:
        api = _Api(stack.port, _admin_token(stack.env))
        assert api.call("POST", "/cohorts/", {"name": "wearables"})[0] == 201
        fields = {"name": "wrist-cnn", "family": "exported-program", "family_config": json.dumps(CARD)}
        upload = {"weights": ("sensor.pt2", export_bytes(model))}
        status, base = multipart_post(f"{api.base}/base-models/", api.token, fields, upload)
        assert status == 201, base
        status, modules = api.call("GET", f"/base-models/{base['id']}/modules/")
        assert status == 200 and [m["name"] for m in modules["modules"]] == ["conv1", "conv2", "fc", "head"], modules
        status, adapter = api.call("POST", "/adapters/", {"name": "wrist-lora", "base_model": "wrist-cnn",
                                                          "cohorts": ["wearables"]})  # fmt: skip
        assert status == 201, adapter
        assert (adapter["target_modules"], adapter["modules_to_save"]) == (["conv1", "conv2", "fc"], ["head"])
        body = {"aggregation": {"strategy": "fedavg", "buffer_size": DEVICES, "min_deltas": DEVICES}}
        assert api.call("PUT", f"/adapters/{adapter['id']}/aggregation/", body)[0] == 200
        status, v1 = api.call("POST", f"/adapters/{adapter['id']}/versions/seed/", {"seed": 1})
        assert status == 201, v1
        assert api.call("POST", f"/adapter-versions/{v1['id']}/release/", {"reason": "e2e"})[0] == 200
        rollout = {"version": v1["id"], "cohort": "wearables", "phases": [{"percent": 100}]}
        status, started = api.call("POST", "/rollouts/", rollout)
        assert status == 201 and api.call("POST", f"/rollouts/{started['id']}/start/", {})[0] == 200, started

        homes, _ = enroll_agents(api, tmp_path, stack.port, DEVICES, cohort="wearables")
        sensors = [SENSORS[1], SENSORS[2]]  # two wearers whose sensors differ from the factory's and each other's
        for home in homes:
            configured = _agent(home, "configure", "--data", "app", "--min-new-samples", "32", "--train-interval", "1")
            assert configured.returncode == 0, configured.stderr
            run = [sys.executable, "-m", "edge_agent", "--home", str(home), "run", "--max-backoff", "2"]
            stack.agents.append(spawn(run, stack.env))

        def installed(home):
            status = json.loads(_agent(home, "status").stdout or "{}")
            return ((status.get("versions") or {}).get("current") or {}).get("version") == 1

        for home in homes:
            ok, _ = wait_for(lambda home=home: installed(home), timeout=120, interval=1)
            assert ok, "version 1 was never installed:\n" + stack.agents[0][1].tail() + "\n" + stack.output.tail()
        tests = []
        for i, (home, (offset, gain, noise)) in enumerate(zip(homes, sensors, strict=True)):
            path = tmp_path / f"wrist-{i}.npz"
            np.savez(path, **windows(96, seed=10 + i, offset=offset, gain=gain, noise=noise))
            added = _agent(home, "add-samples", str(path))
            assert added.returncode == 0, added.stdout + added.stderr
            tests.append(windows(100, seed=500 + i, offset=offset, gain=gain, noise=noise))
        _say(f"{DEVICES} agents fed by their applications; waiting for the round")

        def completed():
            status, rounds = api.call("GET", "/rounds/?state=completed")
            return rounds["results"][0] if status == 200 and rounds["results"] else None

        done_round, waited = wait_for(completed, timeout=240, interval=1)
        assert done_round, "no round completed:\n" + stack.agents[0][1].tail() + "\n" + stack.output.tail()
        status, deltas = api.call("GET", f"/deltas/?round={done_round['id']}&page_size=50")
        assert status == 200 and deltas["count"] == DEVICES, deltas
        assert all(d["state"] == "aggregated" for d in deltas["results"]), deltas
        _say(f"round completed from {DEVICES} deltas into v{done_round['result_version']} after {waited:.0f}s")

        for i, home in enumerate(homes):

            def personal(home=home):
                status = json.loads(_agent(home, "status").stdout or "{}")
                return status.get("personal") if (status.get("personal") or {}).get("personal_accuracy") else None

            report, _ = wait_for(personal, timeout=120, interval=1)
            assert report, "no personal model reported:\n" + stack.agents[i][1].tail()
            test_file = tmp_path / f"test-{i}.npz"
            np.savez(test_file, window=tests[i]["window"])
            answered = _agent(home, "predict", str(test_file))
            assert answered.returncode == 0, answered.stderr
            answers = [json.loads(line) for line in answered.stdout.splitlines()]
            served = float(np.mean([a["label"] for a in answers] == tests[i]["y"]))
            with torch.no_grad():
                factory = float((model(torch.as_tensor(tests[i]["window"])).argmax(-1).numpy() == tests[i]["y"]).mean())
            _say(
                f"wrist-{i}: serving {report['serving']}, held slice {report['shared_accuracy']:.2f} -> "
                f"{report['personal_accuracy']:.2f}; its test windows {factory:.2f} (factory) -> {served:.2f}"
            )
            assert served >= factory, (served, factory, report)

            exported = _agent(home, "export", "--personal", str(tmp_path / f"export-{i}"))
            assert exported.returncode == 0, exported.stderr
            card = json.loads((tmp_path / f"export-{i}" / "adapter_card.json").read_text())
            tensors = load_file(str(tmp_path / f"export-{i}" / "adapter_model.safetensors"))
            mine = trained_model(seed=0)
            mine.load_state_dict(merged_state_dict(mine.state_dict(), tensors, card))
            with torch.no_grad():
                probabilities = torch.softmax(mine(torch.as_tensor(tests[i]["window"])), -1)
            if report["serving"] == "personal":  # the export is the model the device serves
                expected = torch.tensor([a["probabilities"] for a in answers])
                torch.testing.assert_close(probabilities, expected, atol=2e-6, rtol=0)
