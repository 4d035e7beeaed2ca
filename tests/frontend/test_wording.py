"""Numbers, details and events in words (frontend/wording.py, frontend/event_text.py): what the dashboard
prints instead of raw floats, field names, event kinds and device UUIDs."""

from __future__ import annotations

import math

import pytest

from frontend import event_text
from frontend.wording import detail_text, number, plural


@pytest.mark.parametrize(
    ("value", "key", "shown"),
    [
        (4.420330172652994, "update_norm", "4.42"),
        (0.9321, "eval_accuracy", "93.2%"),
        (0.2, "max_failure_rate", "20.0%"),
        (1.7, "eval_accuracy", "1.7"),  # not a fraction after all: not a percent
        (0.001, "learning_rate", "0.001"),  # a rate that is not a share of anything
        (0.00001234, "", "1.23e-05"),
        (2.0, "", "2"),
        (123456.789, "", "123,457"),
        (12345, "samples", "12,345"),
        (True, "", "yes"),
        (None, "", "—"),
        (math.nan, "eval_loss", "NaN"),
        (math.inf, "", "∞"),
        ("fedavg", "strategy", "fedavg"),
        (0.304, "personal_gain", "+30.4 points"),  # a gain in accuracy is in points, as everywhere else
        (-0.012, "val_accuracy_change", "-1.2 points"),
    ],
)
def test_numbers_are_shown_for_people(value, key, shown):
    assert number(value, key) == shown


def test_a_detail_dict_reads_as_names_and_formatted_values_cut_at_the_limit():
    detail = {"update_norm": 4.420330172652994, "eval_accuracy": 0.875, "targets": ["q", "v"], "dp": None}
    assert detail_text(detail) == "update norm: 4.42; eval accuracy: 87.5%; targets: q, v; dp: none"
    assert detail_text({"note": "x" * 300}, limit=20) == "note: " + "x" * 13 + "…"
    assert detail_text({}) == "" and detail_text("not a dict") == ""


def test_event_details_read_as_key_value_pairs_cut_at_a_word_boundary_never_mid_dictionary():
    detail = {
        "aggregation": {"strategy": "trimmed_mean", "trim_fraction": 0.1, "server_lr": 1.0},
        "dp": {"noise_multiplier": 0.8, "clip": 2.5},
    }
    text = event_text.training_event("adapter.aggregation_changed", detail, "digits-lora")
    assert text.startswith("digits-lora's aggregation changed: aggregation: (strategy: trimmed_mean; ")
    assert "{" not in text and "}" not in text
    cut = detail_text({"reason": "the new version loses accuracy on every device of the night shift"}, limit=40)
    assert cut == "reason: the new version loses accuracy…" and len(cut) <= 40
    phases = {"guards": [], "phases": [{"percent": 34, "min_soak_seconds": 600}, {"percent": 100}]}
    assert detail_text(phases) == "guards: none; phases: (percent: 34; min soak seconds: 600), (percent: 100)"


def test_plurals_count_their_noun():
    assert plural(1, "delta") == "1 delta"
    assert plural(1200, "sample") == "1,200 samples"


@pytest.mark.parametrize(
    ("kind", "detail", "sentence"),
    [
        (
            "enrolled",
            {"token": "fet_ab12", "status": "pending"},
            "demo-03 enrolled with token fet_ab12… and waits for approval",
        ),
        (
            "quarantined",
            {"from": "active", "to": "quarantined", "reason": "bad deltas"},
            "demo-03 quarantined: bad deltas",
        ),
        ("online", {}, "demo-03 came online"),
        ("offline", {}, "demo-03 went offline"),
        ("updated", {"agent_version": "0.2", "hardware": {}}, "demo-03 updated: agent version, hardware"),
        ("something_new", {"score": 0.123456}, "demo-03: something new (score: 0.123)"),
    ],
)
def test_device_events_read_as_sentences_about_the_device_by_name(kind, detail, sentence):
    assert event_text.device_event(kind, detail, "demo-03") == sentence


@pytest.mark.parametrize(
    ("kind", "detail", "version", "sentence"),
    [
        ("round.opened", {"round": 4, "base_version": 2}, None, "round 4 of digits-lora opened on v2"),
        ("round.closed", {"round": 4, "reason": "buffer_full", "deltas": 5}, None,
         "round 4 of digits-lora closed with 5 deltas (buffer full)"),
        ("round.completed", {"round": 4, "deltas": 5, "samples": 240, "update_norm": 1.234567}, 3,
         "round 4 of digits-lora made version 3 from 5 deltas and 240 samples"),
        ("round.failed", {"round": 4, "reason": "NaN in the aggregate"}, None,
         "round 4 of digits-lora failed: NaN in the aggregate"),
        ("version.released", {"reason": ""}, 3, "version 3 of digits-lora released"),
        ("version.created", {"source": "seed", "seed": 7}, 1, "version 1 of digits-lora created, from seed 7"),
        ("rollout.started", {"rollout": 9, "assigned": 6}, 3,
         "rollout 9 of digits-lora v3 started (6 devices assigned)"),
        ("rollout.phase", {"rollout": 9, "phase": 1, "assigned": 1}, 3,
         "rollout 9 of digits-lora v3 moved to phase 2 (1 more device)"),
        ("adapter.cohorts_changed", {"cohorts": ["eu", "us"], "added": ["us"], "removed": []}, None,
         "digits-lora now serves eu, us"),
        ("adapter.personalization_changed", {"personalization": {"method": "finetune", "epochs": 8}, "previous": {}},
         None, "digits-lora now personalizes with finetune (epochs: 8)"),
        ("adapter.personalization_changed", {"personalization": {}, "previous": {"epochs": 8}}, None,
         "digits-lora now personalizes with the default method"),
    ],
)  # fmt: skip
def test_training_events_read_as_sentences_with_adapter_and_version(kind, detail, version, sentence):
    assert event_text.training_event(kind, detail, "digits-lora", version) == sentence


DEVICE = "3f0e8c52-6a8e-4f3a-9d59-1f2b3c4d5e6f"


@pytest.mark.parametrize(
    ("kind", "data", "sentence", "url"),
    [
        ("delta.received", {"device": DEVICE, "device_name": "demo-03", "adapter": "digits-lora", "base_version": 2,
                            "num_samples": 48, "state": "received"},
         "demo-03 uploaded a delta for digits-lora (v2, 48 samples)", f"/devices/{DEVICE}/"),
        ("delta.verified", {"device": DEVICE, "device_name": "demo-03", "adapter": "digits-lora", "base_version": 2,
                            "num_samples": 48, "state": "accepted", "round": 4},
         "demo-03's delta for digits-lora (v2, 48 samples) was accepted into round 4", f"/devices/{DEVICE}/"),
        ("delta.rejected", {"device": DEVICE, "device_name": "demo-03", "adapter": "digits-lora", "base_version": 2,
                            "num_samples": 48, "state": "rejected", "rejection_code": "norm_too_large"},
         "demo-03's delta for digits-lora (v2, 48 samples) was rejected: norm too large", f"/devices/{DEVICE}/"),
        ("device.online", {"device": DEVICE, "name": "demo-03"}, "demo-03 came online", f"/devices/{DEVICE}/"),
        ("round.progress", {"id": 4, "adapter": "digits-lora", "state": "collecting", "deltas": 3, "buffer_size": 5},
         "round 4 of digits-lora: 3 of 5 deltas collected", "/rounds/4/"),
        ("round.progress", {"id": 4, "adapter": "digits-lora", "state": "aggregating", "deltas": 5, "buffer_size": 5},
         "round 4 of digits-lora closed with 5 deltas; aggregating", "/rounds/4/"),
        ("round.completed", {"id": 4, "adapter": "digits-lora", "state": "completed", "deltas": 5,
                             "result_version": 3},
         "round 4 of digits-lora made version 3 from 5 deltas", "/rounds/4/"),
        ("rollout.phase", {"id": 9, "state": "running", "phase": 2, "version": 12}, "rollout 9 moved to phase 3",
         "/rollouts/9/"),
        ("fleet.presence", {"online": 1500, "came_online": 60, "went_offline": 2},
         "60 devices came online, 2 went offline (1,500 online)", ""),
        ("device.online", {"device": "not-a-uuid"}, "a device came online", ""),
    ],
)  # fmt: skip
def test_live_events_read_as_sentences_with_names_and_link_to_their_page(kind, data, sentence, url):
    assert event_text.live_event(kind, data) == sentence
    assert event_text.live_link(kind, data) == url
