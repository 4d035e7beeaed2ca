"""Digits fixtures for the training tests: a base model pretrained briefly on global data (so devices have
something to personalize)."""

from __future__ import annotations

import pytest
import torch

from edge_agent.families import get_family
from edge_agent.families.common import size, take


@pytest.fixture(scope="session")
def digits():
    family = get_family("digits-cnn")
    train, test = family.dataset({})
    return family, train, test


@pytest.fixture(scope="session")
def pretrained_base(digits):
    """The fleet's frozen base: the digits CNN trained for 4 epochs on 600 global samples (~85% test)."""
    family, train, _ = digits
    base = family.build({"seed": 0})
    generator = torch.Generator().manual_seed(0)
    subset = take(train, torch.randperm(size(train), generator=generator)[:600])
    optimizer = torch.optim.Adam(base.parameters(), lr=3e-3)
    for _ in range(4):
        order = torch.randperm(size(subset), generator=generator)
        for start in range(0, size(subset), 32):
            optimizer.zero_grad()
            family.loss(base, take(subset, order[start : start + 32])).backward()
            optimizer.step()
    return base.eval()


@pytest.fixture
def app_home(tmp_path, digits):
    """An agent home with a digits version installed on an untrained base: the sample schema is known, so files
    can be taken (enough for the tests of sample intake, which train nothing)."""
    from tests.edge_agent.personal_support import install, training_manifest

    family = digits[0]
    home = tmp_path / "agent"
    install(home, family.build({"seed": 0}), family, version=1, training=training_manifest(family, {"method": "none"}))
    return home
