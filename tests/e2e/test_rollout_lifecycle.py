"""Rollouts end to end, real processes only: version 1 goes to a cohort in two phases, the agents download,
verify, install and report, and the rollout advances; then a version that is worse on the devices' own
data breaches its guard in the first phase, is rolled back automatically, and every device returns to
version 1 (a new, newer-sequenced assignment pointing at the old version)."""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
import torch
from safetensors.torch import save as save_safetensors

from edge_agent.families import get_family
from edge_agent.families.digits import load_split
from edge_agent.lora_layers import adapter_tensors, apply_adapter
from edge_agent.training import TrainConfig, train_adapter
from tests.e2e.support import (
    drop_stack,
    free_port,
    kill,
    multipart_post,
    spawn,
    stack_env,
    start_launcher,
    stop_launcher,
)
from tests.e2e.test_agent_lifecycle import _agent, _Api, _say
from tests.e2e.test_federated_round import _admin_token

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
DEVICES = 4


def _trained_adapter(adapter: dict, family_config: dict) -> dict[str, torch.Tensor]:
    """A good version 1: the adapter trained centrally for a moment on the digits training split."""
    family = get_family("digits-cnn")
    model = apply_adapter(
        family.build(family_config),
        None,
        rank=adapter["rank"],
        alpha=adapter["alpha"],
        target_modules=adapter["target_modules"],
        modules_to_save=adapter["modules_to_save"],
        seed=1,
    )
    train, test = load_split()
    result = train_adapter(model, train, test, config=TrainConfig(epochs=4, lr=0.01), family=family)
    assert result.after["accuracy"] > 0.8, result.after
    return adapter_tensors(model)


def _import(api: _Api, adapter_id: int, tensors: dict) -> dict:
    data = save_safetensors({k: v.contiguous() for k, v in tensors.items()})
    files = {"adapter_model": ("adapter_model.safetensors", data)}
    status, body = multipart_post(f"{api.base}/adapters/{adapter_id}/versions/import/", api.token, {}, files)
    assert status == 201, body
    return body


def _running(api: _Api, device_ids: list[str]) -> list:
    return [(api.device(d).get("running_version") or {}) for d in device_ids]


def _wait(check, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def released_digits_adapter(api: _Api) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """Cohort ``ring``, the digits base model and an adapter on it that serves ``ring``, and a good version 1
    (``_trained_adapter``) imported and released: ``(adapter, v1's tensors, v1)``."""
    family_config = {"seed": 1}
    assert api.call("POST", "/cohorts/", {"name": "ring"})[0] == 201
    base = {"name": "digits", "family": "digits-cnn", "family_config": family_config}
    assert api.call("POST", "/base-models/", base)[0] == 201
    status, adapter = api.call(
        "POST",
        "/adapters/",
        {"name": "digits-lora", "base_model": "digits", "rank": 4, "alpha": 8.0, "cohorts": ["ring"]},
    )
    assert status == 201, adapter
    good = _trained_adapter(adapter, family_config)
    v1 = _import(api, adapter["id"], good)
    assert api.call("POST", f"/adapter-versions/{v1['id']}/release/", {"reason": "good"})[0] == 200
    return adapter, good, v1


def enroll_agents(api: _Api, tmp_path, port: int, count: int, cohort: str = "ring") -> tuple[list, list[str]]:
    """``count`` agent homes enrolled in ``cohort`` (no approval needed): their homes and device ids."""
    expires = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    status, issued = api.call(
        "POST",
        "/enrollment-tokens/",
        {"cohort": cohort, "name": cohort, "expires_at": expires, "uses": 10, "requires_approval": False},
    )
    assert status == 201, issued
    homes, device_ids = [tmp_path / f"device-{i}" for i in range(count)], []
    for i, home in enumerate(homes):
        server = f"http://127.0.0.1:{port}"
        done = _agent(home, "enroll", "--server", server, "--token", issued["token"], "--name", f"{cohort}-{i}")
        assert done.returncode == 0, done.stderr
        device_ids.append(json.loads((home / "agent.json").read_text())["device_id"])
    return homes, device_ids


def run_agent(home, env: dict):
    """``edge-agent run`` of ``home``, training nothing, back within 2 s of a lost connection."""
    run = [sys.executable, "-m", "edge_agent", "--home", str(home), "run", "--no-training", "--max-backoff", "2"]
    return spawn(run, env)


def test_a_two_phase_rollout_installs_and_a_worse_version_is_rolled_back_automatically(tmp_path):
    env = stack_env(tmp_path, HEARTBEAT_INTERVAL_SECONDS="2", ROLLOUT_TICK_SECONDS="1", PRESENCE_FLUSH_SECONDS="1")
    port = free_port()
    launcher = output = None
    agents: list = []
    try:
        launcher, output = start_launcher(env, port)
        api = _Api(port, _admin_token(env))
        adapter, good, v1 = released_digits_adapter(api)
        homes, device_ids = enroll_agents(api, tmp_path, port, DEVICES)
        for i, home in enumerate(homes):  # the devices' own samples: the install's guard metrics are measured on them
            assert _agent(home, "configure", "--simulate-device", f"{i}/{DEVICES}").returncode == 0
        agents += [run_agent(home, env) for home in homes]

        # 1. Version 1 in two phases: half the cohort, a soak, then everyone.
        status, rollout = api.call(
            "POST",
            "/rollouts/",
            {
                "version": v1["id"],
                "cohort": "ring",
                "phases": [{"percent": 50, "min_soak_seconds": 3}, {"percent": 100, "min_soak_seconds": 0}],
                "guards": [{"metric": "val_accuracy", "min": 0.5, "min_reports": 1}],
            },
        )
        assert status == 201, rollout
        assert api.call("POST", f"/rollouts/{rollout['id']}/start/", {"reason": "v1"})[0] == 200
        _wait(lambda: api.call("GET", f"/rollouts/{rollout['id']}/")[1]["state"] == "completed", "v1 rollout")
        _wait(lambda: all(r.get("number") == v1["number"] for r in _running(api, device_ids)), "v1 installed")
        detail = api.call("GET", f"/rollouts/{rollout['id']}/")[1]
        _say(f"v1 rolled out to {DEVICES} devices in 2 phases: {detail.get('progress')}")

        # 2. A worse version: the classifier head scrambled. Its guard breaches in phase 1: rolled back.
        worse = {
            k: (
                v[torch.randperm(v.shape[0], generator=torch.Generator().manual_seed(0))]
                if k.startswith("base_model.model.head")
                else v
            )
            for k, v in good.items()
        }
        v2 = _import(api, adapter["id"], worse)
        # the release gate refuses it (the server's evaluation says it is worse than v1); the operator overrides
        # it, to see the devices' guard roll it back
        status, refused = api.call("POST", f"/adapter-versions/{v2['id']}/release/", {"reason": "worse"})
        assert status == 409 and refused["error"]["code"] == "release_gate_failed", refused
        override = {"reason": "a guarded rollout to see it rolled back", "override": True}
        status, released = api.call("POST", f"/adapter-versions/{v2['id']}/release/", override)
        assert status == 200 and released["gate"]["verdict"] == "overridden", released
        status, rollout2 = api.call(
            "POST",
            "/rollouts/",
            {
                "version": v2["id"],
                "cohort": "ring",
                "on_breach": "rollback",
                "phases": [{"percent": 50, "min_soak_seconds": 60}, {"percent": 100}],
                "guards": [{"metric": "val_accuracy_change", "min": -0.05, "min_reports": 1}],
            },
        )
        assert status == 201, rollout2
        assert api.call("POST", f"/rollouts/{rollout2['id']}/start/", {"reason": "v2"})[0] == 200
        final = _wait(
            lambda: (lambda r: r if r["state"] == "rolled_back" else None)(
                api.call("GET", f"/rollouts/{rollout2['id']}/")[1]
            ),
            "automatic rollback",
        )
        _say(f"v2 rolled back: {final.get('state_reason')}")
        assert "val_accuracy_change" in final["state_reason"]
        _wait(lambda: all(r.get("number") == v1["number"] for r in _running(api, device_ids)), "back on v1")
    finally:
        for process, _ in agents:
            kill(process)
        if launcher is not None:
            stop_launcher(launcher)
        drop_stack(env)
