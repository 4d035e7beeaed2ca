"""The personalization reads of the API: a device's history (newest first, paged) and an adapter's fleet figures
(from each device's latest report: accuracies, gain, who gains and who is not worse, what they serve, a
histogram of the gain, per cohort), checked on a known set of reports and for every role."""

from __future__ import annotations

import pytest

from devices.models import Cohort, Device, DeviceStatus, gain_interval_points
from devices.selectors import Latest, summarize
from tests.frontend.conftest import make_devices
from tests.personal_support import NOW
from tests.personal_support import measure as _report

pytestmark = pytest.mark.django_db

# device: (cohort, shared, personal, serving, method); gains +12, 0, -0.4, -30, +55, +5 points
KNOWN = {
    "d1": ("eu-phones", 0.81, 0.93, "personal", "ditto"),
    "d2": ("eu-phones", 0.90, 0.90, "shared", "ditto"),
    "d3": ("eu-phones", 0.85, 0.846, "shared", "ditto"),
    "d4": ("eu-phones", 0.90, 0.60, "shared", "ditto"),
    "d5": ("us-tablets", 0.30, 0.85, "personal", "ditto"),
    "d6": ("us-tablets", 0.70, 0.75, "personal", "finetune"),
}


@pytest.fixture
def known_fleet(adapter, cohort):
    other = Cohort.objects.create(name="us-tablets")
    devices = {}
    for name, (cohort_name, shared, personal, serving, method) in KNOWN.items():
        (device,) = make_devices(cohort if cohort_name == "eu-phones" else other, 1, prefix=name)
        # An older measurement first: only the newest counts for the fleet's figures.
        _report(device, at=NOW - 600, shared=0.1, personal=0.9, version=2)
        _report(device, at=NOW, shared=shared, personal=personal, serving=serving, method=method, version=2)
        devices[name] = device
    (retired,) = make_devices(cohort, 1, prefix="gone", status=DeviceStatus.RETIRED)
    _report(retired, at=NOW, shared=0.9, personal=0.1)
    _report(devices["d1"], at=NOW + 5, shared=0.5, personal=0.1, adapter="other-lora")  # another adapter's
    return devices


def test_the_fleet_figures_of_a_known_set_of_reports(adapter, known_fleet, api_client_for):
    response = api_client_for("viewer").get(f"/api/v1/adapters/{adapter.pk}/personalization/")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["adapter"] == adapter.name and body["personalization"]["method"] == "ditto"
    fleet = body["fleet"]
    assert fleet["devices"] == 6
    assert fleet["mean_shared_accuracy"] == pytest.approx(4.46 / 6, abs=1e-6)
    assert fleet["mean_personal_accuracy"] == pytest.approx(4.876 / 6, abs=1e-6)
    assert fleet["mean_gain_points"] == pytest.approx(41.6 / 6, abs=1e-6)
    assert (fleet["devices_gaining"], fleet["share_gaining"]) == (3, 0.5)
    assert fleet["devices_not_worse"] == 5 and fleet["share_not_worse"] == pytest.approx(5 / 6, abs=1e-6)
    assert fleet["serving"] == {"personal": 3, "shared": 3}
    assert fleet["methods"] == {"ditto": 5, "finetune": 1}
    bins = {(row["low"], row["high"]): row["devices"] for row in fleet["histogram"]}
    assert list(bins)[0] == (-20, -15) and list(bins)[-1] == (45, 50) and len(bins) == 14
    # -30 is clamped into the first bin and +55 into the last; 0 opens [0, 5), -0.4 closes [-5, 0).
    assert {edges: n for edges, n in bins.items() if n} == {
        (-20, -15): 1,
        (-5, 0): 1,
        (0, 5): 1,
        (5, 10): 1,
        (10, 15): 1,
        (45, 50): 1,
    }
    cohorts = {row["cohort"]: row for row in body["cohorts"]}
    assert list(cohorts) == ["eu-phones", "us-tablets"]
    assert cohorts["eu-phones"]["devices"] == 4 and cohorts["eu-phones"]["mean_gain_points"] == pytest.approx(-4.6)
    assert cohorts["eu-phones"]["devices_not_worse"] == 3 and cohorts["eu-phones"]["devices_gaining"] == 1
    assert cohorts["us-tablets"]["mean_gain_points"] == pytest.approx(30.0)
    assert cohorts["us-tablets"]["serving"] == {"personal": 2, "shared": 0}


def test_an_adapter_no_device_reported_on_has_empty_figures(adapter, api_client_for):
    body = api_client_for("viewer").get(f"/api/v1/adapters/{adapter.pk}/personalization/").json()
    assert body["cohorts"] == []
    fleet = body["fleet"]
    assert fleet["devices"] == 0 and fleet["mean_gain_points"] is None and fleet["share_gaining"] is None
    assert fleet["serving"] == {"personal": 0, "shared": 0} and sum(b["devices"] for b in fleet["histogram"]) == 0


def test_summaries_count_a_gain_of_exactly_minus_half_a_point_as_not_worse():
    figures = summarize([Latest("c", "ditto", "shared", 0.8, 0.795), Latest("c", "ditto", "shared", 0.8, 0.7949)])
    assert figures["devices_not_worse"] == 1 and figures["devices_gaining"] == 0


def test_a_gain_on_a_few_held_samples_carries_a_wide_interval_and_the_fleet_weighs_it_by_them():
    """Three held samples, all right with the own model and none with the shared one, is a +100-point gain that
    says little (±47 points); the fleet's weighted mean leans on the device that holds 97 samples."""
    few = Latest("c", "ditto", "personal", 0.0, 1.0, val_samples=3)
    many = Latest("c", "ditto", "shared", 0.8, 0.8, val_samples=97)
    assert 45 < few.interval_points < 80 and many.interval_points < 17
    assert gain_interval_points(0.5, 0.5, 0) is None
    figures = summarize([few, many])
    assert figures["mean_gain_points"] == 50.0  # the plain mean: what a 3-sample device does to it
    assert figures["weighted_gain_points"] == 3.0 and figures["held_samples"] == 100
    assert figures["devices_judged"] == 1 and 0 < figures["weighted_gain_interval_points"] < 20


def test_the_adapter_figures_need_a_signed_in_caller_and_an_existing_adapter(adapter, api_client_for):
    url = f"/api/v1/adapters/{adapter.pk}/personalization/"
    assert api_client_for(None).get(url).status_code == 401
    for role in ("viewer", "operator", "admin"):
        assert api_client_for(role).get(url).status_code == 200
    missing = api_client_for("viewer").get("/api/v1/adapters/999999/personalization/")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert api_client_for("admin").post(url, {}, format="json").status_code == 405


def test_a_devices_history_is_newest_first_paged_and_for_viewers(known_fleet, api_client_for):
    device = known_fleet["d1"]
    url = f"/api/v1/devices/{device.pk}/personalization/"
    assert api_client_for(None).get(url).status_code == 401
    viewer = api_client_for("viewer")
    body = viewer.get(url).json()
    assert body["count"] == 3
    assert [(row["adapter"], row["shared_accuracy"]) for row in body["results"]] == [
        ("other-lora", 0.5),
        ("digits-lora", 0.81),
        ("digits-lora", 0.1),
    ]
    row = body["results"][1]
    assert row["gain_points"] == pytest.approx(12.0) and row["serving"] == "personal" and row["version"] == 2
    assert {"method", "val_samples", "trained_samples", "measured_at", "received_at"} <= set(row)
    page = viewer.get(url + "?page_size=2&page=2").json()
    assert page["count"] == 3 and [r["shared_accuracy"] for r in page["results"]] == [0.1]
    bad = viewer.get(url + "?page_size=two")
    assert bad.status_code == 400 and bad.json()["error"]["details"]["page_size"]
    assert viewer.get(url + "?page=9").status_code == 404
    missing = viewer.get("/api/v1/devices/6a1c1c52-8f1e-4a43-9d7b-3c2f50a1e001/personalization/")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert viewer.post(url, {}, format="json").status_code == 403  # no writes here, whoever asks
    assert api_client_for("admin").post(url, {}, format="json").status_code == 405
    assert Device.objects.filter(pk=device.pk).exists()
