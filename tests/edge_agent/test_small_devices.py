"""A device too small to keep a held slice judges shared versions by the server's per-class evaluation weighted by
its own labels, and keeps serving the version that scored best so (``edge_agent.small_devices``)."""

from __future__ import annotations

import math

import torch
from safetensors.torch import load_file

from edge_agent.api import Agent
from edge_agent.lora_layers import adapter_tensors
from edge_agent.personal import PersonalOutcome, PersonalSettings, PersonalStore
from edge_agent.small_devices import class_mix_accuracy, serve_small
from tests.edge_agent.personal_support import device, install, training_manifest

DITTO = {"method": "ditto", "lambda": 0.05, "epochs": 2, "lr": 0.01}
NOTHING_HELD = {"accuracy": float("nan"), "samples": 0, "distinct": 0, "misread_labels": 0}


def test_the_per_class_figures_are_weighed_by_the_devices_labels():
    figures = [0.9, 0.5, None, 1.0]
    assert math.isclose(class_mix_accuracy(figures, [0, 0, 0, 1]), (3 * 0.9 + 0.5) / 4)
    assert class_mix_accuracy(figures, [3, 3]) == 1.0
    assert class_mix_accuracy(figures, [0, 2]) is None  # a label the evaluation has no sample of
    assert class_mix_accuracy(figures, [0, 7]) is None  # a label beyond the figures
    assert class_mix_accuracy(None, [0]) is None and class_mix_accuracy(figures, []) is None


def _current(version: int, figures, path="") -> dict:
    training = {"personalization": DITTO, **({"class_accuracy": figures} if figures is not None else {})}
    return {"adapter": "digits-lora", "version": version, "sha256": f"{version:064d}", "path": path,
            "training": training}  # fmt: skip


def _outcome(serving="shared", held=NOTHING_HELD) -> PersonalOutcome:
    return PersonalOutcome({"w": torch.full((2,), -1.0)}, dict(held), dict(held), serving)


def test_a_device_without_a_held_slice_keeps_the_version_that_scores_best_on_its_labels(tmp_path):
    store, settings = PersonalStore(tmp_path), PersonalSettings(method="ditto", margin=0.01)
    labels = [3, 3, 3, 8, 8]
    v1, v2, v3, v4 = ({"w": torch.full((2,), float(n))} for n in (1, 2, 3, 4))
    # version 1: nothing kept yet, so it is served and kept
    outcome, fields = serve_small(store, _current(1, [0.5] * 3 + [0.96] + [0.5] * 4 + [0.95, 0.5]), _outcome(),
                                  settings, labels, v1)  # fmt: skip
    assert outcome.serving == "shared" and fields["earlier"]["version"] == 1 and fields["earlier_version"] is None
    store.save(outcome.tensors, **fields)
    # version 2: better for the fleet, 10 points worse on this device's digits: version 1 is served instead
    worse = [0.99] * 3 + [0.86] + [0.99] * 4 + [0.85, 0.99]
    outcome, fields = serve_small(store, _current(2, worse), _outcome(), settings, labels, v2)
    assert outcome.serving == "personal" and fields == {"earlier_version": 1}
    assert torch.equal(outcome.tensors["w"], v1["w"]) and "serving v1" in outcome.notes[-1]
    store.save(outcome.tensors, serving=outcome.serving, **fields)
    # version 3: within the margin of version 1 on these digits: served, and version 1 stays the one kept
    near = [0.5] * 3 + [0.955] + [0.5] * 4 + [0.945, 0.5]
    outcome, fields = serve_small(store, _current(3, near), _outcome(), settings, labels, v3)
    assert outcome.serving == "shared" and fields == {"earlier_version": None}
    assert store.state()["earlier"]["version"] == 1
    # version 4: better on them: served and kept
    outcome, fields = serve_small(store, _current(4, [0.97] * 10), _outcome(), settings, labels, v4)
    assert outcome.serving == "shared" and fields["earlier"]["version"] == 4
    store.save(None, **fields)
    assert torch.equal(load_file(str(store.root / "earlier.safetensors"))["w"], v4["w"])


def test_the_rule_leaves_alone_what_it_cannot_judge(tmp_path):
    store, settings = PersonalStore(tmp_path), PersonalSettings(method="ditto")
    held = {"accuracy": 0.9, "samples": 12, "distinct": 12}
    for current, outcome, chosen_settings in (
        (_current(2, [0.1] * 10), _outcome(held=held), settings),  # a held slice: choose() judged
        (_current(2, [0.1] * 10), _outcome(serving="personal"), settings),  # its own model already
        (_current(2, None), _outcome(), settings),  # no per-class figures in the manifest
        (_current(2, [0.1] * 10), _outcome(), PersonalSettings(method="private_modules")),
        (_current(2, [0.1] * 10), _outcome(), PersonalSettings(method="none")),
    ):
        after, fields = serve_small(store, current, outcome, chosen_settings, [1, 2], {"w": torch.zeros(2)})
        assert after is outcome and fields == {"earlier_version": None}
    assert not (store.root / "earlier.safetensors").exists()


def test_a_small_device_serves_the_earlier_version_through_its_runtime_and_application(
    digits, pretrained_base, tmp_path
):
    """Through the runtime's personal pass and ``Agent.served``: a device of 5 samples, version 1 installed and
    served, then a version 2 whose per-class figures on its labels are far lower: the application is served
    version 1's adapter, said so in ``earlier_version``; a version 3 that scores higher is served."""
    family, _, _ = digits
    training = training_manifest(family, DITTO)
    good = {**training, "class_accuracy": [0.95] * 10}
    v1 = install(tmp_path, pretrained_base, family, version=1, training=good)
    runtime = device(tmp_path, scenario="label", index=1, per_poll=5)  # reads its 5 right
    first = runtime.train_once()["personal"]
    assert first["serving"] == "shared" and first["earlier"]["version"] == 1, first
    runtime.config.data = {"kind": "application"}  # no more samples: still too few to hold any out
    install(tmp_path, pretrained_base, family, version=2, training={**training, "class_accuracy": [0.5] * 10},
            tensors={k: v + 0.01 for k, v in v1.items()})  # fmt: skip
    second = runtime.train_once()["personal"]
    assert second["version"] == 2 and second["serving"] == "personal" and second["earlier_version"] == 1, second
    model, about = Agent(tmp_path).served()
    assert about["serving"] == "personal" and about["earlier_version"] == 1 and about["version"] == 2
    served = adapter_tensors(model)  # the model the application is handed carries version 1's adapter
    assert set(served) == set(v1) and all(torch.equal(served[k], v1[k]) for k in v1)
    install(tmp_path, pretrained_base, family, version=3, training={**training, "class_accuracy": [0.97] * 10},
            tensors={k: v + 0.02 for k, v in v1.items()})  # fmt: skip
    third = runtime.train_once()["personal"]
    assert third["serving"] == "shared" and third["earlier"]["version"] == 3 and third["earlier_version"] is None
    assert "earlier_version" not in Agent(tmp_path).served()[1]
