"""The personalization benchmark's settings and its split (``bench/personalization.py``).

One split per scenario and seed: the factory part of the digits train set (``factory_split``) trains the
DigitsNet base centrally in plain torch ("version 1" = the base, a zero LoRA and the base's own head); the
pool part is cut into Dirichlet label shards, one per device, each seen through the device's
``profile_for(scenario, index, seed)``; a random quarter of every device's samples is its local test slice, the
rest its local training data. The forgetting measurement's "later data" of device ``i`` is the training part
of device ``(i + D/2) mod D`` (another label mix) seen through device ``i``'s own profile.

The per-device data is kept twice: as plain ``{"x", "y"}`` dicts (``Split.devices``, for methods that train one
device at a time, such as the product's) and stacked and padded to ``[devices, samples, ...]`` with a count per
device (``Padded``, for the vmapped references). Only the data and profile helpers of ``edge_agent.families``
are used here: no product training code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from edge_agent.families.common import dirichlet_shards
from edge_agent.families.digits import DigitsCNN, DigitsNet, load_split
from edge_agent.families.digits_users import factory_split, profile_for, user_data


@dataclass(frozen=True)
class Config:
    devices: int = 50
    rounds: int = 30
    dirichlet_alpha: float = 0.3
    factory_fraction: float = 0.3
    test_share: float = 0.25  # of each device's samples: its local test slice
    # local training, the same for every reference of a form (Adam without weight decay, micro-batch 16,
    # gradient norm clipped to 1, a fresh optimizer per round: the agent's TrainConfig defaults but for lr)
    lr_full: float = 0.003
    lr_lora: float = 0.01
    batch: int = 16
    clip: float = 1.0
    local_epochs: int = 5  # per federated round
    finetune_epochs: int = 20  # local fine-tuning (alone, after FedAvg, and both phases of forgetting)
    ditto_lambda: float = 1.0
    # the family's default adapter (DigitsCNN: LoRA rank 16, alpha 32 on conv1, conv2 and fc1 of the frozen base,
    # head in full), for the product's rows and the references' LoRA form alike
    rank: int = DigitsCNN.default_rank
    alpha: float = DigitsCNN.default_alpha
    # forgetting: a reservoir of the earliest training samples, a share of every batch drawn from it
    replay_capacity: int = 32
    replay_share: float = 0.5
    # the product's rows (bench/personalization_product.py) run the server's default personalization setting;
    # these override it when set (a negative value: the default)
    product_lambda: float = -1.0
    product_epochs: int = -1
    product_lr: float = -1.0
    product_margin: float = -1.0
    product_min_val_samples: int = -1
    # the shared adapter the product's rows train: "lora" (the family's default above) or "full" (no LoRA: every
    # layer of the small model is a module to save, trained at lr_full: the shared "adapter" is the whole model)
    product_adapter: str = "lora"
    # the factory base, trained centrally
    base_epochs: int = 40
    base_lr: float = 0.005
    base_batch: int = 32

    def lr(self, form: str) -> float:
        return self.lr_full if form == "full" else self.lr_lora

    def as_dict(self) -> dict:
        return asdict(self)

    def product_overrides(self) -> dict:
        """The ``product_*`` settings that are set, named as the personalization setting names them."""
        names = {"product_lambda": "lambda", "product_epochs": "epochs", "product_lr": "lr",
                 "product_margin": "margin", "product_min_val_samples": "min_val_samples"}  # fmt: skip
        return {setting: getattr(self, field) for field, setting in names.items() if getattr(self, field) >= 0}


@dataclass
class Padded:
    """Per-device samples stacked as ``x [D, N, 1, 8, 8]``, ``y [D, N]`` and ``n [D]``: device ``d`` holds
    ``n[d]`` samples in its first rows, the rest is padding (zeros, never used as a sample)."""

    x: torch.Tensor
    y: torch.Tensor
    n: torch.Tensor

    @classmethod
    def stack(cls, parts: list[dict]) -> Padded:
        width = max(1, max(len(part["y"]) for part in parts))
        x = torch.zeros(len(parts), width, *parts[0]["x"].shape[1:])
        y = torch.zeros(len(parts), width, dtype=torch.int64)
        for d, part in enumerate(parts):
            x[d, : len(part["y"])] = part["x"]
            y[d, : len(part["y"])] = part["y"]
        return cls(x, y, torch.tensor([len(part["y"]) for part in parts]))

    @property
    def mask(self) -> torch.Tensor:
        return torch.arange(self.y.shape[1])[None, :] < self.n[:, None]


@dataclass
class Split:
    scenario: str
    seed: int
    config: Config
    base_state: dict[str, torch.Tensor]  # the factory-trained DigitsNet (version 1's base and head)
    devices: list[dict]  # per device: {"train", "test", "later", "later_test": {"x", "y"}, "profile": dict}
    train: Padded
    test: Padded
    later: Padded  # forgetting: the device's later data (another device's label mix, its own profile)
    later_test: Padded
    replay: Padded  # forgetting: a reservoir sample of the device's earliest training data
    factory_samples: int
    cache: dict = field(default_factory=dict)  # results methods share within this split (e.g. FedAvg's run)

    def version1(self) -> DigitsNet:
        """Version 1 as a module (the LoRA starts at zero, so it is the base itself)."""
        model = DigitsNet(width=16)
        model.load_state_dict(self.base_state)
        return model.eval()

    @property
    def train_counts(self) -> torch.Tensor:
        return self.train.n


def train_base(data: dict, config: Config, seed: int) -> dict[str, torch.Tensor]:
    """The factory base: DigitsNet trained centrally on ``data`` (Adam, shuffled mini-batches)."""
    generator = torch.Generator().manual_seed(seed * 7919 + 17)
    torch.manual_seed(seed)
    model = DigitsNet(width=16)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.base_lr)
    n = len(data["y"])
    for _ in range(config.base_epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, config.base_batch):
            index = order[start : start + config.base_batch]
            optimizer.zero_grad()
            F.cross_entropy(model(data["x"][index]), data["y"][index]).backward()
            optimizer.step()
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def reservoir(count: int, capacity: int, rng: np.random.Generator) -> np.ndarray:
    """Positions kept by a reservoir of ``capacity`` fed ``count`` samples in order (Vitter's algorithm R)."""
    kept = list(range(min(count, capacity)))
    for position in range(capacity, count):
        slot = int(rng.integers(0, position + 1))
        if slot < capacity:
            kept[slot] = position
    return np.sort(np.asarray(kept, dtype=np.int64))


def _take(data: dict, index) -> dict:
    index = torch.as_tensor(index, dtype=torch.int64)
    return {key: value[index] for key, value in data.items()}


def prepare_split(scenario: str, seed: int, config: Config) -> Split:
    train, _ = load_split()  # the test part is the server's evaluation set: not used here
    factory, pool = factory_split(train["y"].numpy(), fraction=config.factory_fraction, seed=seed)
    base_state = train_base(_take(train, factory), config, seed)
    pool_data = _take(train, pool)
    shards = dirichlet_shards(pool_data["y"].numpy(), config.devices, config.dirichlet_alpha, seed)
    devices = []
    for index, shard in enumerate(shards):
        rng = np.random.default_rng([seed, index, 4242])
        order = rng.permutation(shard)  # the order the device collected its samples in
        n_test = min(len(order), max(1, round(config.test_share * len(order))))
        profile = profile_for(scenario, index, seed=seed)
        devices.append(
            {
                "train_index": order[n_test:],
                "test_index": order[:n_test],
                "profile": profile,
                "rng": rng,
            }
        )
    for index, device in enumerate(devices):
        other = devices[(index + config.devices // 2) % config.devices]
        seen = device["profile"]
        device["train"] = user_data(_take(pool_data, device["train_index"]), seen)
        device["test"] = user_data(_take(pool_data, device["test_index"]), seen)
        device["later"] = user_data(_take(pool_data, other["train_index"]), seen)
        device["later_test"] = user_data(_take(pool_data, other["test_index"]), seen)
        kept = reservoir(len(device["train_index"]), config.replay_capacity, device.pop("rng"))
        device["replay"] = _take(device["train"], kept)
        device["profile"] = seen.as_dict()
    return Split(
        scenario=scenario,
        seed=seed,
        config=config,
        base_state=base_state,
        devices=[{k: v for k, v in d.items() if not k.endswith("_index")} for d in devices],
        train=Padded.stack([d["train"] for d in devices]),
        test=Padded.stack([d["test"] for d in devices]),
        later=Padded.stack([d["later"] for d in devices]),
        later_test=Padded.stack([d["later_test"] for d in devices]),
        replay=Padded.stack([d["replay"] for d in devices]),
        factory_samples=len(factory),
    )
