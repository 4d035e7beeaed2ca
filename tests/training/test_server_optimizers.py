"""Server optimizers (FedAvgM, FedAdagrad, FedAdam, FedYogi) on the aggregated update: equal to a plain reference
of Reddi et al.'s update rules, their moments stored with the version a round made and continued by the rounds
built on it, and their settings checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors

from tests.training.test_rounds import make_delta_tensors, receive
from training import dispatch
from training.federation.aggregation import round_aggregate
from training.federation.aggregation_settings import validate_aggregation
from training.federation.rounds import round_base
from training.federation.strategies.server_optimizers import OPTIMIZERS, server_step
from training.federation.verification import delta_verify
from training.models import Round
from training.registry.blobs import blob_read
from training.registry.services import adapter_set_aggregation, version_transition


def reference(optimizer, deltas, *, lr, momentum=0.9, beta2=0.99, tau=1e-3):
    """The updates of ``optimizer`` for a sequence of aggregated updates (one array each), written out from the
    paper's rules in numpy: m_{-1} = 0, v_{-1} = tau²."""
    m, v, updates = np.zeros_like(deltas[0]), np.full_like(deltas[0], tau * tau), []
    for d in deltas:
        if optimizer == "fedavgm":
            m = momentum * m + d
            updates.append(lr * m)
            continue
        m = momentum * m + (1 - momentum) * d
        if optimizer == "fedadagrad":
            v = v + d**2
        elif optimizer == "fedadam":
            v = beta2 * v + (1 - beta2) * d**2
        else:
            v = v - (1 - beta2) * d**2 * np.sign(v - d**2)
        updates.append(lr * m / (np.sqrt(v) + tau))
    return updates


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_each_optimizer_equals_the_reference_over_rounds(optimizer):
    rng = np.random.default_rng(0)
    deltas = [rng.normal(scale=0.01, size=(3, 4)) for _ in range(4)]
    state, got = None, []
    for d in deltas:
        update, state = server_step({"w": torch.as_tensor(d, dtype=torch.float32)}, state, optimizer=optimizer, lr=0.05)
        got.append(update["w"].double().numpy())
    want = reference(optimizer, [d.astype(np.float32).astype(np.float64) for d in deltas], lr=0.05)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-9)
    assert set(state) == ({"m/w"} if optimizer == "fedavgm" else {"m/w", "v/w"})


def test_unknown_optimizers_and_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown server optimizer"):
        server_step({"w": torch.zeros(2)}, None, optimizer="adamw", lr=0.1)
    for bad, message in (
        ({"server_optimizer": "adamw"}, "server_optimizer must be null or one of fedavgm"),
        ({"server_momentum": 1.0}, "server_momentum must be a number from 0 to below 1"),
        ({"server_beta2": -0.1}, "server_beta2 must be a number from 0 to below 1"),
        ({"server_tau": 0}, "server_tau must be a number above 0 and at most 1"),
        ({"server_tau": True}, "server_tau must be a number above 0 and at most 1"),
    ):
        with pytest.raises(ValueError, match=message):
            validate_aggregation(bad)
    assert validate_aggregation({"server_optimizer": "fedyogi", "server_lr": 0.02}) == {
        "server_optimizer": "fedyogi",
        "server_lr": 0.02,
    }


def _flat(tensors: dict, names) -> np.ndarray:
    return torch.cat([tensors[name].double().reshape(-1) for name in names]).numpy()


def _round(adapter, devices, counter: int, base: int, seed: int, optimizer: str = "fedadam"):
    tensors = [make_delta_tensors(adapter, seed=seed + i) for i in range(len(devices))]
    for device, delta in zip(devices, tensors, strict=True):
        accepted = delta_verify(delta_id=receive(device, adapter, delta, counter=counter, base_version=base).pk)
        assert accepted.state == "accepted", accepted.rejection_detail
    round_ = Round.objects.get(state=Round.State.AGGREGATING)
    assert round_.base_version.number == base and round_.params["server_optimizer"] == optimizer
    version = round_aggregate(round_id=round_.pk)
    names = list(adapter.tensor_spec)
    mean = np.mean([_flat(t, names) for t in tensors], axis=0)  # fedavg of equal sample counts
    before = load_safetensors(blob_read(round_.base_version.blob_sha256))
    after = load_safetensors(blob_read(version.blob_sha256))
    return version, mean, _flat(after, names) - _flat(before, names)


@pytest.mark.django_db
def test_fedadam_rounds_continue_the_adapters_moments_whatever_the_gate_released(trained, monkeypatch):
    """Round 1 from v1 makes v2 (one step); round 2, from v1 again while v2 is a candidate, continues v2's
    moments (the adapter's, kept across rounds and versions); round 3, from v2 once it is released, continues v3's:
    each version equal to its base plus the reference's update for the rounds so far."""
    monkeypatch.setattr("training.federation.verify_queue.queue_verification", lambda delta_id: None)
    monkeypatch.setattr(dispatch, "aggregate_round", lambda round_id: None)
    adapter, v1, devices = trained
    version_transition(version=v1, action="release", actor=None)
    settings = {"strategy": "fedavg", "buffer_size": 3, "min_deltas": 1, "server_optimizer": "fedadam",
                "server_lr": 0.02}  # fmt: skip
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation=settings)
    v2, first, change2 = _round(adapter, devices[:3], counter=1, base=1, seed=10)
    np.testing.assert_allclose(change2, reference("fedadam", [first], lr=0.02)[0], rtol=1e-4, atol=1e-7)
    assert v2.server_state["optimizer"] == "fedadam" and v2.server_state["steps"] == 1
    moments = load_safetensors(blob_read(v2.server_state["blob"]))
    assert set(moments) == {f"{kind}/{name}" for kind in "mv" for name in adapter.tensor_spec}

    v3, second, change3 = _round(adapter, devices[:3], counter=2, base=1, seed=20)  # v2 is a candidate
    np.testing.assert_allclose(change3, reference("fedadam", [first, second], lr=0.02)[1], rtol=1e-4, atol=1e-7)
    assert v3.server_state["steps"] == 2 and v3.parent_id == v1.pk

    version_transition(version=v2, action="release", actor=None)
    v4, third, change4 = _round(adapter, devices[:3], counter=3, base=2, seed=30)
    want = reference("fedadam", [first, second, third], lr=0.02)[2]
    np.testing.assert_allclose(change4, want, rtol=1e-4, atol=1e-7)
    assert v4.server_state["steps"] == 3 and v4.parent_id == v2.pk
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation={**settings, "server_optimizer": "fedyogi"})
    base = round_base(adapter).number  # v2 (v4, random deltas, may fail the gate)
    v5, fourth, change5 = _round(adapter, devices[:3], counter=4, base=base, seed=40, optimizer="fedyogi")
    np.testing.assert_allclose(change5, reference("fedyogi", [fourth], lr=0.02)[0], rtol=1e-4, atol=1e-7)
    assert v5.server_state == {**v5.server_state, "optimizer": "fedyogi", "steps": 1}  # another optimizer: afresh
