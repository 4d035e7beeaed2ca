"""Atomic checkpoints: an interrupted training resumes where it was; a torn newest checkpoint is detected and
the previous one used."""

import numpy as np
import pytest
import torch

from edge_agent.checkpoint import CheckpointManager, CorruptCheckpoint, decode, encode
from edge_agent.families.digits import dirichlet_shards
from edge_agent.lora_layers import adapter_tensors
from edge_agent.training import Interrupted, TrainConfig, train_adapter
from tests.edge_agent.support import adapted, device_split


def interrupt_at(step):
    def progress(event):
        if event["event"] == "step" and event["step"] == step:
            raise Interrupted("power cut")

    return progress


@pytest.fixture
def shard(digits):
    _, train, _ = digits
    return device_split(train, dirichlet_shards(train["y"].numpy(), 10, 0.3, seed=1)[1])


def config_for(directory):
    return TrainConfig(epochs=4, micro_batch=16, lr=1e-2, patience=10, checkpoint_dir=directory, checkpoint_every=3)


def test_an_interrupted_training_resumes_from_its_checkpoint_and_ends_where_an_uninterrupted_one_does(
    digits, pretrained_base, shard, tmp_path
):
    family, _, _ = digits
    local_train, local_val = shard
    reference_model = adapted(pretrained_base, family)
    reference = train_adapter(reference_model, local_train, local_val, config=config_for(None), family=family)

    directory = tmp_path / "ckpt"
    model = adapted(pretrained_base, family)
    with pytest.raises(Interrupted):
        train_adapter(model, local_train, local_val, config=config_for(directory), family=family,
                      progress=interrupt_at(13))  # fmt: skip
    saved = [step for step, _ in CheckpointManager(directory).paths()]
    assert saved and max(saved) == 12  # every 3 steps (and at epoch ends), the newest two kept

    # the device restarts: the same starting adapter, the same data
    restarted = adapted(pretrained_base, family)
    result = train_adapter(restarted, local_train, local_val, config=config_for(directory), family=family)
    assert result.resumed_from_step == 12 and "resumed" in result.notes[0]
    assert result.steps == reference.steps and result.history == reference.history
    assert result.before == reference.before and result.after == reference.after
    expected = adapter_tensors(reference_model)
    for key, value in adapter_tensors(restarted).items():
        assert torch.allclose(value, expected[key], atol=1e-6), key
    assert CheckpointManager(directory).paths() == []  # a finished run leaves no checkpoint behind


def test_a_run_asked_to_stop_checkpoints_where_it_stands_and_resumes_there_to_the_same_end(
    digits, pretrained_base, shard, tmp_path
):
    """The agent stopping (SIGTERM: ``should_stop``) ends a run before its next optimizer step, with a checkpoint at
    that step even between the periodic ones, so the stop waits for one step and the work is kept."""
    family, _, _ = digits
    local_train, local_val = shard
    reference_model = adapted(pretrained_base, family)
    reference = train_adapter(reference_model, local_train, local_val, config=config_for(None), family=family)

    directory, asked = tmp_path / "ckpt", []
    model = adapted(pretrained_base, family)
    stopping = TrainConfig(**{**config_for(directory).__dict__, "should_stop": lambda: len(asked) >= 7})
    with pytest.raises(Interrupted, match="stopped at step 7 of"):
        train_adapter(model, local_train, local_val, config=stopping, family=family,
                      progress=lambda event: asked.append(event) if event["event"] == "step" else None)  # fmt: skip
    assert max(step for step, _ in CheckpointManager(directory).paths()) == 7  # not the periodic 6

    restarted = adapted(pretrained_base, family)
    result = train_adapter(restarted, local_train, local_val, config=config_for(directory), family=family)
    assert result.resumed_from_step == 7 and result.history == reference.history
    expected = adapter_tensors(reference_model)
    for key, value in adapter_tensors(restarted).items():
        assert torch.allclose(value, expected[key], atol=1e-6), key


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    for step in (1, 2, 3):
        manager.save(step, {"weights": torch.full((4,), float(step)), "note": f"step {step}"})
    newest = manager.paths()[-1][1]
    newest.write_bytes(newest.read_bytes()[:-10])  # torn write
    loaded = manager.load_latest()
    assert loaded.step == 2 and loaded.skipped == [newest]
    assert torch.equal(loaded.state["weights"], torch.full((4,), 2.0)) and loaded.state["note"] == "step 2"

    flipped = bytearray(encode({"weights": torch.zeros(3)}))
    flipped[-5] ^= 0xFF
    with pytest.raises(CorruptCheckpoint, match="hash mismatch"):
        decode(bytes(flipped))
    with pytest.raises(CorruptCheckpoint, match="header"):
        decode(b"garbage")

    manager.save(4, {"weights": torch.zeros(1)})
    assert [step for step, _ in manager.paths()] == [2, 3, 4]  # only the newest `keep` stay


def test_training_resumes_from_the_previous_checkpoint_when_the_newest_is_corrupt(
    digits, pretrained_base, shard, tmp_path
):
    family, _, _ = digits
    local_train, local_val = shard
    reference_model = adapted(pretrained_base, family)
    reference = train_adapter(reference_model, local_train, local_val, config=config_for(None), family=family)
    model = adapted(pretrained_base, family)
    with pytest.raises(Interrupted):
        train_adapter(model, local_train, local_val, config=config_for(tmp_path), family=family,
                      progress=interrupt_at(13))  # fmt: skip
    (previous, _), (_, newest) = CheckpointManager(tmp_path).paths()
    newest.write_bytes(b"\0" * 100)
    restarted = adapted(pretrained_base, family)
    result = train_adapter(restarted, local_train, local_val, config=config_for(tmp_path), family=family)
    assert result.resumed_from_step == previous < 12
    assert "corrupt" in " ".join(result.notes)
    assert result.after == reference.after
    expected = adapter_tensors(reference_model)
    assert all(torch.allclose(v, expected[k], atol=1e-6) for k, v in adapter_tensors(restarted).items())


def test_a_checkpoint_from_another_run_is_not_resumed(digits, pretrained_base, shard, tmp_path):
    family, train, _ = digits
    local_train, local_val = shard
    with pytest.raises(Interrupted):
        train_adapter(adapted(pretrained_base, family), local_train, local_val, config=config_for(tmp_path),
                      family=family, progress=interrupt_at(4))  # fmt: skip
    other_train, other_val = device_split(train, np.arange(100))
    result = train_adapter(
        adapted(pretrained_base, family, seed=5), other_train, other_val, config=config_for(tmp_path), family=family
    )
    assert result.resumed_from_step is None and "another training run" in result.notes[0]
