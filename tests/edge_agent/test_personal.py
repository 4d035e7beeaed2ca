"""The device's own model (edge_agent.personal): each method makes a personal adapter from local data that the
device keeps, serves where its validation says it helps, re-derives from a new shared version, and never
uploads (its delta stays the change to the shared adapter)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load, load_file

from edge_agent.families.common import take
from edge_agent.lora_layers import adapter_parameters, adapter_tensors
from edge_agent.packaging import Outbox
from edge_agent.personal import (
    PATIENCE,
    PersonalSettings,
    PersonalStore,
    choose,
    classifier_keys,
    contradicted_classes,
    misread_labels,
    paired,
    personalize,
    private_keys,
    proximal_penalty,
    repeats,
)
from edge_agent.protocol import PERSONALIZATION_DEFAULTS
from edge_agent.samples import device_split
from edge_agent.training import TrainConfig
from tests.edge_agent.personal_support import device, install, training_manifest
from tests.edge_agent.support import adapted

METHOD = {
    "ditto": {"method": "ditto", "lambda": 0.05, "epochs": 6, "lr": 0.01},
    "finetune": {"method": "finetune", "epochs": 6, "lr": 0.01},
    "private_modules": {"method": "private_modules", "private_modules": ["head"], "epochs": 6, "lr": 0.02},
}


@pytest.mark.parametrize("method", sorted(METHOD))
def test_a_device_whose_user_sees_digits_differently_gets_a_personal_model_that_beats_the_shared(
    method, digits, pretrained_base, tmp_path
):
    family, _, _ = digits
    training = training_manifest(family, METHOD[method])
    install(tmp_path, pretrained_base, family, version=1, training=training)
    runtime = device(tmp_path, scenario="feature")
    outcome = runtime.train_once()
    assert outcome["status"] == "trained", outcome
    state = PersonalStore(tmp_path).state()
    assert state["method"] == method and state["version"] == 1 and state["pending"] is None
    assert state["personal_accuracy"] > state["shared_accuracy"] + 0.05, state
    assert state["serving"] == "personal"
    beat = runtime.heartbeat()["personal"]
    assert beat["serving"] == "personal" and beat["val_samples"] == state["val_samples"] > 0
    # the upload is the change to the shared adapter, never the personal one
    item = Outbox(tmp_path).pending()[0]
    assert item.envelope["envelope"]["base_version"] == 1


def test_the_device_measures_both_models_on_a_held_slice_that_no_pass_trains_on(digits, pretrained_base, tmp_path):
    """The held slice (every 10th sample) is where the device measures and chooses: no pass trains on it, the
    refit included, and what it reports is the personal model it keeps, measured there."""
    family, _, _ = digits
    shared = install(tmp_path, pretrained_base, family, version=1, training=training_manifest(family, METHOD["ditto"]))
    runtime = device(tmp_path, scenario="feature")
    outcome = runtime.train_once()
    assert outcome["status"] == "trained", outcome
    samples = {k: torch.as_tensor(v) for k, v in runtime.samples.load(0, len(runtime.samples)).items()}
    train, val, held = device_split(samples)
    assert (len(train["y"]), len(val["y"]), len(held["y"])) == (160, 20, 20)
    assert outcome["before"]["samples"] == 20  # the shared pass is judged on validation, not on the held slice
    state = PersonalStore(tmp_path).state()
    assert any(note.startswith("refit on all 180 local samples for ") for note in state["notes"]), state["notes"]
    with np.load(tmp_path / "replay.npz") as replay:  # what later passes rehearse: training samples only
        rehearsed = {row.tobytes() for row in replay["x"]}
    assert rehearsed == {row.numpy().tobytes() for row in train["x"]}
    kept = adapted(pretrained_base, family, tensors=PersonalStore(tmp_path).tensors()).eval()
    assert state["personal_accuracy"] == round(family.evaluate(kept, held)["accuracy"], 6)
    assert state["val_samples"] == runtime.heartbeat()["personal"]["val_samples"] == 20
    # the paired counts the choice was made by travel with the figures
    counts = paired(adapted(pretrained_base, family, tensors=shared).eval(), kept, held)
    reported = runtime.heartbeat()["personal"]
    assert (reported["shared_only_right"], reported["personal_only_right"]) == (counts["shared"], counts["personal"])


def test_an_installs_guard_metrics_measure_the_personal_model_where_its_reports_do(digits, pretrained_base, tmp_path):
    """Guard metrics of an install: the version on both held-out slices (validation and held), the device's own
    model against it on the held slice alone, as its heartbeat reports it."""
    family, _, _ = digits
    training = training_manifest(family, METHOD["ditto"])
    install(tmp_path, pretrained_base, family, version=1, training=training)
    runtime = device(tmp_path, scenario="feature")
    assert runtime.train_once()["status"] == "trained"
    stored = runtime.adapters.state()
    manifest = {"adapter": "digits-lora", "training": training, "base_model_sha256": stored["base_model_sha256"]}
    metrics = runtime.evaluate_versions(None, Path(stored["current"]["path"]), manifest)
    assert metrics["val_samples"] == 40
    state = PersonalStore(tmp_path).state()
    assert metrics["shared_accuracy"] == state["shared_accuracy"]
    assert metrics["personal_accuracy"] == state["personal_accuracy"]
    assert metrics["personal_gain"] == round(state["personal_accuracy"] - state["shared_accuracy"], 6)


def test_private_modules_never_leave_the_device(digits, pretrained_base, tmp_path):
    family, _, _ = digits
    training = training_manifest(family, METHOD["private_modules"])
    shared = install(tmp_path, pretrained_base, family, version=1, training=training)
    runtime = device(tmp_path, scenario="concept")
    assert runtime.train_once()["status"] == "trained"
    delta = load(Outbox(tmp_path).pending()[0].read())  # f32: the file holds the change itself
    head = private_keys(shared, ["head"])
    assert head and all(float(delta[k].abs().max()) == 0.0 for k in head)
    assert any(float(delta[k].abs().max()) > 0 for k in set(delta) - head)
    personal = PersonalStore(tmp_path).tensors()
    assert any(not torch.equal(personal[k], shared[k]) for k in head)


def test_a_new_shared_version_re_derives_the_personal_model_and_keeps_its_private_parts(
    digits, pretrained_base, tmp_path
):
    family, _, _ = digits
    training = training_manifest(family, METHOD["private_modules"])
    install(tmp_path, pretrained_base, family, version=1, training=training)
    runtime = device(tmp_path, scenario="concept", per_poll=100)
    runtime.train_once()
    before = PersonalStore(tmp_path).tensors()
    new_shared = {k: v + 0.01 for k, v in load_file(str(tmp_path / "adapters" / "v1.safetensors")).items()}
    install(tmp_path, pretrained_base, family, version=2, training=training, tensors=new_shared)
    assert runtime.train_once()["status"] == "trained"
    state, after = PersonalStore(tmp_path).state(), PersonalStore(tmp_path).tensors()
    assert state["version"] == 2
    head = private_keys(after, ["head"])
    body = set(after) - head
    assert all(torch.equal(after[k], new_shared[k]) for k in body)  # the shared body of the new version
    assert all(not torch.equal(after[k], new_shared[k]) for k in head)  # the device's own head, trained on
    assert set(before) == set(after)


def test_a_new_shared_version_without_new_samples_redoes_the_personal_model_where_power_allows(
    digits, pretrained_base, tmp_path
):
    """A user who handed the device its samples once still gets what the fleet learns later: a new shared version
    runs the personal pass again on the samples the device holds (finetune: redone from the new version), though
    no shared pass is due."""
    family, _, _ = digits
    training = training_manifest(family, METHOD["finetune"])
    install(tmp_path, pretrained_base, family, version=1, training=training)
    runtime = device(tmp_path, scenario="concept", per_poll=100)
    assert runtime.train_once()["status"] == "trained"
    runtime.policy.min_new_samples = 10_000  # no shared pass due from here on
    new_shared = {k: v + 0.01 for k, v in load_file(str(tmp_path / "adapters" / "v1.safetensors")).items()}
    install(tmp_path, pretrained_base, family, version=2, training=training, tensors=new_shared)
    outcome = runtime.train_once()
    assert outcome["status"] == "skipped" and "too few new samples" in outcome["reason"]
    assert outcome["personal"]["version"] == 2 and outcome["personal"]["trained_samples"] > 0
    after = PersonalStore(tmp_path).tensors()
    assert any(not torch.equal(after[k], new_shared[k]) for k in after)  # fine-tuned from v2, not a copy of it
    assert runtime.train_once()["status"] == "skipped"  # once per version: nothing new, nothing redone
    assert PersonalStore(tmp_path).state()["updated_at"] == outcome["personal"]["updated_at"]


def test_the_device_serves_the_shared_version_only_where_its_held_slice_says_so_beyond_chance():
    settings = PersonalSettings(method="ditto", margin=0.02, min_val_samples=10)
    both = lambda acc_s, acc_p, n, right=(None, None): (  # noqa: E731
        {"accuracy": acc_s, "samples": n, **({} if right[0] is None else {"only_right": right[0]})},
        {"accuracy": acc_p, "samples": n, **({} if right[1] is None else {"only_right": right[1]})},
    )
    assert choose(*both(0.90, 0.91, 40), settings) == "personal"  # its own is no worse: it keeps it
    assert choose(*both(0.95, 0.90, 40), settings) == "personal"  # 2 samples of 40: chance
    assert choose(*both(1.00, 0.80, 40), settings) == "shared"  # 8 to 0
    assert choose(*both(1.00, 0.80, 40, (9, 1)), settings) == "shared"
    assert choose(*both(1.00, 0.80, 40, (12, 4)), settings) == "shared"  # 12 to 4: 3.8% by chance
    assert choose(*both(1.00, 0.80, 40, (7, 3)), settings) == "personal"  # 7 to 3: 17% by chance
    assert choose(*both(0.95, 0.50, 5), settings) == "personal"  # too few held samples to tell
    assert choose(*both(0.5, 0.9, 40), PersonalSettings()) == "shared"  # method none
    # copies of one sample (an application handing it over again and again) are one sample of evidence
    assert choose({"accuracy": 1.0, "samples": 24, "distinct": 1}, {"accuracy": 0.0, "samples": 24, "distinct": 1},
                  settings) == "personal"  # fmt: skip
    # nothing held (fewer than 10 samples): the shared version stays where it reads each label right mostly
    nothing = {"accuracy": float("nan"), "samples": 0, "distinct": 0}
    assert choose({**nothing, "misread_labels": 0}, nothing, settings) == "shared"
    assert choose({**nothing, "misread_labels": 1}, nothing, settings) == "personal"  # a digit it names otherwise


def test_misread_labels_are_those_the_shared_version_calls_otherwise_more_often_than_not():
    class Reads(torch.nn.Module):  # predicts the class its input names
        def forward(self, x):
            return torch.nn.functional.one_hot(x[:, 0].long(), 10).float()

    data = {"x": torch.tensor([[6.0], [6.0], [4.0], [4.0], [5.0], [0.0]]), "y": torch.tensor([1, 1, 4, 4, 5, 5])}
    assert misread_labels(Reads(), data) == [1]  # label 5: one of two misread is not more than half


def test_a_held_sample_handed_over_again_counts_once(digits):
    _, train, _ = digits
    five = take(train, torch.arange(40))
    five = take(five, torch.cat([torch.nonzero(five["y"] == c).flatten()[:1] for c in five["y"].unique()[:3]] +
                                [torch.nonzero(five["y"] == five["y"][0]).flatten()[1:3]]))  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    again = {"x": (five["x"] + 0.02 * torch.randn(five["x"].shape, generator=generator)).clamp(0, 1), "y": five["y"]}
    group = repeats({k: torch.cat([five[k], again[k]]) for k in five})
    n = len(five["y"])
    assert group[:n].tolist() == list(range(n))  # distinct digits, some of the same class: all distinct
    assert group[n:].tolist() == list(range(n))  # their copies with a little noise: the same samples


def test_a_device_holding_fewer_samples_than_a_shared_pass_needs_trains_its_own_model(
    digits, pretrained_base, tmp_path
):
    """A user who hands the device fewer than ``min_new_samples`` samples: no shared pass, nothing uploaded, but
    the personal pass runs on what it holds, and again each time that has doubled, until a shared pass is due."""
    family, _, _ = digits
    install(tmp_path, pretrained_base, family, version=1, training=training_manifest(family, METHOD["ditto"]))
    runtime = device(tmp_path, scenario="concept", per_poll=5)  # min_new_samples 16
    outcome = runtime.train_once()
    assert outcome["status"] == "skipped" and "too few new samples" in outcome["reason"]
    assert outcome["personal"]["samples"] == 5 and outcome["personal"]["trained_samples"] == 4
    assert PersonalStore(tmp_path).tensors() is not None and not Outbox(tmp_path).pending()
    assert runtime.train_once()["personal"]["samples"] == 10  # twice as many: again
    assert "personal" not in runtime.train_once()  # 15 samples: not twice the 10 it trained on
    assert runtime.train_once()["status"] == "trained"  # 20 new samples: the shared pass, then the personal one
    assert PersonalStore(tmp_path).state()["samples"] == 20 and len(Outbox(tmp_path).pending()) == 1


def test_unknown_methods_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="unknown personalization method"):
        PersonalSettings.from_training({"personalization": {"method": "magic"}})
    with pytest.raises(ValueError, match="lambda"):
        PersonalSettings.from_training({"personalization": {"method": "ditto", "lambda": float("nan")}})
    assert PersonalSettings.from_training({}).method == "none"


def test_a_setting_the_manifest_leaves_out_takes_the_servers_default():
    partial = PersonalSettings.from_training({"personalization": {"method": "ditto", "epochs": 3}})
    expected = {**PERSONALIZATION_DEFAULTS, "method": "ditto", "epochs": 3}
    assert partial.as_dict() == expected
    assert PersonalSettings.from_training({"personalization": PERSONALIZATION_DEFAULTS}) == PersonalSettings(
        method=PERSONALIZATION_DEFAULTS["method"]
    )


class _Fixed(torch.nn.Module):
    """A "shared version" that calls every sample the class in its ``x`` (one-hot logits times ``sureness``: at
    the default, top-class probability 0.9998)."""

    def __init__(self, sureness: float = 10.0):
        super().__init__()
        self.sureness = sureness

    def forward(self, x):
        return torch.nn.functional.one_hot(x, 10).float() * self.sureness


def test_contradicted_classes_are_the_labels_the_shared_version_calls_otherwise_and_what_it_calls_them():
    # label 3: the shared version calls 2 of 3 samples 5 (contradicted); label 1: 1 of 3 called 7 (under half:
    # agreed, so kept pulled); label 4: all agreed
    data = {"x": torch.tensor([5, 5, 3, 7, 1, 1, 4, 4]), "y": torch.tensor([3, 3, 3, 1, 1, 1, 4, 4])}
    assert contradicted_classes(_Fixed(), data) == [3, 5]
    assert contradicted_classes(_Fixed(), {"x": torch.tensor([4]), "y": torch.tensor([4])}) == []
    # label 4: one of its two samples called 9, a tie, not a contradiction (a skewed label mix's odd sample)
    assert contradicted_classes(_Fixed(), {"x": torch.tensor([4, 9, 2]), "y": torch.tensor([4, 4, 2])}) == []
    assert contradicted_classes(_Fixed(), {"x": torch.zeros(0, dtype=torch.long), "y": torch.zeros(0)}) == []


def test_nothing_is_released_where_the_shared_version_reads_two_of_the_devices_labels_as_one_class():
    # labels 3 and 6 both read as 5: not a user's own names (a relabeling is one to one) but inputs the shared
    # version cannot tell apart, as a rotated sensor's; every row stays pulled
    data = {"x": torch.tensor([5, 5, 5, 5, 5, 6, 4]), "y": torch.tensor([3, 3, 3, 6, 6, 6, 4])}
    assert contradicted_classes(_Fixed(), data) == []
    swapped = {"x": torch.tensor([6, 6, 3, 3, 4]), "y": torch.tensor([3, 3, 6, 6, 4])}  # a swap is one to one
    assert contradicted_classes(_Fixed(), swapped) == [3, 6]


def test_nothing_is_released_where_the_shared_version_is_unsure_of_what_it_reads():
    # the same swap, read by a shared version that is not sure of it (top-class probability 0.45 at sureness 2,
    # 0.89 at 4.3): a sensor it cannot read, not a user's own names; released from 0.9 (SURE)
    swapped = {"x": torch.tensor([6, 6, 3, 3, 4]), "y": torch.tensor([3, 3, 6, 6, 4])}
    assert contradicted_classes(_Fixed(sureness=2.0), swapped) == []
    assert contradicted_classes(_Fixed(sureness=4.3), swapped) == []
    assert contradicted_classes(_Fixed(sureness=4.5), swapped) == [3, 6]


def test_the_pull_leaves_released_rows_free_and_holds_the_others(digits, pretrained_base):
    family, _, _ = digits
    model = adapted(pretrained_base, family)
    anchor = {k: v.detach().clone() for k, v in adapter_parameters(model).items()}
    keys = classifier_keys(anchor, family)
    assert keys == ["base_model.model.head.weight", "base_model.model.head.bias"]
    with torch.no_grad():
        for parameter in adapter_parameters(model).values():
            parameter.add_(0.5)
    penalty = proximal_penalty(model, anchor, 1.0, free_rows={key: [2, 7] for key in keys})
    penalty(model).backward()
    for key in keys:
        gradient = adapter_parameters(model)[key].grad
        assert float(gradient[[2, 7]].abs().max()) == 0.0
        assert float(gradient[[0, 1, 3, 4, 5, 6, 8, 9]].abs().min()) > 0.0
    body = [k for k in anchor if k not in keys]
    assert all(float(adapter_parameters(model)[k].grad.abs().min()) > 0 for k in body)


@pytest.mark.parametrize("judged", [True, False])
def test_the_personal_pass_stops_where_validation_loss_stops_falling_and_refits_for_its_best_epochs(
    judged, digits, pretrained_base
):
    """Ditto's personal pass runs at most the setting's ``epochs``, stops after ``PATIENCE`` without a lower
    validation loss and refits on all local data for its best epoch count; a validation slice under
    ``min_val_samples`` judges nothing (every epoch trained, the last kept)."""
    family, train, _ = digits
    shared = adapter_tensors(adapted(pretrained_base, family))
    settings = PersonalSettings(method="ditto", lam=0.1, epochs=60, min_val_samples=10 if judged else 50)
    outcome = personalize(build=lambda tensors: adapted(pretrained_base, family, tensors=tensors), shared=shared,
                          personal=None, train=take(train, slice(0, 40)), val=take(train, slice(40, 60)),
                          held=take(train, slice(60, 70)), settings=settings, family=family,
                          config=TrainConfig(seed=1))  # fmt: skip
    result = outcome.result
    assert not result.discarded, result.reason
    if judged:
        assert result.stopped_early and result.epochs_run == result.best_epoch + PATIENCE < 60, result
        assert f"refit on all 60 local samples for {result.best_epoch} epochs" in result.notes
    else:
        assert result.epochs_run == 60 and not result.stopped_early
        assert any("too few to judge by" in note for note in result.notes)


@pytest.mark.parametrize("release", [True, False])
def test_ditto_releases_the_classes_a_user_names_their_own_way(release, digits, pretrained_base, tmp_path):
    """A concept user (two pairs of labels swapped): with release_classes the personal pass notes the classes it
    freed and the personal model learns the user's names for them, and the shared pass uploads no change of those
    rows (they are the device's own); without it every row stays pulled and shared."""
    family, _, _ = digits
    # A head this sure is slow to turn: 6 epochs (2 free) left the user's names unlearnt (0.34 against the
    # shared version's 0.37 on the freed classes), 40 (10 free) learn them.
    setting = {"method": "ditto", "lambda": 1.0, "epochs": 40, "lr": 0.01, "release_classes": release}
    sure = adapter_tensors(adapted(pretrained_base, family))  # the base's head, its logits 4x: reads as sure of
    for key in classifier_keys(sure, family):  # the user's swapped digits as a fleet's well-trained version would
        sure[key] = sure[key] * 4.0
    install(tmp_path, pretrained_base, family, version=1, training=training_manifest(family, setting), tensors=sure)
    runtime = device(tmp_path, scenario="concept", index=1)
    assert runtime.train_once()["status"] == "trained"
    state = PersonalStore(tmp_path).state()
    freed = [note for note in state["notes"] if "train free of the pull" in note]
    assert bool(freed) == release, state["notes"]
    delta = load(Outbox(tmp_path).pending()[0].read())  # f32: the file holds the change itself
    head = classifier_keys(delta, family)
    released = [int(c) for c in freed[0].split("[")[1].split("]")[0].split(",")] if release else []
    kept = [c for c in range(10) if c not in released]
    assert all(float(delta[key][released].abs().sum()) == 0.0 for key in head)
    assert all(float(delta[key][kept].abs().max()) > 0.0 for key in head)
    if release:  # on the user's samples of the freed classes, the personal model reads the user's names
        samples = {k: torch.as_tensor(v) for k, v in runtime.samples.load(0, len(runtime.samples)).items()}
        mine = take(samples, torch.isin(samples["y"], torch.tensor(released)).nonzero().flatten())
        personal = PersonalStore(tmp_path).tensors()
        accuracy = {name: family.evaluate(adapted(pretrained_base, family, tensors=tensors).eval(), mine)["accuracy"]
                    for name, tensors in (("personal", personal), ("shared", sure))}  # fmt: skip
        assert accuracy["personal"] > accuracy["shared"] + 0.2, accuracy
