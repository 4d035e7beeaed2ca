"""Changing the cohorts an adapter serves after it was made: ``PUT /api/v1/adapters/<id>/cohorts/`` and the form
on the adapter's page. Admins only (cohorts are fleet settings); every refusal changes nothing and says why;
each change leaves an ``adapter.cohorts_changed`` event."""

from __future__ import annotations

import pytest
from django.test import Client

from devices.services import cohort_create
from tests.frontend.conftest import make_versions
from training.models import TrainingEvent
from training.rollouts.lifecycle import rollout_create, rollout_pause, rollout_start

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/{}/cohorts/"


@pytest.fixture
def client_for(make_user):
    """``client_for("admin")``: a browser-like client signed in with that role."""

    def make(role: str) -> Client:
        client = Client()
        client.force_login(make_user(role))
        return client

    return make


def _served(adapter) -> list[str]:
    return sorted(adapter.cohorts.values_list("name", flat=True))


def _events() -> list[dict]:
    events = TrainingEvent.objects.filter(kind="adapter.cohorts_changed").order_by("created_at", "id")
    return list(events.values_list("detail", flat=True))


def test_an_admin_replaces_the_cohorts_and_the_change_is_recorded(adapter, cohort, api_client_for):
    cohort_create(name="us-tablets")
    adapter.cohorts.add(cohort)
    admin = api_client_for("admin")
    response = admin.put(URL.format(adapter.pk), {"cohorts": ["us-tablets"]}, format="json")
    assert response.status_code == 200, response.content
    assert response.json() == {"adapter": "digits-lora", "cohorts": ["us-tablets"]}
    assert _served(adapter) == ["us-tablets"]
    assert _events() == [{"cohorts": ["us-tablets"], "added": ["us-tablets"], "removed": ["eu-phones"]}]
    event = TrainingEvent.objects.get(kind="adapter.cohorts_changed")
    assert event.adapter_id == adapter.pk and event.actor_label.startswith("admin")
    assert api_client_for("viewer").get(URL.format(adapter.pk)).json()["cohorts"] == ["us-tablets"]
    # The adapter's own representation says the same.
    assert admin.get(f"/api/v1/adapters/{adapter.pk}/").json()["cohorts"] == ["us-tablets"]
    # Asking for what it already serves changes nothing and records nothing.
    assert admin.put(URL.format(adapter.pk), {"cohorts": ["us-tablets"]}, format="json").status_code == 200
    assert len(_events()) == 1
    assert admin.put(URL.format(adapter.pk), {"cohorts": []}, format="json").json()["cohorts"] == []
    assert _events()[-1] == {"cohorts": [], "added": [], "removed": ["us-tablets"]}


@pytest.mark.parametrize(
    ("body", "field_error"),
    [
        ({"cohorts": ["eu-phones", "no-such-cohort"]}, "There is no cohort named no-such-cohort."),
        ({"cohorts": ["eu-phones", "eu-phones"]}, "eu-phones is listed more than once"),
        ({"cohorts": "eu-phones"}, "Expected"),
        ({"cohorts": [3]}, "Expected"),
        ({}, "required"),
    ],
)
def test_a_bad_cohort_list_is_a_400_naming_the_problem_and_changes_nothing(
    adapter, cohort, api_client_for, body, field_error
):
    response = api_client_for("admin").put(URL.format(adapter.pk), body, format="json")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert field_error in " ".join(error["details"]["cohorts"]), error
    assert _served(adapter) == [] and _events() == []


def test_only_admins_change_cohorts_viewers_and_operators_read_them(adapter, cohort, api_client_for):
    for role in ("viewer", "operator"):
        response = api_client_for(role).put(URL.format(adapter.pk), {"cohorts": ["eu-phones"]}, format="json")
        assert response.status_code == 403 and response.json()["error"]["code"] == "permission_denied"
        assert api_client_for(role).get(URL.format(adapter.pk)).status_code == 200
    assert api_client_for(None).get(URL.format(adapter.pk)).status_code == 401
    assert _served(adapter) == [] and _events() == []
    missing = api_client_for("admin").put(URL.format(999999), {"cohorts": ["eu-phones"]}, format="json")
    assert missing.status_code == 404


def test_a_cohort_with_a_running_or_paused_rollout_cannot_be_dropped(adapter, cohort, api_client_for, make_user):
    other = cohort_create(name="us-tablets")
    adapter.cohorts.add(cohort, other)
    (version,) = make_versions(adapter, 1)
    operator = make_user("operator")
    rollout = rollout_start(
        rollout=rollout_create(version=version, cohort=cohort, phases=[{"percent": 100}], actor=operator),
        actor=operator,
    )
    admin = api_client_for("admin")
    for state in ("running", "paused"):
        if state == "paused":
            rollout = rollout_pause(rollout=rollout, actor=operator, reason="checking")
        response = admin.put(URL.format(adapter.pk), {"cohorts": ["us-tablets"]}, format="json")
        assert response.status_code == 409, response.content
        error = response.json()["error"]
        assert error["code"] == "cohort_in_use"
        assert f"rollout {rollout.pk} of digits-lora is {state} in cohort eu-phones" in error["message"]
        assert _served(adapter) == ["eu-phones", "us-tablets"] and _events() == []
    # Dropping the other cohort is fine.
    assert admin.put(URL.format(adapter.pk), {"cohorts": ["eu-phones"]}, format="json").status_code == 200
    assert _served(adapter) == ["eu-phones"]


# --- the adapter page --------------------------------------------------------------------------------------


def test_the_adapter_page_offers_admins_a_cohort_form_that_changes_them(adapter, cohort, client_for):
    other = cohort_create(name="us-tablets")
    adapter.cohorts.add(cohort)
    page = f"/adapters/{adapter.pk}/"
    html = client_for("admin").get(page).content.decode()
    assert 'data-testid="adapter-cohorts-form"' in html
    assert f'value="{cohort.pk}"' in html and f'value="{other.pk}"' in html
    ticked = html.split('data-testid="adapter-cohorts-form"')[1].split("</form>")[0]
    assert ticked.count("checked") == 1 and f'value="{cohort.pk}" id="id_cohorts_0" checked' in ticked
    for role in ("viewer", "operator"):
        assert 'data-testid="adapter-cohorts-form"' not in client_for(role).get(page).content.decode()

    response = client_for("admin").post(f"/adapters/{adapter.pk}/cohorts/", {"cohorts": [other.pk]}, follow=True)
    assert response.redirect_chain[-1][0] == page
    assert "digits-lora now serves us-tablets." in response.content.decode()
    assert _served(adapter) == ["us-tablets"]
    assert _events() == [{"cohorts": ["us-tablets"], "added": ["us-tablets"], "removed": ["eu-phones"]}]


def test_the_cohort_form_refuses_other_roles_and_bad_choices_and_changes_nothing(adapter, cohort, client_for):
    url = f"/adapters/{adapter.pk}/cohorts/"
    for role in ("viewer", "operator"):
        assert client_for(role).post(url, {"cohorts": [cohort.pk]}).status_code == 403
    assert client_for("admin").get(url).status_code == 405
    html = client_for("admin").post(url, {"cohorts": [cohort.pk, 999999]}, follow=True).content.decode()
    assert "There is no cohort 999999 (deleted meanwhile?): nothing was changed." in html
    html = client_for("admin").post(url, {"cohorts": ["eu"]}, follow=True).content.decode()
    assert "“eu” is not a cohort: nothing was changed." in html
    assert _served(adapter) == [] and _events() == []
    assert client_for("admin").post("/adapters/999999/cohorts/", {}).status_code == 404
