"""``digits-cnn``: a small CNN for scikit-learn's bundled 8x8 digits (fast enough for demos and tests).

The data is scikit-learn's ``load_digits`` (shipped with the package: nothing is downloaded), pixels scaled to
[0, 1], split once and for all into a stratified train set and a test set of ``TEST_SIZE`` samples; the test
set is the server's evaluation set. Devices get non-IID shards of the train set (``dirichlet_shards``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_agent.families.common import (
    SampleField,
    classification_evaluate,
    classification_loss,
    dirichlet_shards,
    restricted_classification_loss,
    take,
)
from edge_agent.families.digits_users import UserProfile, factory_split, profile_for, user_data

__all__ = ["DigitsCNN", "DigitsNet", "dirichlet_shards", "evaluate", "load_split", "TEST_SIZE", "SPLIT_SEED"]

TEST_SIZE = 360
SPLIT_SEED = 0


class DigitsNet(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(width, width * 2, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(width * 2 * 2 * 2, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)  # 8x8 -> 4x4
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)  # 4x4 -> 2x2
        return self.head(torch.relu(self.fc1(x.flatten(1))))


@lru_cache(maxsize=1)
def _split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    try:  # only here: the agent's base install, and every other family, work without scikit-learn
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise ImportError(
            f"the digits family needs scikit-learn: pip install 'fleet-personalization[digits]' ({exc})"
        ) from exc

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=TEST_SIZE, stratify=labels, random_state=SPLIT_SEED
    )
    for array in (x_train, x_test, y_train, y_test):
        array.setflags(write=False)
    return x_train, y_train, x_test, y_test


def load_split() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(train, test)`` as ``{"x": [N, 1, 8, 8] float32, "y": [N] int64}``; always the same split."""
    x_train, y_train, x_test, y_test = _split()
    train = {"x": torch.tensor(x_train), "y": torch.tensor(y_train)}
    test = {"x": torch.tensor(x_test), "y": torch.tensor(y_test)}
    return train, test


def evaluate(model: nn.Module, X, y) -> dict[str, float]:
    """``{"accuracy", "loss", "samples"}`` of ``model`` on images ``X`` ``[N, 1, 8, 8]`` and labels ``y``."""
    data = {"x": torch.as_tensor(X, dtype=torch.float32), "y": torch.as_tensor(y, dtype=torch.int64)}
    return classification_evaluate(model, data)


class DigitsCNN:
    name = "digits-cnn"
    # Every convolution and the hidden layer at rank 16 (6,938 numbers with the head, 27 KiB a float32 delta): a
    # sensor unlike the fleet's is learned in the first layers, which rank 4 on conv2 and fc1 could not reach
    # (bench/README.md as of 9a8d7eb, "The default adapter's shape").
    default_targets = ("conv1", "conv2", "fc1")
    default_modules_to_save = ("head",)
    default_rank, default_alpha = 16, 32.0
    image_field = "x"  # image folders: one 8x8 grey image a sample

    def sample_fields(self, config: dict[str, Any]) -> dict[str, SampleField]:
        """What an application hands the agent: 8x8 images scaled to [0, 1] (ink bright, as in scikit-learn's
        digits) and the digit."""
        return {"x": SampleField((1, 8, 8), "float32", 0.0, 1.0), "y": SampleField((), "int64", 0, 9)}

    def encode_samples(self, fields: dict, config: dict[str, Any]) -> dict:
        return fields  # the fields are the model's inputs already

    def image_sample(self, image) -> np.ndarray:
        """A PIL image as the ``x`` of one sample: grey, 8x8, [0, 1], ink bright (a light page is inverted)."""
        grey = np.asarray(image.convert("L").resize((8, 8)), dtype=np.float32) / 255.0
        return (1.0 - grey if grey.mean() > 0.5 else grey)[None, :, :]

    def build(self, config: dict[str, Any]) -> nn.Module:
        torch.manual_seed(int(config.get("seed", 0)))
        return DigitsNet(width=int(config.get("width", 16)))

    def dataset(self, config: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The fixed train/test split. With ``factory_fraction`` the train part is split once more
        (``digits_users.factory_split``, seed ``factory_seed``): ``"part": "factory"`` gives the factory part a
        base is trained on centrally, otherwise the devices' pool. With ``num_devices`` and ``device_index`` the
        train part is that device's Dirichlet shard (``alpha``, default 0.5; ``shard_seed``, default 0), seen
        as its user sees it: ``scenario`` (``digits_users.SCENARIOS``, profile drawn from ``shard_seed``) or an
        explicit ``profile``. The test part is always the server's evaluation set, as is."""
        train, test = load_split()
        fraction = float(config.get("factory_fraction", 0) or 0)
        if fraction:
            factory, pool = factory_split(
                train["y"].numpy(), fraction=fraction, seed=int(config.get("factory_seed", 0))
            )
            train = take(train, torch.as_tensor(factory if config.get("part") == "factory" else pool))
        if "device_index" in config:
            index = int(config["device_index"])
            shards = dirichlet_shards(
                train["y"].numpy(),
                int(config.get("num_devices", 10)),
                float(config.get("alpha", 0.5)),
                int(config.get("shard_seed", 0)),
            )
            train = take(train, torch.as_tensor(shards[index]))
            if "profile" in config:
                train = user_data(train, UserProfile.from_dict(config["profile"]))
            elif config.get("scenario"):
                train = user_data(train, profile_for(config["scenario"], index, seed=int(config.get("shard_seed", 0))))
        return train, test

    def evaluate(self, model: nn.Module, data: dict[str, torch.Tensor]) -> dict[str, float]:
        return classification_evaluate(model, data)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return classification_loss(model, batch)

    def restricted_loss(self, model: nn.Module, batch: dict[str, torch.Tensor], classes: torch.Tensor) -> torch.Tensor:
        return restricted_classification_loss(model, batch, classes)
