"""The adapter page in a real headless Chromium (issue 50, "Adapter page"): under ``finetune`` the personalization
summary lists only the settings finetune uses (no ditto lambda, no contradicted classes, no private modules); the
settings forms sit near the top, reached from the page's own section links, above the long tables (the version
lineage shows its newest rows and a "show all" link), at desktop and phone width, and each form still saves.
Screenshots go to ``tests/artifacts/screenshots/`` (adapter-page-*.png)."""

from __future__ import annotations

import pytest

from tests.frontend.conftest import make_versions
from tests.frontend.test_browser import DESKTOP, PASSWORD, PHONE, Dashboard

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

VERSIONS = 30

# Where an element starts, from the top of the page (not of the viewport), and the viewport's scroll position.
TOP_OF = """(selector) => {
  const box = document.querySelector(selector).getBoundingClientRect();
  return {top: box.top + window.scrollY, viewportTop: box.top, scrollY: window.scrollY};
}"""


@pytest.fixture
def finetuned(transactional_db, cohort, adapter, make_user):
    """The adapter personalizing with finetune, with a long history (30 versions), serving one cohort."""
    for role in ("viewer", "operator", "admin"):
        make_user(role, username=f"ui-{role}", password=PASSWORD)
    adapter.cohorts.add(cohort)
    adapter.personalization = {"method": "finetune", "epochs": 8}
    adapter.save(update_fields=["personalization"])
    make_versions(adapter, VERSIONS)
    return adapter


def _unused(ui: Dashboard) -> list[str]:
    """The personalization form's fields greyed out as unused by the chosen method (each says so)."""
    fields = ui.page.locator("[data-testid=personalization-form] .field.unused")
    assert all("Not used by" in note for note in fields.locator(".unused-note").all_inner_texts())
    assert fields.locator(".unused-note").count() == fields.count()
    return [field.get_attribute("data-setting") for field in fields.all()]


def _summary(ui: Dashboard) -> str:
    return ui.page.inner_text("[data-testid=personal-setting]")


def test_the_finetune_summary_shows_only_its_settings_and_the_settings_are_near_the_top(
    browser,  # noqa: F811
    server_url,  # noqa: F811
    finetuned,
):
    adapter = finetuned
    for viewport, label in ((DESKTOP, "desktop"), (PHONE, "phone")):
        ui = Dashboard(browser, server_url, "admin", viewport=viewport)
        ui.visit(f"/adapters/{adapter.pk}/")
        summary = _summary(ui)
        assert "finetune" in summary and "up to 8 epochs" in summary
        for ditto_only in ("Lambda", "proximal", "Contradicted classes", "Private modules"):
            assert ditto_only not in summary, f"{label}: finetune's summary lists {ditto_only!r}: {summary}"

        # The form keeps every setting, the ones finetune does not use greyed out; choosing ditto brings lambda back.
        form = ui.page.locator("[data-testid=personalization-form]")
        assert _unused(ui) == ["lambda", "release_classes", "private_modules"], label
        form.locator("select[name=method]").select_option("ditto")
        assert _unused(ui) == ["private_modules"], label
        form.locator("select[name=method]").select_option("finetune")

        # The page's own section links sit under its title; "Settings" brings the forms into view.
        links = ui.page.locator("nav[aria-label='On this page']")
        assert links.locator("a").all_inner_texts()[:2] == ["Summary", "Settings"]
        assert ui.page.evaluate(TOP_OF, "nav[aria-label='On this page']")["top"] < 250
        assert ui.page.evaluate("document.documentElement.scrollWidth") <= viewport["width"] + 1, label
        # Above the settings: the adapter's configuration and release state, not its history.
        settings_top = ui.page.evaluate(TOP_OF, "#settings")["top"]
        assert settings_top < 1.5 * viewport["height"], f"{label}: the settings start {settings_top}px down"
        for form in ("release-form", "personalization-form", "adapter-cohorts-form"):
            top = ui.page.evaluate(TOP_OF, f"[data-testid={form}]")["top"]
            assert top > settings_top, f"{label}: {form} is not in the settings section"
            assert top < ui.page.evaluate(TOP_OF, "#versions")["top"], f"{label}: {form} sits below the versions"
        links.locator("a", has_text="Settings").click()
        ui.page.wait_for_function("location.hash === '#settings'")
        ui.page.wait_for_function("Math.abs(document.querySelector('#settings').getBoundingClientRect().top) < 5")

        # The lineage shows its newest versions; "show all" the whole history, and keeps it while the page re-reads.
        rows = ui.page.locator("table.lineage tbody tr")
        assert 0 < rows.count() < VERSIONS
        assert rows.first.get_attribute("data-version") == str(VERSIONS)
        ui.page.evaluate("window.scrollTo(0, 0)")
        ui.screenshot(f"adapter-page-{label}")
        ui.page.locator("a", has_text=f"Show all {VERSIONS} versions").click()
        ui.page.wait_for_function(f"document.querySelectorAll('table.lineage tbody tr').length === {VERSIONS}")
        # It lands on the versions: the browser scrolls to the fragment once the new page is laid out, which can
        # be after its rows are in the document (CI saw 3,750 px when this read it at once).
        ui.page.wait_for_function("Math.abs(document.querySelector('#versions').getBoundingClientRect().top) < 5")
        ui.close()


def test_each_settings_form_still_saves_from_the_settings_section(
    browser,  # noqa: F811
    server_url,  # noqa: F811
    finetuned,
):
    adapter = finetuned
    ui = Dashboard(browser, server_url, "admin", viewport=PHONE)
    ui.visit(f"/adapters/{adapter.pk}/#settings")
    release = ui.page.locator("[data-testid=release-form]")
    release.locator("input[name=margin_points]").fill("2.5")
    release.locator("button[type=submit]").click()
    ui.page.wait_for_selector(".flash.success")
    assert "release margin 2.5 points" in ui.page.inner_text(".flash.success")
    adapter.refresh_from_db()
    assert adapter.aggregation["release_margin"] == 0.025

    personal = ui.page.locator("[data-testid=personalization-form]")
    personal.locator("select[name=method]").select_option("none")
    personal.locator("button[type=submit]").click()
    ui.page.wait_for_selector(".flash.success")
    adapter.refresh_from_db()
    assert adapter.personalization["method"] == "none"
    summary = _summary(ui)
    assert "none" in summary and "devices serve the shared version" in summary
    assert len(_unused(ui)) == 9  # every setting but the method
    for setting in ("Lambda", "Training", "Served", "Private modules", "Contradicted classes", "Unlabeled samples"):
        assert setting not in summary, f"'none' lists {setting!r}: {summary}"

    cohorts = ui.page.locator("[data-testid=adapter-cohorts-form]")
    cohorts.locator("input[type=checkbox]").first.uncheck()
    cohorts.locator("button[type=submit]").click()
    ui.page.wait_for_selector(".flash.success")
    assert adapter.cohorts.count() == 0
    ui.close()
