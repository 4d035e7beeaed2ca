"""A device's own model end to end (issue 25), real processes only: the launcher (web + Celery worker + beat) on
the machine's PostgreSQL and Redis, and `python -m edge_agent` as a device runs it.

Set up through the product's services (as ``demo.fleet_demo.seed`` does): a cohort, the ``digits-cnn`` base trained at
the factory (``demo.fleet_demo.factory_base``), an adapter whose devices keep their classifier head to themselves
(``private_modules``) and whose every accepted delta makes, releases and rolls out a version (fedavg, K = 1,
``auto_release``), version 1 rolled out, an enrollment token. The device is fed only by its application: one
inbox file of a user who names two pairs of digits the other way round (``digits_users``, ``concept``), beside a
malformed file and one still being written.

One device's life, in the order it happens: it takes its inbox (the good file stored whole, the malformed one set
aside with its reason, the partial one left alone), trains, serves its own model, which beats the shared version
on its local slice, and the server holds its report; its delta makes version 2, which it installs and judges its
kept head on before serving it; `add-samples` refuses a malformed file and stores nothing; a personal pass on
version 2 killed with SIGKILL is finished from its checkpoint by the next `train-once`, leaving version 2's body
with the device's own, further trained head; `predict` and `export --personal` give the model `Agent` serves.
"""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import uuid

import numpy as np
import peft
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from demo.fleet_demo import BASE_CONFIG, FACTORY_FRACTION
from edge_agent.api import Agent
from edge_agent.assignments import AdapterStore, build_model
from edge_agent.families import get_family
from edge_agent.families.common import take
from edge_agent.families.digits import load_split
from edge_agent.families.digits_users import factory_split, profile_for, user_data
from edge_agent.personal import PersonalStore, private_keys
from edge_agent.samples import SampleStore
from tests.e2e.support import (
    ROOT,
    drop_stack,
    free_port,
    kill,
    spawn,
    stack_env,
    start_launcher,
    stop_launcher,
    wait_for,
)
from tests.e2e.test_agent_lifecycle import _agent, _Api, _say

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(720)]

COHORT = "own-lab"
SAMPLES = 200
# A personal pass of 100 epochs (the most the setting allows) takes a few seconds on 200 samples: long enough to
# be killed in the middle of.
PERSONALIZATION = {"method": "private_modules", "private_modules": ["head"], "epochs": 100, "lr": 0.02}
# Every version released, whatever the server's evaluation says (release_margin 1): this is one device's life across
# versions, and one user who names digits their own way makes a version the release gate would hold back.
AGGREGATION = {"strategy": "fedavg", "buffer_size": 1, "min_deltas": 1, "auto_release": True, "release_margin": 1.0}

SETUP = """
import json
from datetime import timedelta
from django.utils import timezone
from accounts.services import api_token_create, user_create
from devices.services import cohort_create, enrollment_token_create
from demo.fleet_demo import BASE_CONFIG, factory_base
from training.rollouts.lifecycle import rollout_create, rollout_start
from training.registry.services import adapter_create, base_model_create, version_create_seeded, version_transition

admin = user_create(username={admin!r}, role="admin")
cohort = cohort_create(name={cohort!r})
base = base_model_create(name="digits", family="digits-cnn", family_config=BASE_CONFIG, weights=factory_base())
adapter = adapter_create(name="digits-lora", base_model=base, rank=4, alpha=8.0, cohorts=[cohort],
                         aggregation={aggregation!r}, personalization={personalization!r})
version = version_create_seeded(adapter=adapter, seed=1, note="e2e")
version_transition(version=version, action="release", actor=None, reason="e2e")
rollout = rollout_create(version=version, cohort=cohort, phases=[{{"percent": 100}}], actor=None)
rollout_start(rollout=rollout, actor=None)
enrollment = enrollment_token_create(cohort=cohort, name="e2e", expires_at=timezone.now() + timedelta(hours=1), uses=1,
                                     requires_approval=False)
print("SETUP=" + json.dumps({{"api_token": api_token_create(user=admin, name="e2e").raw, "enrollment": enrollment.raw,
                             "adapter": adapter.pk}}))
"""


def _set_up(env: dict) -> dict:
    code = SETUP.format(
        admin=f"e2e-admin-{uuid.uuid4().hex[:6]}",
        cohort=COHORT,
        aggregation=AGGREGATION,
        personalization=PERSONALIZATION,
    )
    shell = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shell.returncode == 0, shell.stdout + shell.stderr
    return json.loads(next(line for line in shell.stdout.splitlines() if line.startswith("SETUP=")).split("=", 1)[1])


def _user_data() -> tuple[dict, dict, dict]:
    """This user's samples: ``(inbox, extra, held_out)``, digits of the devices' pool (not the factory's) and of
    the test split, as a user who swaps two pairs of labels names them."""
    train, test = load_split()
    _, pool = factory_split(train["y"].numpy(), fraction=FACTORY_FRACTION)
    profile = profile_for("concept", 1)
    assert len(profile.swaps) == 2, profile
    mine = user_data(take(train, torch.as_tensor(pool[: SAMPLES + 20])), profile)
    held_out = user_data(test, profile)
    inbox, extra = (take(mine, part) for part in (slice(0, SAMPLES), slice(SAMPLES, None)))
    return {k: v.numpy() for k, v in inbox.items()}, {k: v.numpy() for k, v in extra.items()}, held_out


def _accuracy(model: torch.nn.Module, data: dict) -> float:
    with torch.no_grad():
        return float((model(data["x"]).argmax(-1) == data["y"]).float().mean())


def _current(home) -> dict:
    return AdapterStore(home).state().get("current") or {}


def test_an_inbox_fed_device_personalizes_reports_survives_a_kill_mid_pass_and_keeps_its_head_across_versions(
    tmp_path, monkeypatch
):
    env = stack_env(tmp_path, HEARTBEAT_INTERVAL_SECONDS="1", ROLLOUT_TICK_SECONDS="1", PRESENCE_FLUSH_SECONDS="1")
    # The device's processes on one thread each: torch's one per core spins on a shared two-core machine.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    agent_env = {k: v for k, v in env.items() if k not in ("DATABASE_URL", "REDIS_URL")} | {"OMP_NUM_THREADS": "1"}
    port = free_port()
    home = tmp_path / "device"
    inbox = home / "inbox"
    launcher = output = agent = agent_output = cut = None
    try:
        launcher, output = start_launcher(env, port)
        setup = _set_up(env)
        api = _Api(port, setup["api_token"])
        enrolled = _agent(
            home, "enroll", "--server", f"http://127.0.0.1:{port}", "--token", setup["enrollment"], "--name", "own-1"
        )
        assert enrolled.returncode == 0, enrolled.stdout + enrolled.stderr + "\n" + output.tail()
        device_id = json.loads((home / "agent.json").read_text())["device_id"]
        configured = _agent(home, "configure", "--data", "app", "--train-interval", "1", "--min-new-samples", "16")
        assert configured.returncode == 0, configured.stderr
        assert json.loads(configured.stdout)["data"] == {"kind": "app"}

        # 1. Fed only through the inbox: one good file, one malformed (a label out of range at sample 7), one
        # still being written.
        mine, extra, held_out = _user_data()
        assert inbox.is_dir() and str(inbox) in configured.stderr, configured.stderr  # made by configure
        np.savez(inbox / "today.npz", **mine)
        extra["y"][7] = 10
        np.savez(inbox / "bad-labels.npz", **extra)
        (inbox / "tomorrow.npz.part").write_bytes(b"half a file")

        agent, agent_output = spawn(
            [sys.executable, "-m", "edge_agent", "--home", str(home), "run", "--max-backoff", "2"], agent_env
        )
        personal = PersonalStore(home)
        first, waited = wait_for(
            lambda: (s := personal.state()).get("version") == 1 and s.get("pending") is None and s, timeout=150
        )
        assert first, "no personal model on version 1:\n" + agent_output.tail() + "\n" + output.tail(30)
        first_tensors = personal.tensors()
        _say(f"personal model on v1 after {waited:.0f}s: {first['shared_accuracy']} -> {first['personal_accuracy']}")

        assert sorted(p.name for p in inbox.iterdir()) == [".taking", "rejected", "tomorrow.npz.part"]
        assert (inbox / "tomorrow.npz.part").read_bytes() == b"half a file" and not any((inbox / ".taking").iterdir())
        assert sorted(p.name for p in (inbox / "rejected").iterdir()) == ["bad-labels.npz", "bad-labels.npz.reason.txt"]
        reason = (inbox / "rejected" / "bad-labels.npz.reason.txt").read_text()
        assert "sample 7: field 'y' is 10.0, outside int64 [] in [0, 9]" in reason, reason
        stored = SampleStore(home / "samples").load()
        assert len(stored["y"]) == SAMPLES  # the good file whole, nothing of the malformed one
        assert np.array_equal(stored["y"], mine["y"]) and np.array_equal(stored["x"], mine["x"])

        assert first["method"] == "private_modules" and first["serving"] == "personal", first
        assert first["val_samples"] == SAMPLES // 10 and first["trained_samples"] == SAMPLES * 8 // 10, first
        assert first["personal_accuracy"] > first["shared_accuracy"] + 0.1, first

        def reported():
            status, body = api.call("GET", f"/devices/{device_id}/personalization/")
            assert status == 200, body
            return body["results"][0] if body["results"] else None

        report, _ = wait_for(reported, timeout=30, interval=0.5)
        assert report, "the device's personal report never reached the server:\n" + agent_output.tail()
        assert (report["adapter"], report["version"], report["method"], report["serving"]) == (
            "digits-lora", 1, "private_modules", "personal"
        ), report  # fmt: skip
        assert report["personal_accuracy"] == pytest.approx(first["personal_accuracy"])
        assert report["shared_accuracy"] == pytest.approx(first["shared_accuracy"])
        assert report["gain_points"] > 10 and report["val_samples"] == SAMPLES // 10, report
        status, summary = api.call("GET", f"/adapters/{setup['adapter']}/personalization/")
        assert status == 200, summary
        assert summary["personalization"] == {**summary["personalization"], **PERSONALIZATION}, summary
        fleet = summary["fleet"]
        assert fleet["devices"] == 1 and fleet["devices_gaining"] == 1 and fleet["serving"]["personal"] == 1, fleet
        assert fleet["methods"] == {"private_modules": 1} and fleet["mean_gain_points"] > 10, fleet
        assert [(c["cohort"], c["devices"]) for c in summary["cohorts"]] == [(COHORT, 1)], summary

        # 3. The device's delta makes version 2 (K = 1), released and rolled out; the running agent installs it and,
        # with no shared pass due, refits its own head to the new body (the personal pass alone) and judges it against
        # version 2 before serving it.
        installed, waited = wait_for(lambda: _current(home).get("version") == 2, timeout=90, interval=0.5)
        assert installed, "version 2 never installed:\n" + agent_output.tail() + "\n" + output.tail(30)
        v2 = _current(home)
        _say(f"version 2 installed {waited:.0f}s after the first personal model")
        status, rounds = api.call("GET", "/rounds/?state=completed")
        assert status == 200 and [r["result_version"] for r in rounds["results"]] == [2], rounds
        status, deltas = api.call("GET", f"/deltas/?round={rounds['results'][0]['id']}")
        assert status == 200 and [d["device"] for d in deltas["results"]] == [device_id], deltas
        judged, _ = wait_for(lambda: (s := personal.state()).get("shared_sha256") == v2["sha256"] and s, timeout=30)
        assert judged and judged["version"] == 2 and judged["pending"] is None, personal.state()
        # its own model, unless the held slice says the shared one is better by the margin (and beyond chance)
        worse = judged["shared_accuracy"] >= judged["personal_accuracy"] + 0.01  # the default margin
        assert judged["serving"] == "personal" or worse, judged
        assert Agent(home).predict({"x": held_out["x"][:5].numpy()})["serving"] == judged["serving"]
        _say(f"on v2 before any pass: shared {judged['shared_accuracy']}, own head {judged['personal_accuracy']}")
        report, _ = wait_for(lambda: (r := reported()) and r["version"] == 2 and r, timeout=30, interval=0.5)
        assert report and report["serving"] == judged["serving"], report
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0, agent_output.tail()
        agent = None

        previous = AdapterStore(home).state()["previous"]
        v1_tensors, v2_tensors = load_file(previous["path"]), load_file(v2["path"])
        head = private_keys(v2_tensors, ["head"])
        assert head and head < set(v2_tensors)
        # The head never left the device: the delta carried no change of it, so version 2's is version 1's.
        assert all(torch.equal(v1_tensors[k], v2_tensors[k]) for k in head)
        assert any(not torch.equal(v1_tensors[k], v2_tensors[k]) for k in set(v2_tensors) - head)
        kept = personal.tensors()  # version 2's body with the device's own head, refitted to it
        assert all(torch.equal(kept[k], v2_tensors[k]) for k in set(kept) - head)
        assert any(not torch.equal(kept[k], first_tensors[k]) for k in head)
        assert all(not torch.equal(kept[k], v2_tensors[k]) for k in head)  # still the device's own

        # 5. A malformed file handed to add-samples is refused with its reason; nothing is stored.
        refused = _agent(home, "add-samples", str(inbox / "rejected" / "bad-labels.npz"))
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "refused, nothing stored: sample 7: field 'y' is 10.0" in refused.stderr, refused.stderr
        assert len(SampleStore(home / "samples")) == SAMPLES

        # 2. Killed in the middle of the personal pass on version 2, it resumes it whole from its checkpoint.
        cut, cut_output = spawn(
            [sys.executable, "-m", "edge_agent", "--home", str(home), "train-once", "--force"], agent_env
        )

        def mid_pass() -> bool:
            pending = personal.state().get("pending") or {}
            return pending.get("sha256") == v2["sha256"] and any(personal.checkpoint_dir.glob("ckpt-*.pt"))

        hit, _ = wait_for(mid_pass, timeout=90, interval=0.02)
        assert hit, "no personal pass with a checkpoint on version 2:\n" + cut_output.tail()
        cut.send_signal(signal.SIGKILL)
        cut.wait(timeout=10)
        cut = None
        state = personal.state()
        assert (state["pending"] or {}).get("sha256") == v2["sha256"], "the pass ended before the kill: " + str(state)
        assert state["file"] == judged["file"] and set(personal.tensors()) == set(v2_tensors)  # the old pair, whole
        _say(f"killed mid-pass with checkpoints {sorted(p.name for p in personal.checkpoint_dir.glob('ckpt-*.pt'))}")

        resumed = _agent(home, "train-once", timeout=120)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        outcome = json.loads(resumed.stdout)
        assert (outcome["status"], outcome["reason"]) == ("personalized", "finished a personal pass that was cut short")
        state = personal.state()
        assert state["pending"] is None and state["version"] == 2 and state["shared_sha256"] == v2["sha256"], state
        assert any(note.startswith("resumed from the checkpoint at step") for note in state["notes"]), state["notes"]
        assert state["serving"] == "personal" and state["personal_accuracy"] > state["shared_accuracy"] + 0.1, state
        assert not any(personal.checkpoint_dir.glob("ckpt-*.pt"))
        with safe_open(str(personal.root / state["file"]), "pt") as handle:
            assert set(handle.keys()) == set(v2_tensors)
            after = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        assert all(after[k].shape == v2_tensors[k].shape and torch.isfinite(after[k]).all() for k in after)

        # 3. Re-derived from version 2: its body is version 2's, its head the device's own, trained on.
        assert all(torch.equal(after[k], v2_tensors[k]) for k in set(after) - head)
        assert all(not torch.equal(after[k], v2_tensors[k]) for k in head)
        assert any(not torch.equal(after[k], kept[k]) for k in head)
        served = Agent(home).model()
        base_path = AdapterStore(home).base_path(AdapterStore(home).state()["base_model_sha256"])
        shared = build_model(v2["training"], v2_tensors, base_path)
        assert _accuracy(served, held_out) > _accuracy(shared, held_out) + 0.1  # on digits it never trained on

        # 4. predict and export --personal give the served model.
        questions = tmp_path / "questions.npz"
        np.savez(questions, x=held_out["x"][:40].numpy())
        predicted = _agent(home, "predict", str(questions))
        assert predicted.returncode == 0, predicted.stderr
        answers = [json.loads(line) for line in predicted.stdout.splitlines()]
        with torch.no_grad():
            assert [a["label"] for a in answers] == served(held_out["x"][:40]).argmax(-1).tolist()
        assert {(a["serving"], a["version"], a["method"]) for a in answers} == {("personal", 2, "private_modules")}
        exported = _agent(home, "export", "--personal", str(tmp_path / "export"))
        assert exported.returncode == 0, exported.stderr
        base = get_family("digits-cnn").build(BASE_CONFIG)
        base.load_state_dict(load_file(str(base_path)))
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "export").eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(held_out["x"]), served(held_out["x"]), atol=1e-5, rtol=1e-5)
    finally:
        kill(agent)
        kill(cut)
        if launcher is not None:
            stop_launcher(launcher)
        drop_stack(env)
