"""What the manifest's settings change in the device's passes: the personal pass learns from unlabeled samples where
the setting says so (``edge_agent.pseudo_labels``: what the model trained on the labelled ones is sure of, of the
users' own classes, at most as many as the labelled; the held slice stays labelled by users), and the shared pass
is held near the installed version by FedProx's ``proximal_mu``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load

from edge_agent.packaging import Outbox
from edge_agent.personal import PersonalSettings, PersonalStore
from edge_agent.pseudo_labels import pseudo_labelled
from edge_agent.unlabeled import UnlabeledStore
from tests.edge_agent.personal_support import device, install, training_manifest


class Fixed(torch.nn.Module):
    """Logits given by the input: sample i's are row i of ``x``."""

    def forward(self, x):
        return x


def test_pseudo_labels_are_what_the_model_is_sure_of_among_the_users_classes_surest_first():
    sure, unsure = 8.0, 0.5
    x = torch.tensor([[sure, 0, 0], [0, unsure, 0], [0, 0, sure + 2], [0, sure + 1, 0], [sure, 0, 0]])
    guessed = pseudo_labelled(Fixed(), {"x": x}, confidence=0.99)
    assert guessed["y"].tolist() == [2, 1, 0, 0] and torch.equal(guessed["x"][0], x[2])  # the surest first
    assert pseudo_labelled(Fixed(), {"x": x}, confidence=0.99, classes={0, 1})["y"].tolist() == [1, 0, 0]
    assert pseudo_labelled(Fixed(), {"x": x}, confidence=0.99, limit=2)["y"].tolist() == [2, 1]
    assert pseudo_labelled(Fixed(), {"x": x}, confidence=0.9999999) == {}
    assert pseudo_labelled(Fixed(), None, confidence=0.5) == {} and pseudo_labelled(Fixed(), {}, confidence=0.5) == {}


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="unlabeled"):
        PersonalSettings(method="ditto", unlabeled="guess")
    with pytest.raises(ValueError, match="confidence"):
        PersonalSettings(method="ditto", confidence=0.0)


@pytest.mark.parametrize("unlabeled", ["pseudo_label", "none"])
def test_the_personal_pass_learns_from_unlabeled_samples_and_its_held_slice_stays_user_labelled(
    unlabeled, digits, pretrained_base, tmp_path
):
    family, train, _ = digits
    personalization = {"method": "ditto", "lambda": 0.05, "epochs": 3, "lr": 0.01, "unlabeled": unlabeled}
    install(tmp_path, pretrained_base, family, version=1, training=training_manifest(family, personalization))
    runtime = device(tmp_path, scenario="label", per_poll=40)
    UnlabeledStore.of(tmp_path, runtime.config).append({"x": train["x"][:300].numpy()})
    runtime.policy.min_new_samples = 10_000  # the personal pass alone (a device with few labelled samples)
    state = runtime.train_once()["personal"]
    assert state["samples"] == 40 and state["val_samples"] == 4  # every 10th labelled sample, none unlabeled
    noted = [note for note in state["notes"] if "pseudo-labelled" in note]
    if unlabeled == "none":
        assert not noted
    else:  # at most as many as the labelled training slice (32), of the classes its user labelled
        assert noted and 0 < int(noted[0].split()[0]) <= 32, state["notes"]
    assert PersonalStore(tmp_path).tensors() is not None


def test_fedprox_holds_the_shared_pass_near_the_installed_version(digits, pretrained_base, tmp_path):
    """``proximal_mu`` in the manifest's training setting (FedProx): the same device, the same samples, the same
    seed; with a large mu the uploaded change is far smaller than without."""
    family, _, _ = digits
    norms = {}
    for mu in (0.0, 50.0):
        home = tmp_path / f"mu{mu}"
        training = {**training_manifest(family, {"method": "none"}), "proximal_mu": mu}
        install(home, pretrained_base, family, version=1, training=training)
        runtime = device(home, scenario="feature", per_poll=100)
        assert runtime.train_once()["status"] == "trained"
        delta = load(Outbox(home).pending()[0].read())
        norms[mu] = float(torch.sqrt(sum(t.double().square().sum() for t in delta.values())))
    assert 0 < norms[50.0] < 0.5 * norms[0.0], norms
