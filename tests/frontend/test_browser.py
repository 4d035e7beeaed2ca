"""The dashboard in a real headless Chromium against the real ASGI server (uvicorn) and the Redis channel layer.

One uvicorn process serves the whole module from the test database; each test commits its rows
(``transactional_db``) so the server sees them. Screenshots of every page at desktop and phone width go to
``tests/artifacts/screenshots/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.utils import timezone

from tests.conftest import ROOT
from tests.frontend.conftest import off_loop

SCREENSHOTS = ROOT / "tests" / "artifacts" / "screenshots"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
PASSWORD = "correct-horse-battery-9"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@dataclass
class World:
    cohort: object
    adapter: object
    versions: list
    devices: list
    pending: object
    round: object
    rollout: object


@pytest.fixture
def world(transactional_db, cohort, adapter, make_user):
    from devices.models import DeviceEvent, DeviceStatus
    from devices.services import enrollment_token_create
    from tests.frontend.conftest import make_deltas, make_devices
    from training.federation.rounds import round_open
    from training.registry.services import version_create_seeded
    from training.rollouts.lifecycle import rollout_create

    for role in ("viewer", "operator", "admin"):
        make_user(role, username=f"ui-{role}", password=PASSWORD)
    adapter.cohorts.add(cohort)
    versions = [version_create_seeded(adapter=adapter, seed=1), version_create_seeded(adapter=adapter, seed=2)]
    devices = make_devices(cohort, 12, running_version=versions[0])
    (pending,) = make_devices(cohort, 1, status=DeviceStatus.PENDING, prefix="waiting")
    DeviceEvent.objects.create(device=pending, kind="enrolled", actor_label="device", detail={"status": "pending"})
    round_ = off_loop(round_open, adapter=adapter, actor=None, buffer_size=40)
    make_deltas(devices, adapter, versions[-1], 9, round_=round_, rejected_every=3)
    rollout = rollout_create(
        version=versions[1],
        cohort=cohort,
        phases=[{"percent": 50, "min_soak_seconds": 600}, {"percent": 100, "min_soak_seconds": 0}],
        guards=[{"metric": "eval_accuracy", "min": 0.8}],
        actor=None,
    )
    enrollment_token_create(cohort=cohort, name="line-1", expires_at=timezone.now() + timedelta(days=1))
    return World(cohort, adapter, versions, devices, pending, round_, rollout)


class Dashboard:
    """One signed-in browser context; fails the test on any page error or console error."""

    def __init__(self, browser, base_url: str, role: str, viewport=DESKTOP):
        self.base_url = base_url
        self.context = browser.new_context(viewport=viewport, base_url=base_url)
        self.page = self.context.new_page()
        self.page.set_default_timeout(10_000)
        self.errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))
        self.page.on("console", lambda msg: msg.type == "error" and self.errors.append(f"console: {msg.text}"))
        self.page.on("dialog", lambda dialog: dialog.accept())  # confirmations are answered yes
        self.page.goto("/login/")
        self.page.fill("input[name=username]", f"ui-{role}")
        self.page.fill("input[name=password]", PASSWORD)
        self.page.click("button[type=submit]")
        self.page.wait_for_url(base_url + "/")
        assert self.page.inner_text("[data-testid=role]") == role
        self.wait_live()

    def wait_live(self) -> None:
        self.page.wait_for_selector("#live-status.on")

    def visit(self, path: str) -> None:
        response = self.page.goto(path)
        assert response.status == 200, (path, response.status)
        self.page.wait_for_load_state("domcontentloaded")

    def screenshot(self, name: str) -> None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)

    def close(self) -> None:
        self.context.close()
        assert not self.errors, self.errors


def _pages(w: World) -> dict[str, str]:
    return {
        "overview": "/",
        "devices": "/devices/",
        "device-detail": f"/devices/{w.devices[0].pk}/",
        "cohorts": "/cohorts/",
        "enrollment-tokens": "/enrollment-tokens/",
        "models": "/models/",
        "adapter-detail": f"/adapters/{w.adapter.pk}/",
        "rounds": "/rounds/",
        "round-detail": f"/rounds/{w.round.pk}/",
        "rollouts": "/rollouts/",
        "rollout-detail": f"/rollouts/{w.rollout.pk}/",
        "rollout-create": "/rollouts/new/",
    }


def test_each_role_walks_every_page_with_screenshots_at_desktop_and_phone_width(browser, server_url, world):
    for role in ("viewer", "operator", "admin"):
        ui = Dashboard(browser, server_url, role)
        for name, path in _pages(world).items():
            if name == "rollout-create" and role == "viewer":
                assert ui.page.goto(path).status == 403
                assert "Not allowed" in ui.page.inner_text("h1")
                ui.errors.clear()  # the browser logs the expected 403 as a console error
                continue
            ui.visit(path)
            assert ui.page.locator("h1").first.is_visible()
            if role == "viewer":
                assert ui.page.locator("button[data-action=approve], button[value=approve]").count() == 0
                assert ui.page.locator("text=New rollout").count() == 0
            if role == "admin":
                ui.screenshot(f"{name}-desktop")
        ui.close()
    phone = Dashboard(browser, server_url, "admin", viewport=PHONE)
    for name, path in _pages(world).items():
        phone.visit(path)
        width = phone.page.evaluate("document.documentElement.scrollWidth")
        assert width <= PHONE["width"] + 1, f"{name} scrolls sideways at phone width ({width}px)"
        nav = phone.page.evaluate(NAV_GEOMETRY)
        assert nav["overflow"] <= 0, f"{name}: the navigation scrolls sideways ({nav['overflow']}px hidden)"
        left, right, top, bottom = nav["current"]
        assert left >= 0 and right <= PHONE["width"] and top >= 0 and bottom <= PHONE["height"], (name, nav)
        phone.screenshot(f"{name}-phone")
    phone.close()


# The main navigation: how far it would scroll sideways, and where the current page's link is on screen.
NAV_GEOMETRY = """() => {
  const nav = document.querySelector("nav[aria-label=main]");
  const box = nav.querySelector("[aria-current=page]").getBoundingClientRect();
  return {overflow: nav.scrollWidth - nav.clientWidth, current: [box.left, box.right, box.top, box.bottom]};
}"""

# A checkbox and its label: their boxes on screen.
CHECKBOX_GEOMETRY = """(name) => {
  const box = document.querySelector(`input[type=checkbox][name="${name}"]`);
  const rect = (element) => element.getBoundingClientRect().toJSON();
  return {box: rect(box), label: rect(document.querySelector(`label[for="${box.id}"]`))};
}"""


def test_a_form_checkbox_sits_right_before_its_label_on_one_line_at_desktop_and_phone_width(browser, server_url, world):
    for viewport in (DESKTOP, PHONE):
        ui = Dashboard(browser, server_url, "admin", viewport=viewport)
        ui.visit("/enrollment-tokens/")
        geometry = ui.page.evaluate(CHECKBOX_GEOMETRY, "requires_approval")
        box, label = geometry["box"], geometry["label"]
        assert 0 <= label["left"] - box["right"] <= 12, geometry  # beside it, not floated apart
        middle = (box["top"] + box["bottom"]) / 2
        assert label["top"] <= middle <= label["bottom"], geometry  # on the label's line
        assert ui.page.inner_text("label[for=id_requires_approval]") == "Requires approval"
        ui.page.click("label[for=id_requires_approval]")  # the label toggles its box
        assert not ui.page.is_checked("input[name=requires_approval]")
        ui.close()


def test_admin_approves_a_device_and_creates_an_enrollment_token_shown_once(browser, server_url, world):
    from devices.models import Device, EnrollmentToken

    ui = Dashboard(browser, server_url, "admin")
    ui.visit("/devices/?status=pending")
    ui.page.check(f'input[name=device][value="{world.pending.pk}"]')
    ui.page.click("button[value=approve]")
    ui.page.wait_for_selector(".flash.success")
    assert "Approved 1 device: waiting-00000" in ui.page.inner_text(".flash.success")
    assert Device.objects.get(pk=world.pending.pk).status == "active"

    ui.visit("/enrollment-tokens/")
    ui.page.fill("input[name=name]", "factory line 2")
    ui.page.fill("input[name=uses]", "10")
    ui.page.click("text=Create token")
    secret = ui.page.inner_text("[data-testid=issued-token] code.secret")
    assert re.fullmatch(r"fet_[\w-]{40,}", secret)
    assert EnrollmentToken.objects.filter(name="factory line 2", uses_left=10).exists()
    ui.visit("/enrollment-tokens/")
    assert secret not in ui.page.content()  # shown once
    ui.close()


def test_operator_starts_and_pauses_a_rollout_and_closes_a_round(browser, server_url, world):
    from training.models import Rollout, Round

    ui = Dashboard(browser, server_url, "operator")
    ui.visit(f"/rollouts/{world.rollout.pk}/")
    ui.page.click("button[data-action=start]")
    ui.page.wait_for_selector("[data-testid=rollout-state]:has-text('running')")
    assert Rollout.objects.get(pk=world.rollout.pk).state == "running"
    ui.page.fill("form:has(button[data-action=pause]) input[name=reason]", "watching accuracy")
    ui.page.click("button[data-action=pause]")
    ui.page.wait_for_selector("[data-testid=rollout-state]:has-text('paused')")
    rollout = Rollout.objects.get(pk=world.rollout.pk)
    assert rollout.state == "paused" and rollout.state_reason == "watching accuracy"

    ui.visit(f"/rounds/{world.round.pk}/")
    assert ui.page.inner_text("[data-testid=round-progress]") == "6 / 40"
    ui.page.click("button[data-action=close]")
    # Closed: aggregating, or already past it when a Celery worker of this test session picked the round up.
    ui.page.wait_for_selector("[data-testid=round-state]:text-matches('^(aggregating|completed|failed)$')")
    assert Round.objects.get(pk=world.round.pk).close_reason == "manual"
    assert ui.page.locator("button[data-action=close]").count() == 0
    ui.close()


def test_live_events_update_the_page_without_a_reload_and_a_resync_rereads_it(browser, server_url, world):
    from core.live import LiveEvent, publish
    from devices.models import Device
    from tests.frontend.conftest import make_deltas

    ui = Dashboard(browser, server_url, "viewer")
    page = ui.page
    page.evaluate("window.__sameDocument = true")
    before = int(page.inner_text("[data-testid=count-online]"))

    device = world.devices[1]
    Device.objects.filter(pk=device.pk).update(online=not device.online)
    off_loop(publish, LiveEvent(kind="device.online", data={"device": str(device.pk), "name": device.name}))
    expected = before + (1 if not device.online else -1)
    page.wait_for_selector(f"[data-testid=count-online]:text-is('{expected}')")
    line = page.inner_text("#activity li[data-kind='device.online']")  # in words, at a UTC time
    assert re.fullmatch(rf"\d\d:\d\d:\d\d UTC {device.name} came online", line), line
    assert page.get_attribute("#activity li[data-kind='device.online'] a", "href") == f"/devices/{device.pk}/"
    ui.screenshot("overview-live-feed-desktop")

    # A delta verified in the round: its page shows the new progress with no reload.
    ui.visit(f"/rounds/{world.round.pk}/")
    ui.wait_live()  # a new page opens a new socket: events published before it is up are not for it
    page.evaluate("window.__sameDocument = true")
    (delta,) = make_deltas(world.devices, world.adapter, world.versions[-1], 1, round_=world.round)
    off_loop(
        publish, LiveEvent(kind="delta.verified", data={"id": delta.pk, "round": world.round.pk, "state": "accepted"})
    )
    page.wait_for_selector("[data-testid=round-progress]:text-is('7 / 40')")
    page.wait_for_selector(f"tr[data-delta='{delta.pk}']")
    assert page.evaluate("window.__sameDocument") is True

    # After a reconnect the page re-reads itself, so a change whose event was dropped still shows.
    make_deltas(world.devices, world.adapter, world.versions[-1], 1, round_=world.round)
    page.evaluate("document.dispatchEvent(new CustomEvent('fleet:resync'))")
    page.wait_for_selector("[data-testid=round-progress]:text-is('8 / 40')")
    assert page.evaluate("window.__sameDocument") is True
    ui.close()
