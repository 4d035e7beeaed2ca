"""The dashboard's layout at phone width (390 px) and on the desktop (1280 px) in a real headless Chromium
(issue 50): no card overflows sideways (a table wider than its card scrolls inside itself, with a cue under it),
the rollout's progress bars stay in their cells, chart axis text is at least 10 px on screen, and the protocol
reference wraps its identifiers whole. Screenshots go to ``tests/artifacts/screenshots/`` (layout-*.png)."""

from __future__ import annotations

import pytest

from devices.models import Device
from tests.frontend.conftest import off_loop
from tests.frontend.test_browser import (  # noqa: F401  (world: a fixture)
    DESKTOP,
    PHONE,
    Dashboard,
    world,
)
from tests.personal_support import NOW, measure
from training.models import Assignment
from training.rollouts.lifecycle import rollout_start

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

# Every card on the page: whether it overflows sideways, and if so whether each overflowing table in it is
# its own scroll container with the cue under it. Plus the page's own sideways scroll.
CARD_GEOMETRY = """() => {
  const page = {scrollWidth: document.scrollingElement.scrollWidth, innerWidth: window.innerWidth};
  const cards = [...document.querySelectorAll(".card")].map((card, index) => {
    const tables = [...card.querySelectorAll("table")].filter((t) => t.scrollWidth > t.clientWidth + 1).map((t) => {
      const cue = t.nextElementSibling;
      return {
        scrolls: ["auto", "scroll"].includes(getComputedStyle(t).overflowX) && t.clientWidth <= card.clientWidth,
        cue: !!cue && cue.classList.contains("scroll-cue") && cue.getBoundingClientRect().height > 0,
      };
    });
    return {index, id: card.id, scrollWidth: card.scrollWidth, clientWidth: card.clientWidth, tables};
  });
  return {page, cards};
}"""

# Each visible axis label of each chart: its font size on screen (its CSS size times the SVG's scale).
AXIS_TEXT = """() => [...document.querySelectorAll(".chart svg text.tick")]
  .filter((t) => getComputedStyle(t).display !== "none")
  .map((t) => parseFloat(getComputedStyle(t).fontSize) * t.ownerSVGElement.getScreenCTM().a)"""

# Each progress bar: whether it stays inside its table cell.
PROGRESS_INSIDE = """() => [...document.querySelectorAll("td progress")].map((bar) => {
  const cell = bar.closest("td").getBoundingClientRect(), box = bar.getBoundingClientRect();
  return box.left >= cell.left - 0.5 && box.right <= cell.right + 0.5;
})"""


# Each identifier matching the selector: its text and on how many lines it is drawn.
CODE_LINES = """(selector) => [...document.querySelectorAll(selector)].map((code) => {
  const range = document.createRange(); range.selectNodeContents(code);
  const tops = new Set([...range.getClientRects()].map((rect) => Math.round(rect.top)));
  return [code.textContent, tops.size];
})"""


def _assert_whole_words(lines) -> None:
    """On one line, or one more line per underscore at most: wrapped at underscores, never letter by letter."""
    for text, count in lines:
        assert count <= 1 + text.count("_"), (text, count)


def _pages(w) -> dict[str, str]:
    return {
        "overview": "/",
        "devices": "/devices/",
        "device-detail": f"/devices/{w.devices[0].pk}/",
        "rounds": "/rounds/",
        "round-detail": f"/rounds/{w.round.pk}/",
        "rollout-detail": f"/rollouts/{w.rollout.pk}/",
        "adapter-detail": f"/adapters/{w.adapter.pk}/",
        "protocol": "/api/docs/protocol/",
    }


def _assert_cards_fit(ui: Dashboard, name: str) -> None:
    geometry = ui.page.evaluate(CARD_GEOMETRY)
    page = geometry["page"]
    assert page["scrollWidth"] <= page["innerWidth"], f"{name}: the page scrolls sideways ({page})"
    for card in geometry["cards"]:
        if card["scrollWidth"] <= card["clientWidth"]:
            continue  # fits
        assert card["tables"], f"{name}: card {card['index']} #{card['id']} overflows, and not by a table: {card}"
        assert all(t["scrolls"] and t["cue"] for t in card["tables"]), f"{name}: a table spills with no cue: {card}"


@pytest.fixture
def layout_world(world):  # noqa: F811

    for step in range(4):  # the device page's chart: measurements minutes apart, all on one day
        off_loop(measure, world.devices[0], at=NOW + 120 * step, shared=0.7 + step / 50, personal=0.8, version=1)
    off_loop(rollout_start, rollout=world.rollout, actor=None)
    Assignment.objects.filter(rollout=world.rollout).update(state="installed", metrics={"personal_gain": 0.304})
    return world


def test_no_card_overflows_at_phone_width_and_charts_read_at_10px_with_screenshots(
    browser,  # noqa: F811
    server_url,  # noqa: F811
    layout_world,
):
    for viewport, label in ((PHONE, "phone"), (DESKTOP, "desktop")):
        ui = Dashboard(browser, server_url, "admin", viewport=viewport)
        for name, path in _pages(layout_world).items():
            ui.visit(path)
            ui.page.wait_for_timeout(50)  # app.js marks the tables that scroll on DOMContentLoaded
            _assert_cards_fit(ui, f"{name} at {label}")
            assert all(ui.page.evaluate(PROGRESS_INSIDE)), f"{name} at {label}: a progress bar spills out"
            sizes = ui.page.evaluate(AXIS_TEXT)
            assert all(size >= 10 for size in sizes), f"{name} at {label}: axis text at {sorted(sizes)[:3]} px"
            if name in ("overview", "device-detail"):
                assert sizes, f"{name}: no chart drawn"
            _assert_whole_words(ui.page.evaluate(CODE_LINES, "code.ident"))  # norm_too_large, not norm_too_l/arge
            ui.screenshot(f"layout-{name}-{label}")
        ui.close()


def test_the_devices_list_at_phone_width_shows_a_cue_when_its_columns_run_past_the_card(
    browser,  # noqa: F811
    server_url,  # noqa: F811
    layout_world,
):

    # One unbroken word: a name with hyphens wraps at them, and then overflowed the card or not by a few pixels as
    # the other columns' texts ("last seen") came out on a loaded host.
    Device.objects.filter(pk=layout_world.devices[0].pk).update(name="adevicewitharatherlongname" + "x" * 37)
    ui = Dashboard(browser, server_url, "admin", viewport=PHONE)
    ui.visit("/devices/")
    ui.page.wait_for_timeout(50)
    _assert_cards_fit(ui, "devices")
    table = ui.page.locator("table.list.devices")
    assert table.evaluate("t => t.scrollWidth > t.clientWidth + 1")  # a 63-letter name is wider than a phone
    assert ui.page.locator("table.list.devices + p.scroll-cue").is_visible()
    ui.screenshot("layout-devices-long-name-phone")
    # A live re-read with nothing new leaves the table alone: the cue stays, and so does where it was scrolled.
    table.evaluate("t => { t.scrollLeft = 60; }")
    before = ui.page.evaluate("document.body.dataset.liveRefreshed || ''")
    ui.page.evaluate("document.dispatchEvent(new CustomEvent('fleet:resync'))")
    ui.page.wait_for_function("(before) => (document.body.dataset.liveRefreshed || '') !== before", arg=before)
    assert table.evaluate("t => t.scrollLeft") == 60
    assert ui.page.locator("table.list.devices + p.scroll-cue").is_visible()
    ui.close()


def test_the_rounds_list_at_phone_width_stacks_each_round_with_its_state_result_and_opening_in_view(
    browser,  # noqa: F811
    server_url,  # noqa: F811
    world,  # noqa: F811
):
    ui = Dashboard(browser, server_url, "viewer", viewport=PHONE)
    ui.visit("/rounds/")
    table = ui.page.locator("#round-list table.list")
    assert table.evaluate("t => t.scrollWidth <= t.clientWidth")  # no sideways scroll at all
    row = f"tr[data-round='{world.round.pk}']"
    for label in ("State", "Result", "Opened", "Rejected meanwhile"):
        cell = ui.page.locator(f"{row} td[data-label='{label}']")
        box = cell.bounding_box()
        assert cell.is_visible() and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"], (label, box)
    _assert_cards_fit(ui, "rounds")
    ui.screenshot("layout-rounds-stacked-phone")
    ui.close()


def test_the_protocol_page_wraps_identifiers_whole_at_phone_width(
    browser,  # noqa: F811
    server_url,  # noqa: F811
    world,  # noqa: F811
):
    ui = Dashboard(browser, server_url, "viewer", viewport=PHONE)
    ui.visit("/api/docs/protocol/")
    assert ui.page.locator("nav[aria-label=main]").is_visible()  # the dashboard's page, its navigation
    lines = ui.page.evaluate(CODE_LINES, "td[data-label=field] code")
    assert lines
    _assert_whole_words(lines)
    _assert_cards_fit(ui, "protocol")
    ui.screenshot("layout-protocol-phone-viewer")
    ui.close()
