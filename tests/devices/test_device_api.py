"""The operator side of the fleet API: listing, filtering, lifecycle actions by role, events with authors."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from devices.models import Device


@pytest.fixture
def fleet(enrolled):
    a = enrolled("active", name="alpha")
    b = enrolled("pending", name="bravo")
    c = enrolled("quarantined", name="charlie")
    Device.objects.filter(pk=a.id).update(online=True, agent_version="1.2.0", labels={"site": "lab", "gpu": "no"})
    Device.objects.filter(pk=b.id).update(agent_version="1.1.0", labels={"site": "field"})
    return {"alpha": a, "bravo": b, "charlie": c}


def names(response) -> list[str]:
    assert response.status_code == 200, response.content
    return sorted(row["name"] for row in response.json()["results"])


@pytest.mark.django_db
def test_device_list_filters_and_search(api_client_for, fleet):
    client = api_client_for("viewer")
    assert names(client.get("/api/v1/devices/")) == ["alpha", "bravo", "charlie"]
    assert names(client.get("/api/v1/devices/?status=pending")) == ["bravo"]
    assert names(client.get("/api/v1/devices/?status=pending&status=quarantined")) == ["bravo", "charlie"]
    assert names(client.get("/api/v1/devices/?online=true")) == ["alpha"]
    assert names(client.get("/api/v1/devices/?agent_version=1.1.0")) == ["bravo"]
    assert names(client.get("/api/v1/devices/?label=site=lab")) == ["alpha"]
    assert names(client.get("/api/v1/devices/?label=gpu")) == ["alpha"]
    assert names(client.get("/api/v1/devices/?cohort=eu-phones")) == ["alpha", "bravo", "charlie"]
    assert names(client.get("/api/v1/devices/?cohort=nowhere")) == []
    assert names(client.get("/api/v1/devices/?search=char")) == ["charlie"]
    assert names(client.get(f"/api/v1/devices/?search={fleet['bravo'].id}")) == ["bravo"]
    bad = client.get("/api/v1/devices/?status=exploded")
    assert bad.status_code == 400 and "status" in bad.json()["error"]["details"]


@pytest.mark.django_db
def test_device_list_query_count_does_not_grow_with_the_fleet(api_client_for, enrolled, fleet):
    client = api_client_for("viewer")
    client.get("/api/v1/devices/")  # the token's first use records last_used_at once
    with CaptureQueriesContext(connection) as small:
        client.get("/api/v1/devices/")
    for index in range(15):
        enrolled("active", name=f"extra-{index}")
    with CaptureQueriesContext(connection) as large:
        assert len(client.get("/api/v1/devices/").json()["results"]) == 18
    assert len(large) == len(small) <= 6


@pytest.mark.django_db
def test_device_detail_shows_recent_events_with_their_authors(api_client_for, fleet, make_user):
    admin = api_client_for("admin")
    response = admin.post(f"/api/v1/devices/{fleet['bravo'].id}/approve/", {"reason": "checked serial"}, format="json")
    assert response.status_code == 200 and response.json()["status"] == "active"
    events = admin.get(f"/api/v1/devices/{fleet['bravo'].id}/").json()["recent_events"]
    assert [e["kind"] for e in events] == ["approved", "enrolled"]
    assert events[0]["actor_label"].startswith("admin-")
    assert events[0]["detail"] == {"from": "pending", "to": "active", "reason": "checked serial"}


@pytest.mark.parametrize(
    ("action", "device", "lowest_role", "result"),
    [
        ("approve", "bravo", "admin", "active"),
        ("reject", "bravo", "admin", "retired"),
        ("quarantine", "alpha", "operator", "quarantined"),
        ("reactivate", "charlie", "operator", "active"),
        ("retire", "alpha", "admin", "retired"),
    ],
)
@pytest.mark.django_db
def test_lifecycle_actions_by_role(api_client_for, fleet, action, device, lowest_role, result):
    device_id = fleet[device].id
    roles = ["viewer", "operator", "admin"]
    for role in roles[: roles.index(lowest_role)]:
        response = api_client_for(role).post(f"/api/v1/devices/{device_id}/{action}/")
        assert response.status_code == 403, (role, action)
        assert Device.objects.get(pk=device_id).status == fleet[device].device.status
    response = api_client_for(lowest_role).post(f"/api/v1/devices/{device_id}/{action}/")
    assert response.status_code == 200 and response.json()["status"] == result


@pytest.mark.django_db
def test_invalid_transitions_are_409_and_change_nothing(api_client_for, fleet):
    admin = api_client_for("admin")
    assert admin.post(f"/api/v1/devices/{fleet['alpha'].id}/approve/").status_code == 409
    admin.post(f"/api/v1/devices/{fleet['alpha'].id}/retire/")
    response = admin.post(f"/api/v1/devices/{fleet['alpha'].id}/reactivate/")
    assert response.status_code == 409
    assert response.json()["error"] == {
        "code": "invalid_transition",
        "message": "Cannot reactivate a device that is retired.",
        "details": {},
    }
    assert Device.objects.get(pk=fleet["alpha"].id).events.filter(kind="reactivated").count() == 0


@pytest.mark.django_db
def test_admin_edits_name_labels_and_cohort_and_bad_labels_are_refused(api_client_for, fleet):
    from devices.services import cohort_create

    cohort_create(name="us-watches")
    admin = api_client_for("admin")
    url = f"/api/v1/devices/{fleet['alpha'].id}/"
    response = admin.patch(url, {"name": "alpha-2", "labels": {"site": "hq"}, "cohort": "us-watches"}, format="json")
    assert response.status_code == 200
    assert response.json()["cohort"] == "us-watches" and response.json()["recent_events"][0]["kind"] == "updated"
    bad = admin.patch(url, {"labels": {"k": 5}}, format="json")
    assert bad.status_code == 400
    assert api_client_for("operator").patch(url, {"name": "x"}, format="json").status_code == 403
    assert Device.objects.get(pk=fleet["alpha"].id).name == "alpha-2"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "change",
    [{"name": "alpha\u202eexe.gpj"}, {"name": "alpha\x1b[2J"}, {"name": "alpha\nbeta"}, {"labels": {"site": "\x07"}}],
    ids=["rtl-override", "ansi-escape", "newline", "bell-in-label"],
)
def test_a_rename_with_a_control_character_is_refused_and_changes_nothing(api_client_for, fleet, change):
    admin = api_client_for("admin")
    url = f"/api/v1/devices/{fleet['alpha'].id}/"
    before = Device.objects.values("name", "labels").get(pk=fleet["alpha"].id)
    response = admin.patch(url, change, format="json")
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "invalid"
    assert "control characters are not accepted" in str(error["details"][next(iter(change))])
    assert Device.objects.values("name", "labels").get(pk=fleet["alpha"].id) == before
    assert not Device.objects.get(pk=fleet["alpha"].id).events.filter(kind="updated").exists()


@pytest.mark.django_db
def test_cohort_with_devices_cannot_be_deleted(api_client_for, fleet):
    admin = api_client_for("admin")
    cohort_id = admin.get("/api/v1/cohorts/").json()["results"][0]["id"]
    response = admin.delete(f"/api/v1/cohorts/{cohort_id}/")
    assert response.status_code == 409 and response.json()["error"]["code"] == "cohort_in_use"
    assert admin.get("/api/v1/cohorts/").json()["results"][0]["device_count"] == 3
