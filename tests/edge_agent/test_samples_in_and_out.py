"""Samples in from the device's application (the Python API, files, the inbox) and the personal model out
(predict, the served model, a PEFT export): each bad input refused with its reason and nothing stored."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from edge_agent.api import Agent, NotReady
from edge_agent.families.digits_users import profile_for, user_data
from edge_agent.inbox import Inbox
from edge_agent.sample_files import SampleError
from edge_agent.samples import SampleStore
from tests.edge_agent.personal_support import device, install, training_manifest

DITTO = {"method": "ditto", "lambda": 0.05, "epochs": 6, "lr": 0.01}


@pytest.fixture
def home(tmp_path, digits, pretrained_base):
    family, _, _ = digits
    install(tmp_path, pretrained_base, family, version=1, training=training_manifest(family, DITTO))
    return tmp_path


def _user_samples(digits, n=200):
    _, train, _ = digits
    data = user_data({k: v[:n] for k, v in train.items()}, profile_for("feature", 5))
    return {"x": data["x"].clamp(0, 1).numpy(), "y": data["y"].numpy()}


def test_an_agent_without_a_version_cannot_take_samples_yet(tmp_path):
    """Refused, with what to do: the schema comes with the first version; the inbox keeps files until then."""
    with pytest.raises(NotReady, match="no adapter installed yet") as refused:
        Agent(tmp_path).add_samples({"x": np.zeros((1, 1, 8, 8)), "y": [1]})
    assert "`edge-agent status` shows a version installed" in str(refused.value)
    assert "inbox" in str(refused.value)
    assert not (tmp_path / "samples").exists() or not any((tmp_path / "samples").iterdir())


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ({"y": [1, 2]}, "missing \\['x'\\]"),  # (without 'y' a batch is unlabeled: tests/edge_agent/test_unlabeled.py)
        ({"x": np.zeros((2, 1, 8, 8)), "y": [1, 2], "z": [0, 0]}, "unknown \\['z'\\]"),
        ({"x": np.zeros((2, 1, 8, 8)), "y": [1]}, "same number"),
        ({"x": np.zeros((2, 1, 8, 7)), "y": [1, 2]}, "each sample needs float32 \\[1, 8, 8\\]"),
        ({"x": np.full((2, 1, 8, 8), np.nan), "y": [1, 2]}, "sample 0: field 'x'"),
        ({"x": np.full((2, 1, 8, 8), 3.0), "y": [1, 2]}, "outside float32 \\[1, 8, 8\\] in \\[0, 1\\]"),
        ({"x": np.zeros((2, 1, 8, 8)), "y": [1, 10]}, "sample 1: field 'y' is 10.0, outside int64"),
        ({"x": np.zeros((2, 1, 8, 8)), "y": [1, 2.5]}, "sample 1: field 'y'"),
        ({"x": np.zeros((2, 1, 8, 8)), "y": ["a", "b"]}, "field 'y' must hold numbers"),
    ],
)
def test_a_sample_that_does_not_fit_the_schema_is_refused_and_nothing_is_stored(home, samples, message):
    agent = Agent(home)
    agent.add_samples({"x": np.zeros((3, 64)), "y": [0, 1, 2]})  # flattened images are taken as 8x8
    with pytest.raises(SampleError, match=message):
        agent.add_samples(samples)
    assert len(SampleStore(home / "samples")) == 3


def test_files_in_every_format_are_stored_and_a_malformed_one_refused_whole(home, tmp_path_factory, digits):
    folder = tmp_path_factory.mktemp("files")
    samples = _user_samples(digits, 20)
    np.savez(folder / "a.npz", **samples)
    (folder / "b.jsonl").write_text(
        "\n".join(json.dumps({"x": x.tolist(), "y": int(y)}) for x, y in zip(samples["x"], samples["y"], strict=True))
    )
    header = ",".join(f"p{i}" for i in range(64)) + ",y\n"
    rows = [",".join(f"{v:.4f}" for v in x.ravel()) + f",{y}" for x, y in zip(samples["x"], samples["y"], strict=True)]
    (folder / "c.csv").write_text(header + "\n".join(rows))
    images = folder / "photos"
    for label in (3, 7):
        (images / str(label)).mkdir(parents=True)
        Image.fromarray(np.full((16, 16), 20 * label, dtype=np.uint8)).save(images / str(label) / "one.png")
    agent = Agent(home)
    assert [agent.add_file(p) for p in (folder / "a.npz", folder / "b.jsonl", folder / "c.csv", images)] == [20] * 3 + [
        2
    ]
    (folder / "bad.jsonl").write_text(json.dumps({"x": [0.5] * 64, "y": 1}) + "\nnot json\n")
    (folder / "bad.csv").write_text("p0,p1\n0.1,0.2\n")
    (folder / "bad.txt").write_text("hello")
    for path, message in (
        ("bad.jsonl", "cannot be read"),
        ("bad.csv", "field 'x' has shape \\[2\\]"),  # (without a 'y' column its rows are unlabeled inputs)
        ("bad.txt", "unknown format"),
    ):
        with pytest.raises(SampleError, match=message):
            agent.add_file(folder / path)
    assert len(SampleStore(home / "samples")) == 62


def test_configuring_samples_from_the_application_makes_the_inbox_and_says_where(tmp_path):
    """``configure --data app`` leaves the application a folder to drop files in, named on the terminal; the
    JSON of the configuration stays alone on standard output."""
    home = tmp_path / "agent"
    for _ in range(2):  # a second time changes nothing
        ran = subprocess.run(
            [sys.executable, "-m", "edge_agent", "--home", str(home), "configure", "--data", "app"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert ran.returncode == 0, ran.stderr
        assert json.loads(ran.stdout)["data"] == {"kind": "app"}
        assert (home / "inbox").is_dir() and f"drop sample files in {home / 'inbox'}" in ran.stderr, ran.stderr


def test_the_inbox_takes_each_file_once_and_moves_a_bad_one_aside_with_its_reason(home, digits):
    inbox = Inbox(home)
    inbox.root.mkdir()
    np.savez(inbox.root / "good.npz", **_user_samples(digits, 30))
    (inbox.root / "broken.json").write_text("[{")
    (inbox.root / "writing.npz.part").write_bytes(b"half")
    agent = Agent(home)
    outcomes = inbox.take(agent.add_file)
    assert {o["file"]: o.get("added", "rejected") for o in outcomes} == {"broken.json": "rejected", "good.npz": 30}
    assert (inbox.rejected / "broken.json").exists()
    assert "cannot be read" in (inbox.rejected / "broken.json.reason.txt").read_text()
    assert inbox.waiting() == [inbox.root / "writing.npz.part"] or inbox.waiting() == []
    assert (inbox.root / "writing.npz.part").exists() and not (inbox.root / "good.npz").exists()
    assert inbox.take(agent.add_file) == [] and len(SampleStore(home / "samples")) == 30


def test_a_device_fed_only_by_its_application_personalizes_predicts_and_exports_its_own_model(home, digits):
    import peft  # noqa: PLC0415  (a test-only dependency)

    runtime = device(home, scenario="label")
    runtime.config.data = {"kind": "none"}
    agent = Agent(home)
    samples = _user_samples(digits, 300)
    agent.add_samples(samples)
    outcome = runtime.train_once()
    assert outcome["status"] == "trained", outcome
    state = agent.status()["personal"]
    assert state["serving"] == "personal" and state["personal_accuracy"] > state["shared_accuracy"]
    answer = agent.predict({"x": samples["x"][:50]})
    assert answer["serving"] == "personal" and answer["version"] == 1 and len(answer["labels"]) == 50

    export = home / "export"
    command = [sys.executable, "-m", "edge_agent", "--home", str(home), "export", "--personal", str(export)]
    assert subprocess.run(command, capture_output=True, text=True, check=False).returncode == 0
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(runtime_base(home, digits)), export).eval()
    x = torch.as_tensor(samples["x"][:20])
    with torch.no_grad():
        assert torch.allclose(loaded(x), Agent(home).model()(x), atol=1e-5)

    predicted = subprocess.run(
        [sys.executable, "-m", "edge_agent", "--home", str(home), "predict"],
        input="\n".join(json.dumps({"x": x.tolist()}) for x in samples["x"][:3]),
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    lines = [json.loads(line) for line in predicted.stdout.splitlines()]
    assert predicted.returncode == 0 and len(lines) == 3 and lines[0]["serving"] == "personal", predicted.stderr
    refused = subprocess.run(
        [sys.executable, "-m", "edge_agent", "--home", str(home), "predict"],
        input='{"x": [1, 2]}', capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert refused.returncode == 1 and "each sample needs float32 [1, 8, 8]" in refused.stderr
    shared = Agent(home)  # where validation says the personal model does not help, the shared one is served
    shared.personal.save(None, serving="shared")
    assert shared.predict({"x": samples["x"][:1]})["serving"] == "shared"


def runtime_base(home, digits):
    from safetensors.torch import load_file  # noqa: PLC0415

    base = digits[0].build({"seed": 0})
    base.load_state_dict(load_file(str(home / "base" / f"{'b' * 64}.safetensors")))
    return base


def test_status_says_how_many_new_samples_the_agent_holds_and_how_many_more_it_waits_for(home, digits, capsys):
    """An application handing in a few samples at a time learns from `edge-agent status` (and Agent.status()) why
    nothing trains yet: min_new_samples (32 by default) new samples make a pass."""
    from edge_agent.cli import main
    from edge_agent.identity import AgentState, load_or_create_key
    from edge_agent.runtime import AgentConfig, DeviceRuntime

    def cli_status() -> dict:
        assert main(["--home", str(home), "status"]) == 0
        return json.loads(capsys.readouterr().out)["samples"]

    AgentState(server="http://127.0.0.1:9", device_id="d", server_public_key="", cohort="c", status="active",
               websocket_path="/ws/agent/", heartbeat_interval=30).save(home)  # fmt: skip
    AgentConfig(data={"kind": "app"}, power={"kind": "simulated", "level": 100.0, "charging": True}).save(home)
    agent, samples = Agent(home), _user_samples(digits, 60)
    agent.add_samples({k: v[:10] for k, v in samples.items()})
    waiting = agent.status()["samples"]
    assert {k: waiting[k] for k in ("stored", "new", "min_new_samples", "new_needed")} == {
        "stored": 10, "new": 10, "min_new_samples": 32, "new_needed": 22}  # fmt: skip
    assert "waits for 22 more new samples (10 of the 32 min_new_samples)" in waiting["note"]
    assert "--min-new-samples" in waiting["note"] and "train-once --force" in waiting["note"]
    assert cli_status() == waiting
    runtime = DeviceRuntime(home=home, state=AgentState.load(home), key=load_or_create_key(home))
    skipped = runtime.train_once()
    assert skipped["status"] == "skipped" and "too few new samples: 10 of the 32" in skipped["reason"]

    agent.add_samples({k: v[10:40] for k, v in samples.items()})
    ready = agent.status()["samples"]
    assert (ready["new"], ready["new_needed"]) == (40, 0)
    assert ready["note"].startswith("40 new samples, enough for a training pass")
    assert runtime.train_once()["status"] == "trained"
    trained = agent.status()["samples"]
    assert (trained["stored"], trained["new"], trained["new_needed"]) == (40, 0, 32)

    main(["--home", str(home), "configure", "--min-new-samples", "8"])
    capsys.readouterr()
    agent.add_samples({k: v[40:50] for k, v in samples.items()})
    assert {k: cli_status()[k] for k in ("new", "min_new_samples", "new_needed")} == {
        "new": 10, "min_new_samples": 8, "new_needed": 0}  # fmt: skip
