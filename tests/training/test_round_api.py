"""The rounds, deltas and aggregation-settings API, as operators and integrations use it."""

import pytest

from tests.training.test_rounds import make_delta_tensors, receive
from training.federation.verification import delta_verify
from training.models import Round
from training.registry.services import version_create_seeded


@pytest.fixture
def ready(adapter, cohort, enrolled):
    adapter.cohorts.add(cohort)
    version_create_seeded(adapter=adapter, seed=3)
    return adapter, enrolled("active")


@pytest.mark.django_db
def test_operators_open_and_close_rounds_and_bad_requests_change_nothing(ready, api_client_for):
    adapter, device = ready
    operator = api_client_for("operator")
    opened = operator.post("/api/v1/rounds/", {"adapter": adapter.name, "buffer_size": 5}, format="json")
    assert opened.status_code == 201, opened.content
    body = opened.json()
    assert body["state"] == "collecting" and body["base_version"] == 1 and body["strategy"] == "fedavg"
    again = operator.post("/api/v1/rounds/", {"adapter": adapter.name}, format="json")
    assert again.status_code == 409 and again.json()["error"]["code"] == "round_already_open"
    empty = operator.post(f"/api/v1/rounds/{body['id']}/close/")
    assert empty.status_code == 409 and empty.json()["error"]["code"] == "round_empty"
    rerun = operator.post(f"/api/v1/rounds/{body['id']}/rerun/")
    assert rerun.status_code == 409
    delta_verify(delta_id=receive(device, adapter, make_delta_tensors(adapter, seed=1), counter=1).pk)
    closed = operator.post(f"/api/v1/rounds/{body['id']}/close/")
    assert closed.status_code == 200 and closed.json()["state"] == "aggregating"
    assert closed.json()["close_reason"] == "manual" and closed.json()["accepted"] == 1
    viewer = api_client_for("viewer")
    assert viewer.post("/api/v1/rounds/", {"adapter": adapter.name}, format="json").status_code == 403
    listed = viewer.get("/api/v1/rounds/?state=aggregating").json()
    assert listed["count"] == 1


@pytest.mark.django_db
def test_a_failed_round_runs_again(ready, api_client_for):
    adapter, device = ready
    delta_verify(delta_id=receive(device, adapter, make_delta_tensors(adapter, seed=1), counter=1).pk)
    round_ = Round.objects.get()
    Round.objects.filter(pk=round_.pk).update(state=Round.State.FAILED, failure="worker lost")
    response = api_client_for("operator").post(f"/api/v1/rounds/{round_.pk}/rerun/")
    assert response.status_code == 200 and response.json()["state"] == "aggregating"
    assert response.json()["failure"] == ""


@pytest.mark.django_db
def test_deltas_list_their_verification_result_and_filter_by_rejection(ready, api_client_for):
    adapter, device = ready
    delta_verify(delta_id=receive(device, adapter, make_delta_tensors(adapter, seed=1), counter=1).pk)
    delta_verify(delta_id=receive(device, adapter, make_delta_tensors(adapter, seed=2), counter=1).pk)
    viewer = api_client_for("viewer")
    rejected = viewer.get("/api/v1/deltas/?rejection_code=replayed_counter").json()
    assert rejected["count"] == 1
    row = rejected["results"][0]
    assert row["state"] == "rejected" and "counter 1" in row["rejection_detail"] and row["round"] is None
    assert viewer.get("/api/v1/deltas/?state=accepted").json()["count"] == 1


@pytest.mark.django_db
def test_aggregation_settings_are_validated_and_recorded(ready, api_client_for):
    adapter, _ = ready
    operator = api_client_for("operator")
    url = f"/api/v1/adapters/{adapter.pk}/aggregation/"
    for bad in (
        {"aggregation": {"strategy": "magic"}},
        {"aggregation": {"buffer_size": 0}},
        {"aggregation": {"min_deltas": 9, "buffer_size": 2}},
        {"aggregation": {"trim_ratio": 0.7}},
        {"aggregation": {"unknown": 1}},
        {"dp": {"noise_multiplier": -1}},
        {"aggregation": "median"},
    ):
        response = operator.put(url, bad, format="json")
        assert response.status_code == 400, (bad, response.content)
    adapter.refresh_from_db()
    assert adapter.aggregation == {"strategy": "fedavg"}
    good = operator.put(url, {"aggregation": {"strategy": "trimmed_mean", "trim_ratio": 0.2}}, format="json")
    assert good.status_code == 200 and good.json()["aggregation"]["strategy"] == "trimmed_mean"
    assert adapter.events.filter(kind="adapter.aggregation_changed").exists()
    assert api_client_for("viewer").put(url, {"aggregation": {}}, format="json").status_code == 403
