"""The personalization parts of the dashboard in a real headless Chromium against the real ASGI server: the
adapter's fleet figures and the operator's form, a device's own model over time (updated live when it reports a
new measurement), the overview's headline; screenshots at desktop and phone width go to
``tests/artifacts/screenshots/`` (personalization-*.png)."""

from __future__ import annotations

import pytest

from devices.models import Cohort
from tests.frontend.conftest import make_devices, off_loop
from tests.frontend.test_browser import CHECKBOX_GEOMETRY, DESKTOP, PASSWORD, PHONE, SCREENSHOTS, Dashboard
from tests.personal_support import NOW, measure

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _measure(device, *, at: float, shared: float, personal: float, serving: str = "personal", version: int = 1, **more):
    return off_loop(measure, device, at=at, shared=shared, personal=personal, serving=serving, version=version, **more)


@pytest.fixture
def fleet(transactional_db, cohort, adapter, make_user):
    """Twelve devices in two cohorts reporting their own models (eleven gain), the first with a history."""
    for role in ("viewer", "operator", "admin"):
        make_user(role, username=f"ui-{role}", password=PASSWORD)
    adapter.cohorts.add(cohort)
    other = Cohort.objects.create(name="us-tablets")
    devices = make_devices(cohort, 8, prefix="phone") + make_devices(other, 4, prefix="tablet")
    for step in range(6):
        _measure(devices[0], at=NOW + 600 * step, shared=0.78 + step / 100, personal=0.80 + step / 30, version=step + 1)
    for index, device in enumerate(devices[1:], start=1):
        gain = -0.04 if index == 5 else 0.02 * index
        serving = "shared" if gain < 0 else "personal"
        _measure(device, at=NOW, shared=0.75, personal=min(1.0, 0.75 + gain), serving=serving)
    return devices


def _no_sideways_scroll(ui: Dashboard, name: str) -> None:
    width = ui.page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"] + 1, f"{name} scrolls sideways at phone width ({width}px)"


def test_an_operator_reads_the_fleet_figures_and_changes_the_method_with_screenshots(
    browser,  # noqa: F811
    server_url,  # noqa: F811
    fleet,
    adapter,
):
    ui = Dashboard(browser, server_url, "operator", viewport=DESKTOP)
    ui.visit("/")
    headline = ui.page.inner_text("[data-testid=personal-headline-digits-lora]")
    assert "mean gain on 12 devices, 11 gain, 11 serve their own model" in headline
    ui.screenshot("personalization-overview-desktop")

    ui.visit(f"/adapters/{adapter.pk}/")
    assert "on 12 devices" in ui.page.inner_text("[data-testid=personal-headline]")
    assert ui.page.inner_text("[data-testid=personal-gaining]") == "11 of 12 (91.7%)"
    assert ui.page.locator("[data-testid=chart-gain-histogram] rect.bar").count() >= 3
    assert ui.page.locator("[data-testid=personal-cohorts] tbody tr").count() == 2
    ui.screenshot("personalization-adapter-desktop")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    ui.page.locator("#personalization").screenshot(path=str(SCREENSHOTS / "personalization-section-desktop.png"))

    form = ui.page.locator("[data-testid=personalization-form]")
    assert form.locator("input[name=release_classes]").is_checked()  # the default, shown as it is
    geometry = ui.page.evaluate(CHECKBOX_GEOMETRY, "release_classes")
    assert 0 <= geometry["label"]["left"] - geometry["box"]["right"] <= 12, geometry  # the box beside its label
    form.locator("select[name=method]").select_option("finetune")
    form.locator("input[name=epochs]").fill("8")
    form.locator("input[name=lambda]").fill("0")  # refused first: the page says why and keeps what was typed
    form.locator("button[type=submit]").click()
    ui.page.wait_for_selector("#personalization-setting .flash.error")
    ui.errors.clear()  # the browser logs the 400 as a console error
    assert "lambda must be a finite number above 0" in ui.page.inner_text("#personalization-setting .flash.error")
    assert form.locator("input[name=epochs]").input_value() == "8"
    adapter.refresh_from_db()
    assert adapter.personalization == {}
    form.locator("input[name=lambda]").fill("0.1")
    form.locator("button[type=submit]").click()
    ui.page.wait_for_selector(".flash.success")
    assert "now personalizes with finetune" in ui.page.inner_text(".flash.success")
    assert "finetune" in ui.page.inner_text("[data-testid=personal-setting]")
    adapter.refresh_from_db()
    assert adapter.personalization == {"method": "finetune", "epochs": 8}
    ui.close()

    phone = Dashboard(browser, server_url, "viewer", viewport=PHONE)
    for name, path in (("overview", "/"), ("adapter", f"/adapters/{adapter.pk}/")):
        phone.visit(path)
        _no_sideways_scroll(phone, name)
        phone.screenshot(f"personalization-{name}-phone")
    assert phone.page.locator("[data-testid=personalization-form]").count() == 0  # viewers read only
    phone.close()


def test_the_device_page_shows_its_own_model_over_time_and_updates_live(
    browser,  # noqa: F811
    server_url,  # noqa: F811
    fleet,
):
    device = fleet[0]
    ui = Dashboard(browser, server_url, "viewer", viewport=DESKTOP)
    ui.visit(f"/devices/{device.pk}/")
    ui.wait_live()
    assert "Serves its own model" in ui.page.inner_text("[data-testid=device-serving]")
    assert ui.page.inner_text("[data-testid=device-gain]") == "+13.7 points"
    chart = ui.page.locator("[data-testid=chart-own-model-against-the-shared-version-accuracy]")
    assert chart.locator("path[data-series=personal]").count() == 1
    assert chart.locator("path[data-series=shared]").count() == 1
    assert chart.locator("circle").count() == 12
    ui.screenshot("personalization-device-desktop")

    # A new measurement arrives: the page shows it without a reload.
    ui.page.evaluate("window.__sameDocument = true")
    _measure(device, at=NOW + 7200, shared=0.90, personal=0.85, serving="shared", version=7)
    ui.page.wait_for_selector("[data-testid=device-gain]:text-is('-5.0 points')")
    assert "Serves the shared version" in ui.page.inner_text("[data-testid=device-serving]")
    assert chart.locator("circle").count() == 14
    # Its own model measures lower on a slice that cannot tell the two apart: the page says why it keeps it.
    counts = {"shared_only_right": 3, "personal_only_right": 1}
    _measure(device, at=NOW + 7300, shared=0.90, personal=0.85, serving="personal", version=7, **counts)
    ui.page.wait_for_selector("[data-testid=device-paired]")
    paired = ui.page.inner_text("[data-testid=device-paired]")
    assert "only the shared version gets right: 3; only its own model: 1" in paired
    assert "Too few to say beyond chance" in paired
    assert ui.page.evaluate("window.__sameDocument") is True
    ui.close()

    phone = Dashboard(browser, server_url, "viewer", viewport=PHONE)
    phone.visit(f"/devices/{device.pk}/")
    _no_sideways_scroll(phone, "device")
    phone.screenshot("personalization-device-phone")
    phone.visit(f"/devices/{fleet[1].pk}/")
    assert "Serves its own model" in phone.page.inner_text("[data-testid=device-serving]")
    phone.close()
