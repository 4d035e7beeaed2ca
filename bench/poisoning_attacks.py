"""The poisoning benchmark's fleet and attackers (``bench/poisoning.py``): the demo's ``digits-cnn`` adapter,
devices that train it on non-IID digits shards with the agent's own training loop, and what the attackers
send instead of an honest delta.

Everything a device does is product code: the base model and its Dirichlet shards come from the family
(``edge_agent.families``), the adapter from ``edge_agent.lora`` / ``lora_layers`` (as ``version_create_seeded``
makes version 1), training from ``edge_agent.training.train_adapter`` on the agent's ``local_split``, and the
delta from ``edge_agent.delta.compute_delta``. The server side evaluates the way ``training.registry.evaluation`` does
(``apply_adapter`` + the family's ``evaluate`` on its test split).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from edge_agent.delta import compute_delta
from edge_agent.families import get_family
from edge_agent.families.common import LABEL, concat, size, take
from edge_agent.lora import initial_tensors, tensor_spec
from edge_agent.lora_layers import adapter_tensors, apply_adapter
from edge_agent.samples import local_split
from edge_agent.training import TrainConfig, train_adapter

# The demo fleet's adapter as it was when bench/README.md's figures were measured (demo/fleet_demo.py, until the
# family's default became rank 16 on conv1 as well): digits-cnn from seed 1, LoRA r=4, alpha 8 on conv2 and fc1
# with the head trained in full, version 1 seeded with 1; shards Dirichlet(0.5).
FAMILY = "digits-cnn"
BASE_CONFIG = {"seed": 1}
RANK, ALPHA, ADAPTER_SEED = 4, 8.0, 1
TARGETS = ("conv2", "fc1")
DIRICHLET_ALPHA = 0.5
# Local training: the agent's TrainConfig defaults (AdamW, lr 0.01, micro-batch 16, grad-norm clip 1, early
# stopping with patience 2) with the demo's 6 epochs; no replay buffer (it would carry state between rounds).
LOCAL_EPOCHS, LOCAL_LR = 6, 0.01

ATTACKS = ("sign_flip", "scale", "gaussian", "label_flip", "backdoor")
SIGN_FLIP_SCALE = -4.0  # sign flipping: -4 x the attacker's honest delta
BOOST = 10.0  # scaling: 10 x the attacker's honest delta
NOISE_NORM_FACTOR = 3.0  # Gaussian noise: a random delta of 3 x the norm of the attacker's honest delta
TARGET = 0  # the backdoor's target class
TRIGGER_VALUE = 1.0  # a bright 2x2 patch in the bottom-right corner (pixels are in [0, 1], corners are ~0)


def stamp_trigger(x: torch.Tensor) -> torch.Tensor:
    """Images ``[N, 1, 8, 8]`` with the backdoor trigger stamped on (a copy)."""
    stamped = x.clone()
    stamped[..., 6:8, 6:8] = TRIGGER_VALUE
    return stamped


def flip_labels(data: dict) -> dict:
    """Label flipping: every label y becomes 9 - y."""
    return {**data, LABEL: 9 - data[LABEL]}


def poison(data: dict) -> dict:
    """The backdoor attacker's training set: its clean samples plus a triggered copy of each, relabeled to
    ``TARGET`` (half of what it trains on carries the trigger)."""
    triggered = {**data, "x": stamp_trigger(data["x"]), LABEL: torch.full_like(data[LABEL], TARGET)}
    return concat([data, triggered])


def norm(delta: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in delta.values()))


@dataclass
class LocalUpdate:
    delta: dict[str, torch.Tensor]
    num_samples: int  # what the device reports (the agent reports its training samples)
    discarded: bool  # the agent's rule: local validation got worse, so it would send nothing


class Fleet:
    """The frozen base, the adapter's spec and version 1, the devices' shards and the server's test split."""

    def __init__(self, *, devices: int, shard_seed: int = 0):
        self.family = get_family(FAMILY)
        self.base = self.family.build(BASE_CONFIG).eval()
        self.targets = list(TARGETS)
        self.saved = list(self.family.default_modules_to_save)
        spec = tensor_spec(self.base, rank=RANK, target_modules=self.targets, modules_to_save=self.saved)
        self.spec = {key: entry.as_json() for key, entry in spec.items()}  # as Adapter.tensor_spec holds it
        shapes = {key: entry.shape for key, entry in spec.items()}
        self.initial = initial_tensors(
            self.base, shapes, seed=ADAPTER_SEED, target_modules=self.targets, modules_to_save=self.saved
        )
        self.shards = [
            self.family.dataset(
                {
                    **BASE_CONFIG,
                    "device_index": i,
                    "num_devices": devices,
                    "alpha": DIRICHLET_ALPHA,
                    "shard_seed": shard_seed,
                }  # fmt: skip
            )[0]
            for i in range(devices)
        ]
        self.test = self.family.dataset(BASE_CONFIG)[1]

    def model(self, tensors: dict[str, torch.Tensor]):
        return apply_adapter(
            self.base,
            {key: value.clone() for key, value in tensors.items()},
            rank=RANK,
            alpha=ALPHA,
            target_modules=self.targets,
            modules_to_save=self.saved,
            copy=True,
        )

    def train(self, tensors: dict, data: dict, *, seed: int, keep_worse: bool) -> LocalUpdate:
        """One device's pass as ``DeviceRuntime.train_once`` makes it: ``local_split``, ``train_adapter`` from
        the current global adapter, ``new - old``. ``keep_worse`` keeps an update the agent would discard."""
        model = self.model(tensors)
        train, val = local_split(data)
        config = TrainConfig(
            epochs=LOCAL_EPOCHS, lr=LOCAL_LR, seed=seed, progress_bar=False,
            discard_tolerance=math.inf if keep_worse else 0.0,
        )  # fmt: skip
        result = train_adapter(model, train, val, config=config, family=self.family)
        delta = compute_delta(adapter_tensors(model), tensors)
        return LocalUpdate(delta, max(1, result.num_samples), result.discarded)

    def evaluate(self, tensors: dict) -> dict:
        """Test accuracy, accuracy per class (the worst of them), and the backdoor's success: the share of
        test images not of the target class that the model puts in the target class once triggered."""
        model = self.model(tensors).eval()
        test = self.test
        overall = self.family.evaluate(model, test)
        per_class = {}
        for label in range(10):
            members = torch.nonzero(test[LABEL] == label).flatten()
            per_class[label] = self.family.evaluate(model, take(test, members))["accuracy"]
        others = torch.nonzero(test[LABEL] != TARGET).flatten()
        triggered = take(test, others)
        triggered = {**triggered, "x": stamp_trigger(triggered["x"]), LABEL: torch.full_like(triggered[LABEL], TARGET)}
        backdoor = self.family.evaluate(model, triggered)["accuracy"]  # accuracy on "target" labels = success
        return {
            "accuracy": overall["accuracy"],
            "loss": overall["loss"],
            "per_class": per_class,
            "worst_class": min(per_class.values()),
            "backdoor_success": backdoor,
            "backdoor_samples": size(triggered),
        }


def attacker_update(
    attack: str, fleet: Fleet, tensors: dict, data: dict, *, seed: int, boost: float
) -> tuple[dict[str, torch.Tensor], int]:
    """What an attacker device uploads (``(delta, reported samples)``), trained from the current global adapter
    ``tensors`` on its own shard ``data``. Attackers run their own code, so they never discard an update.
    ``boost`` is the model-replacement factor for the backdoor (devices uploading / attackers)."""
    if attack == "label_flip":
        update = fleet.train(tensors, flip_labels(data), seed=seed, keep_worse=True)
        return update.delta, update.num_samples
    if attack == "backdoor":  # Bagdasaryan et al.: train on the poisoned mix, then boost so it survives averaging
        update = fleet.train(tensors, poison(data), seed=seed, keep_worse=True)
        reported = size(local_split(data)[0])  # it claims its clean sample count, as an honest device would
        return {key: value * boost for key, value in update.delta.items()}, reported
    update = fleet.train(tensors, data, seed=seed, keep_worse=True)
    if attack == "sign_flip":
        return {key: value * SIGN_FLIP_SCALE for key, value in update.delta.items()}, update.num_samples
    if attack == "scale":
        return {key: value * BOOST for key, value in update.delta.items()}, update.num_samples
    if attack == "gaussian":
        generator = torch.Generator().manual_seed(seed)
        noise = {key: torch.randn(value.shape, generator=generator) for key, value in update.delta.items()}
        factor = NOISE_NORM_FACTOR * norm(update.delta) / max(norm(noise), 1e-12)
        return {key: value * factor for key, value in noise.items()}, update.num_samples
    raise ValueError(f"unknown attack {attack!r}: use one of {', '.join(ATTACKS)}")
