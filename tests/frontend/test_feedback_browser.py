"""Users' feedback on the dashboard (issue 52, "Operators see it"), in a real headless Chromium against the real
ASGI server: a device's confirmed and corrected answers and correction rate for its current and previous version
(a count, not a rate, below 5 answers), and the adapter's versions with the fleet's answers pooled; screenshots go
to ``tests/artifacts/screenshots/`` (feedback-*.png)."""

from __future__ import annotations

import pytest

from devices.feedback import feedback_report_record
from tests.frontend.conftest import make_devices
from tests.frontend.test_browser import DESKTOP, PASSWORD, SCREENSHOTS, Dashboard
from training.registry.services import version_create_seeded

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _report(device, current: tuple, previous: tuple, unlabeled: int | None = None) -> None:
    names = ("version", "confirmed", "corrected")
    feedback = {
        "adapter": "digits-lora",
        "current": dict(zip(names, current, strict=True)),
        "previous": dict(zip(names, previous, strict=True)),
        "feedback_samples": sum(current[1:]) + sum(previous[1:]),
        "samples": 300,
        "unlabeled_samples": unlabeled,
    }
    assert feedback_report_record(device_id=device.pk, feedback=feedback)


@pytest.fixture
def fleet(transactional_db, cohort, adapter, make_user):
    """Three devices on v2 after v1: one whose users correct v2 far more often, one with 3 answers, one silent."""
    make_user("viewer", username="ui-viewer", password=PASSWORD)
    adapter.cohorts.add(cohort)
    version_create_seeded(adapter=adapter, seed=1)
    version_create_seeded(adapter=adapter, seed=2)
    devices = make_devices(cohort, 3, prefix="phone")
    _report(devices[0], (2, 2, 8), (1, 18, 2), unlabeled=1250)
    _report(devices[1], (2, 1, 2), (1, 9, 1))
    return devices


def test_the_device_and_adapter_pages_show_the_answers_users_corrected_with_screenshots(
    browser,  # noqa: F811
    server_url,  # noqa: F811
    fleet,
    adapter,
):
    ui = Dashboard(browser, server_url, "viewer", viewport=DESKTOP)
    ui.visit(f"/devices/{fleet[0].pk}/")
    section = ui.page.locator("[data-testid=device-feedback]")
    assert section.locator("[data-testid=device-feedback-current-rate]").inner_text() == "80.0% corrected"
    shown = section.locator("[data-testid=device-feedback-current]").inner_text()
    assert "of 10 answers: 2 confirmed, 8 corrected" in shown
    assert section.locator("[data-testid=device-feedback-previous-rate]").inner_text() == "10.0% corrected"
    text = section.inner_text()
    assert "before it, v1" in text.lower()
    samples = section.locator("[data-testid=device-feedback-samples]").inner_text()
    assert samples == "300 labelled (30 from feedback), 1250 unlabeled"
    ui.screenshot("feedback-device-desktop")

    ui.visit(f"/devices/{fleet[1].pk}/")
    current = ui.page.locator("[data-testid=device-feedback-current]").inner_text()
    assert current == "3 answers, too few for a rate (1 confirmed, 2 corrected)"
    samples = ui.page.locator("[data-testid=device-feedback-samples]").inner_text()
    assert samples == "300 labelled (13 from feedback), unlabeled not reported"  # an agent before unlabeled samples
    ui.visit(f"/devices/{fleet[2].pk}/")
    assert ui.page.locator("[data-testid=device-feedback-empty]").is_visible()

    ui.visit(f"/adapters/{adapter.pk}/")
    newer = ui.page.locator("[data-testid=corrections-2]").inner_text()
    assert newer.startswith("76.9% corrected") and "of 13 answers: 3 confirmed, 10 corrected" in newer
    assert "from 2 devices" in newer
    older = ui.page.locator("[data-testid=corrections-1]").inner_text()
    assert older.startswith("10.0% corrected") and "of 30 answers" in older
    ui.screenshot("feedback-adapter-desktop")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    ui.page.locator("#versions").screenshot(path=str(SCREENSHOTS / "feedback-versions-desktop.png"))
    ui.close()
