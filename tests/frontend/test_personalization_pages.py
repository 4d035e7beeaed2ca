"""The personalization parts of the pages: the device's own model against the shared one over time and what it
serves, the adapter's fleet figures (histogram, shares, serving split, per cohort) with its setting and the
operators' form to change it (each bad value refused, nothing changed), the overview's headline, and the empty
states before any device reported."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from devices.models import Cohort, PersonalizationReport
from tests.frontend.conftest import make_devices
from tests.personal_support import NOW, measure
from training.models import TrainingEvent

pytestmark = pytest.mark.django_db

FORM = {  # the defaults (PERSONALIZATION_DEFAULTS), as the page's form posts them
    "method": "ditto",
    "lambda": "0.1",
    "epochs": "50",
    "lr": "0.01",
    "margin": "0.01",
    "min_val_samples": "10",
    "private_modules": "head",
    "release_classes": "on",
    "unlabeled": "none",
    "confidence": "0.95",
}


def _measure(device, *, at: float, shared: float, personal: float, serving: str = "personal", version: int = 2):
    return measure(device, at=at, shared=shared, personal=personal, serving=serving, version=version)


@pytest.fixture
def reported(adapter, cohort):
    """Five devices in two cohorts: four gain (one by +55 points), one loses 10 points and serves shared."""
    other = Cohort.objects.create(name="us-tablets")
    phones = make_devices(cohort, 3, prefix="phone")
    tablets = make_devices(other, 2, prefix="tablet")
    for step in range(4):  # the first phone's history: four measurements, its own model pulling ahead
        _measure(phones[0], at=NOW + 60 * step, shared=0.80 + step / 100, personal=0.82 + step / 25, version=1 + step)
    _measure(phones[1], at=NOW, shared=0.90, personal=0.80, serving="shared")
    _measure(phones[2], at=NOW, shared=0.70, personal=0.75)
    _measure(tablets[0], at=NOW, shared=0.30, personal=0.85)
    _measure(tablets[1], at=NOW, shared=0.60, personal=0.62)
    return phones, tablets


def _text(response) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", response.content.decode()))


def test_the_device_page_shows_its_own_model_against_the_shared_one_over_time(client_for, reported):
    phones, _ = reported
    response = client_for("viewer").get(f"/devices/{phones[0].pk}/")
    assert response.status_code == 200
    page = response.content.decode()
    text = _text(response)
    assert "Serves its own model : own 94.0% against shared 83.0% ( +11.0 points ± 15 ) on 40 held-out samples." in text
    assert "ditto on digits-lora v4, trained on 160 samples" in text and "4 measurements kept" in text
    # Two lines, four points each, on one chart.
    assert page.count('data-series="personal"') == 1 and page.count('data-series="shared"') == 1
    assert page.count("<title>own model, ") == 4 and page.count("<title>shared version, ") == 4
    assert "<title>own model, 2025-11-25 03:06 UTC, v1: 82.0%</title>" in page
    shared_only = client_for("viewer").get(f"/devices/{phones[1].pk}/")
    assert "Serves the shared version : own 80.0% against shared 90.0% ( -10.0 points ± 16 )" in _text(shared_only)


def test_the_device_page_before_any_report_says_so(client_for, cohort):
    (device,) = make_devices(cohort, 1)
    response = client_for("viewer").get(f"/devices/{device.pk}/")
    assert response.status_code == 200
    assert 'data-testid="device-personal-empty"' in response.content.decode()
    assert "has not reported its own model yet" in _text(response)


def test_the_adapter_page_shows_the_fleet_figures_histogram_and_cohorts(client_for, adapter, reported):
    response = client_for("viewer").get(f"/adapters/{adapter.pk}/")
    assert response.status_code == 200
    page, text = response.content.decode(), _text(response)
    # Latest gains: +11, -10, +5, +55, +2 = 63 / 5 = +12.6 points.
    assert "+12.6 points mean gain of the devices' own models over the shared version on 5 devices" in text
    assert "4 of 5 (80.0%)" in text  # gain
    assert "Not worse (−0.5 points or better) 4 of 5 (80.0%)" in text
    assert "4 their own model · 1 the shared version" in text
    assert "ditto × 5" in text
    bins = dict(re.findall(r'data-bin="(\d+)" data-devices="(\d+)"', page))
    assert {int(k): int(v) for k, v in bins.items() if v != "0"} == {2: 1, 4: 1, 5: 1, 6: 1, 13: 1}
    assert "below -15 points: 0 devices" in page and "+45 points and above: 1 device" in page
    rows = dict(re.findall(r'<tr data-cohort="([^"]+)"><td>[^<]+</td><td>(\d+)</td>', page))
    assert rows == {"eu-phones": "3", "us-tablets": "2"}
    assert "+28.5" in text  # the tablets' mean gain
    # A viewer sees the setting, not the form.
    assert 'data-testid="personal-setting"' in page and 'data-testid="personalization-form"' not in page
    assert 'href="#personalization-setting">ditto</a>' in page


def test_the_adapter_page_before_any_report_shows_the_setting_and_an_empty_state(client_for, adapter):
    response = client_for("operator").get(f"/adapters/{adapter.pk}/")
    page = response.content.decode()
    assert response.status_code == 200 and 'data-testid="personal-empty"' in page
    assert 'data-testid="chart-gain-histogram"' not in page
    assert 'data-testid="personalization-form"' in page and 'value="ditto" selected' in page


ROWS = ("Lambda", "Contradicted classes", "Private modules", "Training", "Served")


@pytest.mark.parametrize(
    ("method", "shown"),
    [
        ("none", ()),
        ("finetune", ("Training", "Served")),
        ("ditto", ("Lambda", "Contradicted classes", "Training", "Served")),
        ("private_modules", ("Private modules", "Training", "Served")),
    ],
)
def test_the_setting_lists_only_what_its_method_uses(client_for, adapter, method, shown):
    """Under finetune no ditto lambda or contradicted classes; under none no setting at all (issue 50)."""
    adapter.personalization = {"method": method}
    adapter.save(update_fields=["personalization"])
    page = client_for("viewer").get(f"/adapters/{adapter.pk}/").content.decode()
    summary = page[page.index('data-testid="personal-setting"') :]
    summary = summary[: summary.index("</table>")]
    assert tuple(row for row in ROWS if f"<th>{row}</th>" in summary) == shown
    assert f"<b>{method}</b>" in summary and ("proximal" in summary) == (method == "ditto")


def test_an_operator_changes_the_setting_with_the_form_and_it_is_audited(client_for, adapter):
    operator = client_for("operator")
    response = operator.post(f"/adapters/{adapter.pk}/", {**FORM, "method": "finetune", "epochs": "8"})
    assert response.status_code == 302 and response["Location"] == f"/adapters/{adapter.pk}/"
    adapter.refresh_from_db()
    assert adapter.personalization == {"method": "finetune", "epochs": 8}  # only what differs from the defaults
    assert adapter.events.get(kind="adapter.personalization_changed").actor_label.startswith("operator-")
    page = operator.get(f"/adapters/{adapter.pk}/")
    assert "now personalizes with finetune" in _text(page) and 'value="finetune" selected' in page.content.decode()
    private = operator.post(
        f"/adapters/{adapter.pk}/", {**FORM, "method": "private_modules", "private_modules": "head, fc1"}
    )
    assert private.status_code == 302
    adapter.refresh_from_db()
    assert adapter.personalization == {"method": "private_modules", "private_modules": ["head", "fc1"]}
    unchecked = {key: value for key, value in FORM.items() if key != "release_classes"}
    assert operator.post(f"/adapters/{adapter.pk}/", unchecked).status_code == 302  # a checkbox left unticked
    adapter.refresh_from_db()
    assert adapter.personalization == {"release_classes": False}
    assert "pulled like every other class" in _text(operator.get(f"/adapters/{adapter.pk}/"))
    pseudo = operator.post(f"/adapters/{adapter.pk}/", {**FORM, "unlabeled": "pseudo_label", "confidence": "0.9"})
    assert pseudo.status_code == 302
    adapter.refresh_from_db()
    assert adapter.personalization == {"unlabeled": "pseudo_label", "confidence": 0.9}
    assert "at least 90.0% sure (pseudo-labels" in _text(operator.get(f"/adapters/{adapter.pk}/"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"method": "magic"}, "Select a valid choice"),
        ({"lambda": "0"}, "lambda must be a finite number above 0"),
        ({"lambda": "nan"}, "Enter a number"),
        ({"lambda": "inf"}, "Enter a number"),
        ({"epochs": "0"}, "greater than or equal to 1"),
        ({"epochs": "two"}, "Enter a whole number"),
        ({"lr": "-1"}, "greater than or equal to 0"),
        ({"lr": "0"}, "lr must be a finite number above 0"),
        ({"margin": "2"}, "less than or equal to 1"),
        ({"min_val_samples": "20000"}, "less than or equal to 10000"),
        ({"private_modules": "decoder"}, "not among the adapter&#x27;s target_modules or modules_to_save"),
        ({"method": "private_modules", "private_modules": ""}, "needs at least one module"),
        ({"method": ""}, "This field is required"),
        ({"unlabeled": "guess"}, "Select a valid choice"),
        ({"confidence": "1.5"}, "less than or equal to 1"),
        ({"confidence": "0"}, "greater than or equal to 0.01"),
    ],
)
def test_each_bad_form_value_is_refused_on_the_page_and_changes_nothing(client_for, adapter, change, message):
    events = TrainingEvent.objects.count()
    response = client_for("operator").post(f"/adapters/{adapter.pk}/", {**FORM, **change})
    assert response.status_code == 400
    assert message in response.content.decode()
    adapter.refresh_from_db()
    assert adapter.personalization == {} and TrainingEvent.objects.count() == events


def test_viewers_cannot_change_the_setting(client_for, adapter):
    response = client_for("viewer").post(f"/adapters/{adapter.pk}/", {**FORM, "method": "none"})
    assert response.status_code == 403
    adapter.refresh_from_db()
    assert adapter.personalization == {}


def test_the_overview_headline_counts_the_fleet_and_says_when_nobody_reported(client_for, adapter, cohort):
    empty = client_for("viewer").get("/")
    assert 'data-testid="personal-headline-empty"' in empty.content.decode()
    devices = make_devices(cohort, 11)
    for index, device in enumerate(devices):  # ten gain 10 points, one loses 2; ten serve their own model
        gain = 0.10 if index else -0.02
        _measure(device, at=NOW, shared=0.8, personal=0.8 + gain, serving="personal" if index else "shared")
    text = _text(client_for("viewer").get("/"))
    assert "Personalization: +8.9 points mean gain on 11 devices, 10 gain, 10 serve their own model." in text


def test_the_personal_parts_keep_the_pages_query_counts_flat(client_for, adapter, cohort):
    devices = make_devices(cohort, 3)
    for device in devices:
        _measure(device, at=NOW, shared=0.8, personal=0.9)

    def counts() -> tuple[int, ...]:
        result = []
        for url in ("/", f"/adapters/{adapter.pk}/", f"/devices/{devices[0].pk}/"):
            with CaptureQueriesContext(connection) as queries:
                assert client_for("viewer").get(url).status_code == 200
            result.append(len(queries))
        return tuple(result)

    counts()  # the first request also signs the client in
    before = counts()
    for step, device in enumerate(make_devices(cohort, 40, prefix="more")):
        _measure(device, at=NOW, shared=0.5, personal=0.6)
        _measure(devices[0], at=NOW + 1 + step, shared=0.8, personal=0.9)
    assert counts() == before
    assert PersonalizationReport.objects.filter(device=devices[0]).count() == 41
    assert timezone.now() - PersonalizationReport.objects.latest("received_at").received_at < timedelta(minutes=5)
