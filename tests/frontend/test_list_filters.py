"""One filterset per list, read by the API and the dashboard alike (devices.filters, training.filters): the same
query lists the same rows in the same order on both, whichever side's name a parameter uses, and a value neither
can read is a 400 with the error body on the API and a form error (a 400 page, never a 500) on the dashboard.

The dashboard's form spells a boolean yes/no and "any" as ""; the API refuses both (README, "API"): the same
filter reads the page's spelling only from the page (``FilterSet(from_form=True)``)."""

from __future__ import annotations

import re
from urllib.parse import urlencode

import pytest

from devices.models import Cohort, Device, DeviceStatus
from tests.frontend.conftest import make_devices, make_versions
from training.models import Rollout, Round
from training.registry.services import adapter_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(cohort, adapter):
    """Devices that differ in every filtered field: status, online, cohort, labels, agent version, version."""
    versions = make_versions(adapter, 2)
    active = make_devices(cohort, 6)  # labels site=lab|field, every third online, agent 0.1.0
    make_devices(cohort, 2, status=DeviceStatus.PENDING, prefix="new")
    tablets = make_devices(Cohort.objects.create(name="us-tablets"), 3, status=DeviceStatus.QUARANTINED, prefix="tab")
    Device.objects.filter(pk__in=[d.pk for d in tablets]).update(agent_version="0.2.0", labels={"rack": "b"})
    Device.objects.filter(pk=tablets[0].pk).update(name="field unit 7")
    Device.objects.filter(pk=active[1].pk).update(running_version=versions[0])
    Device.objects.filter(pk=active[2].pk).update(running_version=versions[1])
    return {"active": active, "tablets": tablets, "versions": versions}


def _api_ids(client, path: str, query: str) -> list[str]:
    response = client.get(f"/api/v1/{path}/?{query}")
    assert response.status_code == 200, (query, response.content)
    return [str(row["id"]) for row in response.json()["results"]]


def _page_ids(client, path: str, query: str, row: str) -> list[str]:
    response = client.get(f"/{path}/?{query}")
    assert response.status_code == 200, (query, response.status_code)
    return re.findall(rf'<tr data-{row}="([^"]+)"', response.content.decode())


def _expected(predicate, *, reverse: bool = False) -> list[str]:
    devices = sorted((d for d in Device.objects.all() if predicate(d)), key=lambda d: (d.name, str(d.pk)))
    return [str(d.pk) for d in (reversed(devices) if reverse else devices)]


def _device_queries(fleet) -> list[tuple[list[tuple[str, str]], object, bool]]:
    """(query, which devices it lists, newest name first?) — the API's names and the dashboard's."""
    third, first_version = fleet["active"][3], fleet["versions"][0]
    return [
        ([], lambda d: True, False),
        ([("status", "pending")], lambda d: d.status == "pending", False),
        ([("status", "pending"), ("status", "quarantined")], lambda d: d.status in ("pending", "quarantined"), False),
        ([("online", "true")], lambda d: d.online, False),
        ([("online", "false")], lambda d: not d.online, False),
        ([("online", "0")], lambda d: not d.online, False),
        ([("cohort", "us-tablets")], lambda d: d.cohort.name == "us-tablets", False),
        ([("agent_version", "0.2.0")], lambda d: d.agent_version == "0.2.0", False),
        ([("label", "site")], lambda d: "site" in d.labels, False),
        ([("label", "site=lab")], lambda d: d.labels.get("site") == "lab", False),
        ([("search", "tab")], lambda d: "tab" in d.name, False),
        ([("q", "tab")], lambda d: "tab" in d.name, False),  # the dashboard's name for search
        ([("search", "unit 0.2")], lambda d: "unit" in d.name and "0.2" in d.agent_version, False),
        ([("search", str(third.pk))], lambda d: d.pk == third.pk, False),
        ([("q", str(third.pk))], lambda d: d.pk == third.pk, False),
        ([("version", "none")], lambda d: d.running_version_id is None, False),
        ([("version", str(first_version.pk))], lambda d: d.running_version_id == first_version.pk, False),
        ([("version", "999999999999")], lambda d: False, False),  # no such version: nothing, not an error
        (
            [("status", "active"), ("label", "site=lab"), ("online", "true"), ("cohort", "eu-phones")],
            lambda d: d.status == "active" and d.labels.get("site") == "lab" and d.online,
            False,
        ),
        ([("ordering", "-name")], lambda d: True, True),
        ([("ordering", "bogus")], lambda d: True, False),  # as DRF's ordering: an unknown field is left out
    ]


def test_the_api_and_the_dashboard_list_the_same_devices_for_the_same_query(fleet, api_client_for, client_for):
    api, page = api_client_for("viewer"), client_for("viewer")
    for pairs, predicate, reverse in _device_queries(fleet):
        query = urlencode(pairs)
        expected = _expected(predicate, reverse=reverse)
        assert _api_ids(api, "devices", query) == expected, query
        assert _page_ids(page, "devices", query, "device") == expected, query
        assert pairs == [] or len(expected) < Device.objects.count() or reverse or "bogus" in query, query


@pytest.mark.parametrize(("page_says", "api_says"), [("yes", "true"), ("no", "false"), ("YES", "1")])
def test_the_dashboard_says_yes_or_no_where_the_api_says_true_or_false(
    fleet, api_client_for, client_for, page_says, api_says
):
    api = api_client_for("viewer")
    listed = _api_ids(api, "devices", f"online={api_says}&status=active")
    shown = _page_ids(client_for("viewer"), "devices", f"online={page_says}&status=active", "device")
    assert listed and listed == shown
    refused = api.get(f"/api/v1/devices/?online={page_says}")  # the API reinterprets nothing (README, "API")
    assert refused.status_code == 400 and "online" in refused.json()["error"]["details"]


@pytest.mark.parametrize(
    ("name", "value"),
    [("status", "exploded"), ("online", "maybe"), ("version", "abc"), ("search", "a\x00b"), ("q", "a\x00b")],
)
def test_a_bad_filter_value_is_a_400_on_the_api_and_a_form_error_on_the_dashboard(
    fleet, api_client_for, client_for, name, value
):
    query = urlencode({name: value})
    api = api_client_for("viewer").get(f"/api/v1/devices/?{query}")
    assert api.status_code == 400
    assert api.json()["error"]["code"] == "invalid" and name in api.json()["error"]["details"]
    page = client_for("viewer").get(f"/devices/?{query}")
    html = page.content.decode()
    assert page.status_code == 400 and "Some filters are not valid" in html and f"{name}:" in html
    assert "data-device=" not in html  # no list under filters that were refused


def test_an_empty_filter_is_any_on_the_dashboard_and_a_mistake_on_the_api(fleet, api_client_for, client_for):
    every = _expected(lambda d: True)
    blank = "q=&cohort=&status=&online=&version=&label="  # what the dashboard's Filter button sends
    assert _page_ids(client_for("viewer"), "devices", blank, "device") == every
    for name in ("status", "online", "version"):
        response = api_client_for("viewer").get(f"/api/v1/devices/?{name}=")
        assert response.status_code == 400 and name in response.json()["error"]["details"]


def test_the_dashboard_form_shows_the_filters_it_was_given(fleet, client_for):
    html = client_for("viewer").get("/devices/?status=pending&online=true&q=tab&version=none").content.decode()
    assert '<option value="pending" selected>Pending approval</option>' in html
    assert '<option value="yes" selected>online</option>' in html  # the API's true, shown as the select's yes
    assert 'name="q" value="tab"' in html and '<option value="none" selected>none yet</option>' in html
    untouched = client_for("viewer").get("/devices/").content.decode()
    assert '<option value="" selected>any status</option>' in untouched
    assert '<option value="" selected>online or not</option>' in untouched


# --- rounds and rollouts ---------------------------------------------------------------------------------------


@pytest.fixture
def training_lists(cohort, adapter, make_user):
    versions = make_versions(adapter, 2)
    admin = make_user("admin")
    other = adapter_create(name="other-lora", base_model=adapter.base_model, rank=4, alpha=8.0, actor=admin)
    other_versions = make_versions(other, 1)
    Round.objects.create(adapter=adapter, base_version=versions[0], strategy="fedavg", buffer_size=5, state="completed")
    Round.objects.create(adapter=adapter, base_version=versions[1], strategy="fedavg", buffer_size=5)
    Round.objects.create(adapter=other, base_version=other_versions[0], strategy="fedprox", buffer_size=5)
    Rollout.objects.create(version=versions[0], cohort=cohort, phases=[{"percent": 100}], state="completed")
    Rollout.objects.create(version=other_versions[0], cohort=cohort, phases=[{"percent": 100}])


@pytest.mark.parametrize(
    "query",
    [
        "",
        "state=collecting",
        "state=completed",
        "adapter=digits-lora",  # the dashboard's name
        "adapter__name=digits-lora",  # the API's
        "adapter=other-lora&state=collecting",
        "strategy=fedprox",
    ],
)
def test_the_api_and_the_dashboard_list_the_same_rounds(training_lists, api_client_for, client_for, query):
    listed = _api_ids(api_client_for("viewer"), "rounds", query)
    assert listed == _page_ids(client_for("viewer"), "rounds", query, "round")
    assert listed and (query == "" or len(listed) < Round.objects.count())


@pytest.mark.parametrize("query", ["", "state=draft", "state=completed", "version__adapter__name=other-lora"])
def test_the_api_and_the_dashboard_list_the_same_rollouts(training_lists, api_client_for, client_for, query):
    listed = _api_ids(api_client_for("viewer"), "rollouts", query)
    assert sorted(listed) == sorted(_page_ids(client_for("viewer"), "rollouts", query, "rollout"))
    assert listed and (query == "" or len(listed) < Rollout.objects.count())


@pytest.mark.parametrize("path", ["rounds", "rollouts"])
def test_a_bad_state_is_a_400_on_the_api_and_a_form_error_on_the_dashboard(
    training_lists, api_client_for, client_for, path
):
    api = api_client_for("viewer").get(f"/api/v1/{path}/?state=exploded")
    assert api.status_code == 400 and "state" in api.json()["error"]["details"]
    page = client_for("viewer").get(f"/{path}/?state=exploded")
    html = page.content.decode()
    assert page.status_code == 400 and "Some filters are not valid" in html and "state:" in html
    assert "data-round=" not in html and "data-rollout=" not in html
    assert client_for("viewer").get(f"/{path}/?state=").status_code == 200  # "any state"
