"""Every dashboard page for every role, its empty state, and its actions (allowed, refused, and their errors)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.utils import timezone

from devices.models import Cohort, Device, DeviceEvent, DeviceStatus, EnrollmentToken
from devices.services import enrollment_token_create
from tests.frontend.conftest import make_deltas, make_devices, make_versions
from training.models import Rollout, Round, TrainingEvent
from training.rollouts import rollout_create
from training.rounds import round_open

pytestmark = pytest.mark.django_db
RANK = {None: 0, "viewer": 1, "operator": 2, "admin": 3}


@dataclass
class World:
    cohort: Cohort
    adapter: object
    versions: list
    devices: list
    pending: list
    round: Round
    rollout: Rollout
    token: EnrollmentToken


@pytest.fixture
def world(cohort, adapter, make_user) -> World:
    adapter.cohorts.add(cohort)
    operator = make_user("operator")
    versions = make_versions(adapter, 3)
    devices = make_devices(cohort, 6)
    pending = make_devices(cohort, 2, status=DeviceStatus.PENDING, prefix="new")
    round_ = round_open(adapter=adapter, actor=operator, buffer_size=50)
    make_deltas(devices, adapter, versions[-1], 8, round_=round_, rejected_every=4)
    rollout = rollout_create(
        version=versions[-1],
        cohort=cohort,
        phases=[{"percent": 50, "min_soak_seconds": 60}, {"percent": 100}],
        guards=[{"metric": "eval_accuracy", "min": 0.8}],
        actor=operator,
    )
    issued = enrollment_token_create(cohort=cohort, name="line-1", expires_at=timezone.now() + timedelta(days=1))
    return World(cohort, adapter, versions, devices, pending, round_, rollout, issued.token)


def page_urls(w: World) -> dict[str, tuple[str, str]]:
    """Every page: (url, lowest role that may read it)."""
    return {
        "overview": ("/", "viewer"),
        "devices": ("/devices/", "viewer"),
        "devices-filtered": (
            f"/devices/?cohort={w.cohort.name}&status=active&online=yes&label=site=lab&q=dev",
            "viewer",
        ),
        "device-detail": (f"/devices/{w.devices[0].pk}/", "viewer"),
        "cohorts": ("/cohorts/", "viewer"),
        "enrollment-tokens": ("/enrollment-tokens/", "viewer"),
        "models": ("/models/", "viewer"),
        "adapter-detail": (f"/adapters/{w.adapter.pk}/", "viewer"),
        "rounds": ("/rounds/", "viewer"),
        "round-detail": (f"/rounds/{w.round.pk}/", "viewer"),
        "round-detail-rejected": (f"/rounds/{w.round.pk}/?state=rejected", "viewer"),
        "rollouts": ("/rollouts/", "viewer"),
        "rollout-detail": (f"/rollouts/{w.rollout.pk}/", "viewer"),
        "rollout-create": ("/rollouts/new/", "operator"),
        "system": ("/system/", "viewer"),
    }


PAGE_NAMES = [
    "overview",
    "devices",
    "devices-filtered",
    "device-detail",
    "cohorts",
    "enrollment-tokens",
    "models",
    "adapter-detail",
    "rounds",
    "round-detail",
    "round-detail-rejected",
    "rollouts",
    "rollout-detail",
    "rollout-create",
    "system",
]


@pytest.mark.parametrize("page", PAGE_NAMES)
def test_every_page_renders_for_the_roles_that_may_read_it(world, client_for, page, monkeypatch):
    monkeypatch.setattr("fleet.health.WORKER_PING_TIMEOUT", 0.1)  # the system page finds no worker: say so fast
    url, lowest = page_urls(world)[page]
    for role in (None, "viewer", "operator", "admin"):
        response = client_for(role).get(url)
        if role is None:
            assert response.status_code == 302 and response["Location"].startswith("/login/"), role
        elif RANK[role] < RANK[lowest]:
            assert response.status_code == 403, role
            assert "Not allowed" in response.content.decode()
        else:
            assert response.status_code == 200, (role, response.content.decode()[:2000])
            assert f'data-testid="role">{role}<' in response.content.decode()


def test_overview_shows_counts_rounds_rejections_versions_and_activity(world, client_for):
    DeviceEvent.objects.create(device=world.devices[0], kind="approved", actor_label="alice", detail={"to": "active"})
    html = client_for("viewer").get("/").content.decode()
    online = sum(1 for d in world.devices if d.online)
    assert f'data-testid="count-online">{online}<' in html
    assert f'data-testid="count-offline">{len(world.devices) - online}<' in html
    assert 'data-testid="count-pending">2<' in html
    assert f'data-testid="round-progress-{world.round.pk}">6 / 50<' in html  # 8 deltas, every 4th rejected
    assert "norm_too_large × 2" in html
    assert f"none × {len(world.devices) + len(world.pending)}" in html  # no device reports a running version yet
    assert "device.approved" in html and "rollout.created" in html and "round.opened" in html
    assert "<svg" in html and "Deltas per hour" in html


def test_pages_show_clear_empty_states(db, client_for):
    client = client_for("admin")
    expectations = {
        "/": ["No devices yet.", "No round is collecting", "No delta was rejected", "No device or training events"],
        "/devices/": ["No devices have enrolled yet."],
        "/cohorts/": ["No cohorts yet."],
        "/enrollment-tokens/": ["No enrollment tokens yet.", "Create a <a"],
        "/models/": ["No base model is registered.", "No adapters yet."],
        "/rounds/": ["No rounds yet.", "No adapter exists yet"],
        "/rollouts/": ["No rollouts yet."],
        "/rollouts/new/": ["There is no adapter version to roll out yet"],
    }
    for url, texts in expectations.items():
        html = client.get(url).content.decode()
        for text in texts:
            assert text in html, (url, text)


def test_filters_that_match_nothing_say_so_and_bad_filters_are_reported(world, client_for):
    client = client_for("viewer")
    assert "No device matches these filters." in client.get("/devices/?q=no-such-device").content.decode()
    response = client.get("/devices/?version=abc")
    assert response.status_code == 400 and "Some filters are not valid" in response.content.decode()
    assert client.get("/devices/?page=999").status_code == 200  # the last page, not an error
    assert (
        "No received deltas in this round." in client.get(f"/rounds/{world.round.pk}/?state=received").content.decode()
    )
    assert client.get("/devices/00000000-0000-0000-0000-000000000000/").status_code == 404
    assert client.get("/rounds/999999/").status_code == 404
    assert client.get("/rollouts/999999/").status_code == 404
    assert client.get("/adapters/999999/").status_code == 404


def test_device_filters_narrow_the_list(world, client_for):
    client = client_for("viewer")

    def names(query: str) -> set[str]:
        return set(
            re.findall(
                r'data-device="[^"]+">\s*(?:<td>.*?</td>\s*)?<td><a [^>]+>([^<]+)</a>',
                client.get("/devices/" + query).content.decode(),
                re.S,
            )
        )

    assert names("?status=pending") == {"new-00000", "new-00001"}
    assert names("?online=yes&status=active") == {d.name for d in world.devices if d.online}
    assert names("?label=site=lab&status=active") == {d.name for d in world.devices if d.labels["site"] == "lab"}
    assert names(f"?q={world.devices[3].pk}") == {world.devices[3].name}
    Device.objects.filter(pk=world.devices[1].pk).update(running_version=world.versions[0])
    assert names(f"?version={world.versions[0].pk}") == {world.devices[1].name}
    assert world.devices[1].name not in names("?version=none")


# --- devices: approval and quarantine ----------------------------------------------------------------------


def test_admin_bulk_approves_pending_devices_and_each_change_is_recorded(world, client_for):
    ids = [str(d.pk) for d in world.pending]
    response = client_for("admin").post(
        "/devices/bulk/", {"action": "approve", "device": ids, "next": "/devices/?status=pending"}
    )
    assert response.status_code == 302 and response["Location"] == "/devices/?status=pending"
    assert set(Device.objects.filter(pk__in=ids).values_list("status", flat=True)) == {"active"}
    assert DeviceEvent.objects.filter(device_id__in=ids, kind="approved").count() == 2


def test_bulk_approve_reports_devices_that_cannot_be_approved_and_approves_the_rest(world, client_for):
    client = client_for("admin")
    ids = [str(world.pending[0].pk), str(world.devices[0].pk)]
    response = client.post("/devices/bulk/", {"action": "approve", "device": ids}, follow=True)
    html = response.content.decode()
    assert "Approved 1 device" in html and "Cannot approve a device that is active" in html
    assert Device.objects.get(pk=world.pending[0].pk).status == "active"


def test_operators_may_quarantine_but_not_approve_as_in_the_api(world, client_for):
    operator = client_for("operator")
    pending = [str(d.pk) for d in world.pending]
    assert operator.post("/devices/bulk/", {"action": "approve", "device": pending}).status_code == 403
    assert set(Device.objects.filter(pk__in=pending).values_list("status", flat=True)) == {"pending"}
    response = operator.post("/devices/bulk/", {"action": "quarantine", "device": [str(world.devices[0].pk)]})
    assert response.status_code == 302
    assert Device.objects.get(pk=world.devices[0].pk).status == "quarantined"
    viewer = client_for("viewer")
    assert (
        viewer.post("/devices/bulk/", {"action": "quarantine", "device": [str(world.devices[1].pk)]}).status_code == 403
    )
    assert Device.objects.get(pk=world.devices[1].pk).status == "active"


def test_bulk_without_a_selection_or_with_bad_ids_changes_nothing(world, client_for):
    client = client_for("admin")
    html = client.post("/devices/bulk/", {"action": "approve"}, follow=True).content.decode()
    assert "Select at least one device." in html
    html = client.post("/devices/bulk/", {"action": "approve", "device": ["not-a-uuid"]}, follow=True).content.decode()
    assert "None of the selected devices exist." in html
    html = client.post(
        "/devices/bulk/", {"action": "retire", "device": [str(world.devices[0].pk)]}, follow=True
    ).content.decode()
    assert "Choose approve or quarantine." in html
    assert Device.objects.filter(status="retired").count() == 0


def test_bulk_and_device_actions_need_csrf(world, make_user):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user("admin"))
    assert client.post("/devices/bulk/", {"action": "approve", "device": [str(world.pending[0].pk)]}).status_code == 403
    assert client.post(f"/devices/{world.pending[0].pk}/action/", {"action": "approve"}).status_code == 403
    assert Device.objects.get(pk=world.pending[0].pk).status == "pending"


def test_device_detail_offers_only_the_actions_the_role_may_take(world, client_for):
    url = f"/devices/{world.pending[0].pk}/"
    assert 'value="approve"' not in client_for("viewer").get(url).content.decode()
    assert 'value="approve"' not in client_for("operator").get(url).content.decode()
    admin_html = client_for("admin").get(url).content.decode()
    assert 'value="approve"' in admin_html and 'value="reject"' in admin_html
    active_url = f"/devices/{world.devices[0].pk}/"
    operator_html = client_for("operator").get(active_url).content.decode()
    assert 'value="quarantine"' in operator_html and 'value="retire"' not in operator_html
    assert 'id="bulk-form"' in client_for("viewer").get("/devices/").content.decode()
    assert 'value="approve"' not in client_for("operator").get("/devices/").content.decode()
    assert 'value="quarantine"' not in client_for("viewer").get("/devices/").content.decode()


def test_device_detail_actions_change_status_or_explain_the_refusal(world, client_for):
    device = world.devices[0]
    operator = client_for("operator")
    assert operator.post(f"/devices/{device.pk}/action/", {"action": "approve"}).status_code == 403
    assert operator.post(f"/devices/{device.pk}/action/", {"action": "retire"}).status_code == 403
    html = operator.post(
        f"/devices/{device.pk}/action/", {"action": "quarantine", "reason": "odd deltas"}, follow=True
    ).content.decode()
    assert "is now quarantined" in html
    assert DeviceEvent.objects.filter(device=device, kind="quarantined", detail__reason="odd deltas").exists()
    html = operator.post(f"/devices/{device.pk}/action/", {"action": "quarantine"}, follow=True).content.decode()
    assert "Cannot quarantine a device that is quarantined." in html
    assert operator.post(f"/devices/{device.pk}/action/", {"action": "explode"}).status_code == 404


def test_device_detail_shows_identity_heartbeat_versions_deltas_and_events(world, client_for):
    device = world.devices[0]
    Device.objects.filter(pk=device.pk).update(running_version=world.versions[1], desired_version=world.versions[2])
    DeviceEvent.objects.create(device=device, kind="enrolled", actor_label="device", detail={"token": "fet_x"})
    html = client_for("viewer").get(f"/devices/{device.pk}/").content.decode()
    assert device.public_key in html and "arm64" in html and "2048" in html
    assert "digits-lora v2" in html and "digits-lora v3" in html and "update pending" in html
    assert "norm_too_large" in html and "verified" in html
    assert "enrolled" in html and "token=fet_x" in html


# --- cohorts and enrollment tokens ------------------------------------------------------------------------


def test_admin_creates_a_cohort_and_others_may_not(db, client_for):
    assert client_for("operator").post("/cohorts/", {"name": "us-watches"}).status_code == 403
    admin = client_for("admin")
    response = admin.post("/cohorts/", {"name": "us-watches", "description": "wearables"})
    assert response.status_code == 302 and Cohort.objects.filter(name="us-watches").exists()
    again = admin.post("/cohorts/", {"name": "us-watches"})
    assert again.status_code == 400 and "A cohort with this name exists." in again.content.decode()
    bad = admin.post("/cohorts/", {"name": "no spaces!"})
    assert bad.status_code == 400 and Cohort.objects.count() == 1
    assert 'name="name"' not in client_for("viewer").get("/cohorts/").content.decode()


def test_a_new_enrollment_token_is_shown_once_and_works(world, client_for):
    admin = client_for("admin")
    response = admin.post(
        "/enrollment-tokens/",
        {"name": "factory", "cohort": world.cohort.pk, "expires_in_hours": 2, "uses": 3, "requires_approval": "on"},
    )
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    raw = re.search(r'<code class="secret">(fet_[^<]+)</code>', response.content.decode()).group(1)
    token = EnrollmentToken.objects.get(name="factory")
    assert token.uses_left == 3 and token.requires_approval and raw.startswith(token.prefix)
    assert raw not in admin.get("/enrollment-tokens/").content.decode()  # never shown again
    from devices.services import _hash

    assert token.token_hash == _hash(raw)


def test_enrollment_tokens_are_revoked_by_admins_only(world, client_for):
    url = f"/enrollment-tokens/{world.token.pk}/revoke/"
    assert client_for("operator").post(url).status_code == 403
    assert (
        client_for("operator")
        .post("/enrollment-tokens/", {"name": "x", "cohort": world.cohort.pk, "expires_in_hours": 1})
        .status_code
        == 403
    )
    assert EnrollmentToken.objects.get(pk=world.token.pk).revoked_at is None
    html = client_for("admin").post(url, follow=True).content.decode()
    assert "no device can enroll with it any more" in html
    assert EnrollmentToken.objects.get(pk=world.token.pk).revoked_at is not None
    assert "revoked" in client_for("viewer").get("/enrollment-tokens/").content.decode()


def test_an_invalid_token_form_says_what_is_wrong(world, client_for):
    response = client_for("admin").post(
        "/enrollment-tokens/", {"name": "", "cohort": world.cohort.pk, "expires_in_hours": 0}
    )
    assert response.status_code == 400
    html = response.content.decode()
    assert "This field is required." in html and "greater than or equal to 1" in html
    assert EnrollmentToken.objects.count() == 1


# --- models and adapters ----------------------------------------------------------------------------------


def test_adapter_page_shows_lineage_with_parents_a_metrics_chart_and_export_for_operators(world, client_for):
    from training.models import AdapterVersion

    branch = AdapterVersion.objects.create(
        adapter=world.adapter, number=4, parent=world.versions[0], blob_sha256="f" * 64, size=1, source="import"
    )
    html = client_for("viewer").get(f"/adapters/{world.adapter.pk}/").content.decode()
    assert html.count('class="line"') == 2  # eval_accuracy and eval_loss
    assert html.count('class="point"') == 2 * 3  # the branch has no metrics
    assert re.search(rf'data-version="{branch.number}">.*?--depth: 1.*?↳', html, re.S)  # a fork is indented
    assert re.search(r'data-version="3">.*?--depth: 0.*?<td>v2</td>', html, re.S)  # the chain stays flat
    assert "export PEFT" not in html
    operator_html = client_for("operator").get(f"/adapters/{world.adapter.pk}/").content.decode()
    assert f"/api/v1/adapter-versions/{world.versions[0].pk}/export/" in operator_html


def test_the_export_link_serves_a_peft_zip_to_operators(adapter, client_for):
    import io
    import zipfile

    from training.services import version_create_seeded

    version = version_create_seeded(adapter=adapter, seed=1)
    response = client_for("operator").get(f"/api/v1/adapter-versions/{version.pk}/export/")
    assert response.status_code == 200
    assert set(zipfile.ZipFile(io.BytesIO(response.content)).namelist()) == {
        "adapter_model.safetensors",
        "adapter_config.json",
    }
    assert client_for("viewer").get(f"/api/v1/adapter-versions/{version.pk}/export/").status_code == 403


# --- rounds ----------------------------------------------------------------------------------------------


def test_operator_opens_a_round_and_a_second_open_is_refused_with_the_reason(adapter, cohort, client_for):
    make_versions(adapter, 1)
    operator = client_for("operator")
    assert client_for("viewer").post("/rounds/", {"adapter": adapter.pk}).status_code == 403
    response = operator.post("/rounds/", {"adapter": adapter.pk, "buffer_size": 4})
    round_ = Round.objects.get(adapter=adapter)
    assert response.status_code == 302 and response["Location"] == f"/rounds/{round_.pk}/"
    assert round_.buffer_size == 4 and round_.state == "collecting"
    html = operator.post("/rounds/", {"adapter": adapter.pk}, follow=True).content.decode()
    assert "already has a collecting round" in html and Round.objects.count() == 1


def test_closing_a_round_needs_an_operator_and_an_accepted_delta(world, client_for):
    empty = Round.objects.create(
        adapter=world.adapter, base_version=world.versions[0], strategy="fedavg", buffer_size=5, state="failed"
    )
    url = f"/rounds/{world.round.pk}/close/"
    assert client_for("viewer").post(url).status_code == 403
    html = client_for("operator").post(url, follow=True).content.decode()
    assert f"Closed round {world.round.pk}" in html
    world.round.refresh_from_db()
    assert world.round.state == "aggregating" and world.round.close_reason == "manual"
    html = client_for("operator").post(url, follow=True).content.decode()
    assert "the round is aggregating, not collecting" in html
    html = client_for("operator").post(f"/rounds/{empty.pk}/rerun/", follow=True).content.decode()
    assert f"Round {empty.pk} is aggregating again." in html
    assert TrainingEvent.objects.filter(kind="round.rerun").count() == 1


def test_closing_an_empty_round_explains_why_not(adapter, client_for, make_user):
    make_versions(adapter, 1)
    round_ = round_open(adapter=adapter, actor=make_user("operator"))
    html = client_for("operator").post(f"/rounds/{round_.pk}/close/", follow=True).content.decode()
    assert "the round has no accepted deltas yet" in html
    assert Round.objects.get(pk=round_.pk).state == "collecting"


def test_round_detail_lists_every_delta_with_its_result_and_offers_actions_by_role(world, client_for):
    html = client_for("viewer").get(f"/rounds/{world.round.pk}/").content.decode()
    assert html.count("data-delta=") == 8
    assert html.count("norm_too_large") == 2 and "update norm 1e6 is above the bound" in html
    assert 'data-testid="round-progress">6 / 50<' in html and "fedavg" in html
    assert "Close now" not in html
    assert "Close now" in client_for("operator").get(f"/rounds/{world.round.pk}/").content.decode()
    rejected = client_for("viewer").get(f"/rounds/{world.round.pk}/?state=rejected").content.decode()
    assert rejected.count("data-delta=") == 2


# --- rollouts --------------------------------------------------------------------------------------------


def test_operator_creates_a_rollout_from_the_form(world, client_for):
    response = client_for("operator").post(
        "/rollouts/new/",
        {
            "version": world.versions[1].pk,
            "cohort": world.cohort.pk,
            "phases": "20:60, 100:0",
            "guards": "eval_accuracy min 0.7 3\nlatency_ms max 50",
            "on_breach": "rollback",
            "max_failure_rate": "0.1",
        },
    )
    rollout = Rollout.objects.exclude(pk=world.rollout.pk).get()
    assert response.status_code == 302 and response["Location"] == f"/rollouts/{rollout.pk}/"
    assert rollout.phases == [{"percent": 20.0, "min_soak_seconds": 60}, {"percent": 100.0, "min_soak_seconds": 0}]
    assert rollout.guards == [
        {"metric": "eval_accuracy", "min": 0.7, "min_reports": 3},
        {"metric": "latency_ms", "max": 50.0, "min_reports": 1},
    ]
    assert rollout.on_breach == "rollback" and rollout.state == "draft"


def test_a_bad_rollout_form_says_what_is_wrong_and_creates_nothing(world, client_for):
    client = client_for("operator")
    base = {"version": world.versions[1].pk, "cohort": world.cohort.pk, "on_breach": "pause", "max_failure_rate": "0.2"}
    response = client.post("/rollouts/new/", {**base, "phases": "50:60, 20:0"})
    assert response.status_code == 400 and "percent must rise above 50" in response.content.decode()
    response = client.post("/rollouts/new/", {**base, "phases": "ten"})
    assert response.status_code == 400 and "is not percent:seconds" in response.content.decode()
    response = client.post("/rollouts/new/", {**base, "phases": "100", "guards": "accuracy above 3"})
    assert response.status_code == 400 and "metric min|max value" in response.content.decode()
    other = Cohort.objects.create(name="not-served")
    response = client.post("/rollouts/new/", {**base, "cohort": other.pk, "phases": "100"})
    assert response.status_code == 400 and "does not serve cohort not-served" in response.content.decode()
    assert Rollout.objects.count() == 1
    assert client_for("viewer").post("/rollouts/new/", {**base, "phases": "100"}).status_code == 403


def test_rollout_lifecycle_from_the_detail_page(world, client_for):
    url = f"/rollouts/{world.rollout.pk}"
    operator = client_for("operator")
    assert client_for("viewer").post(f"{url}/start/").status_code == 403
    assert 'data-action="start"' not in client_for("viewer").get(f"{url}/").content.decode()
    assert 'data-action="start"' in operator.get(f"{url}/").content.decode()
    assert "started" in operator.post(f"{url}/start/", follow=True).content.decode()
    world.rollout.refresh_from_db()
    assert world.rollout.state == "running" and world.rollout.assignments.count() > 0
    html = operator.post(f"{url}/pause/", {"reason": "checking metrics"}, follow=True).content.decode()
    assert "paused" in html and "checking metrics" in html
    assert "Cannot pause a rollout that is paused." in operator.post(f"{url}/pause/", follow=True).content.decode()
    operator.post(f"{url}/resume/")
    world.rollout.refresh_from_db()
    assert world.rollout.state == "running"
    operator.post(f"{url}/rollback/", {"reason": "bad"})
    world.rollout.refresh_from_db()
    assert world.rollout.state == "rolled_back"
    assert operator.post(f"{url}/explode/").status_code == 404


def test_rollout_detail_shows_phases_with_assignment_counts_and_guards_against_thresholds(world, client_for, make_user):
    from training.models import Assignment
    from training.rollouts import rollout_start

    rollout_start(rollout=world.rollout, actor=make_user("operator"))
    assigned = list(world.rollout.assignments.all())
    Assignment.objects.filter(pk=assigned[0].pk).update(state="installed", metrics={"eval_accuracy": 0.5})
    html = client_for("viewer").get(f"/rollouts/{world.rollout.pk}/").content.decode()
    assert re.search(r'data-phase="0">.*?current.*?1 / ' + str(len(assigned)), html, re.S)
    assert re.search(r'data-phase="1">.*?upcoming', html, re.S)
    assert re.search(r'class="breached">\s*<td>eval_accuracy</td>\s*<td>≥ 0.8', html)
    assert "0.5000 breached" in html and "failure_rate" in html


def test_the_role_matrix_hides_controls_from_viewers(world, client_for):
    viewer = client_for("viewer")
    assert "New rollout" not in viewer.get("/rollouts/").content.decode()
    assert "Open round" not in viewer.get("/rounds/").content.decode()
    assert "Create token" not in viewer.get("/enrollment-tokens/").content.decode()
    assert "Revoke" not in viewer.get("/enrollment-tokens/").content.decode()
    assert "Create cohort" not in viewer.get("/cohorts/").content.decode()
    assert "Open round" in client_for("operator").get("/rounds/").content.decode()
    assert "Create token" not in client_for("operator").get("/enrollment-tokens/").content.decode()
    assert "Create token" in client_for("admin").get("/enrollment-tokens/").content.decode()


def test_a_live_re_read_leaves_flash_messages_for_the_page_the_user_sees_next(world, client_for):
    client = client_for("operator")
    client.post(f"/devices/{world.devices[0].pk}/action/", {"action": "quarantine"})
    background = client.get(f"/devices/{world.devices[0].pk}/", headers={"X-Live-Refresh": "1"}).content.decode()
    assert "is now quarantined" not in background and 'data-testid="device-status">quarantined<' in background
    assert "is now quarantined" in client.get(f"/devices/{world.devices[0].pk}/").content.decode()
