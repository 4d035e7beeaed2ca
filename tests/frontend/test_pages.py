"""Every dashboard page for every role and its empty state, and the fleet pages' actions (devices, cohorts,
enrollment tokens: allowed, refused, and their errors); the training pages' actions are in
test_training_pages.py, the ``pages_world`` both use in conftest.py."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from devices.models import Cohort, Device, DeviceEvent, EnrollmentToken
from devices.services import _hash
from devices.uploads import upload_refused
from tests.frontend.conftest import World, make_deltas, make_versions
from training.models import Assignment, Delta, TrainingEvent

pytestmark = pytest.mark.django_db
RANK = {None: 0, "viewer": 1, "operator": 2, "admin": 3}


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
def test_every_page_renders_for_the_roles_that_may_read_it(pages_world, client_for, page, monkeypatch):
    monkeypatch.setattr("core.health.WORKER_PING_TIMEOUT", 0.1)  # the system page finds no worker: say so fast
    url, lowest = page_urls(pages_world)[page]
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


def test_the_adapters_parent_url_leads_to_the_models_page_for_those_who_may_read_it(client_for):
    """``/adapters/`` (an adapter page's URL without its id) is the models page, where adapters are listed."""
    assert client_for(None).get("/adapters/")["Location"].startswith("/login/")
    response = client_for("viewer").get("/adapters/", follow=True)
    assert response.redirect_chain == [("/models/", 302)]
    assert response.status_code == 200 and "<h2>Adapters</h2>" in response.content.decode()


def test_overview_shows_counts_rounds_rejections_versions_and_activity(pages_world, client_for):
    DeviceEvent.objects.create(
        device=pages_world.devices[0], kind="approved", actor_label="alice", detail={"to": "active"}
    )
    html = client_for("viewer").get("/").content.decode()
    online = sum(1 for d in pages_world.devices if d.online)
    assert f'data-testid="count-online">{online}<' in html
    assert f'data-testid="count-offline">{len(pages_world.devices) - online}<' in html
    assert 'data-testid="count-pending">2<' in html
    assert f'data-testid="round-progress-{pages_world.round.pk}">6 / 50<' in html  # 8 deltas, every 4th rejected
    assert "norm_too_large × 2" in html
    assert (
        f"none × {len(pages_world.devices) + len(pages_world.pending)}" in html
    )  # no device reports a running version yet
    assert "<svg" in html and "Deltas per hour" in html


def test_overview_shows_the_shared_versions_accuracy_per_adapter(pages_world, client_for):
    html = client_for("viewer").get("/").content.decode()
    card = html.split('id="shared-accuracy"', 1)[1].split("</section>", 1)[0]
    name = pages_world.adapter.name
    newest = pages_world.versions[-1]  # make_versions: v3 released, eval_accuracy 0.5 + 3/12
    assert f"<td>v{newest.number}</td>" in card
    assert f'data-testid="shared-accuracy-{name}">75.0%<' in card


def test_overview_chart_spans_only_the_hours_with_deltas(pages_world, client_for):
    html = client_for("viewer").get("/").content.decode()
    chart = html.split('id="deltas-chart"', 1)[1].split("</figure>", 1)[0]
    bars = chart.count("<g><title>")
    assert 1 <= bars <= 2, bars  # pages_world's deltas came in the last few minutes: an hour or two, not 24
    assert "last 24 h" not in chart and re.search(r"Deltas per hour, \d\d:00", chart)
    Delta.objects.update(received_at=timezone.now() - timedelta(hours=30))
    assert "No deltas in the last 24 hours." in client_for("viewer").get("/").content.decode()


def test_overview_groups_rejected_deltas_by_device_and_code_with_a_count(pages_world, client_for):
    device = pages_world.devices[0]
    make_deltas([device], pages_world.adapter, pages_world.versions[-1], 10, rejected_every=1)
    html = client_for("viewer").get("/").content.decode()
    card = html.split('id="rejected"', 1)[1].split("</table>", 1)[0]
    assert card.count(f'href="/devices/{device.pk}/"') == 1  # one row, not ten
    row = card.split(f'href="/devices/{device.pk}/"', 1)[1].split("</tr>", 1)[0]
    assert "norm_<wbr>too_<wbr>large" in row and re.search(
        r'data-testid="rejected-count">1[12]<', row
    )  # + pages_world's


def test_overview_activity_renders_event_details_as_readable_pairs(pages_world, client_for):
    TrainingEvent.objects.create(
        kind="adapter.aggregation_changed", adapter=pages_world.adapter,
        detail={"aggregation": {"strategy": "trimmed_mean", "trim_fraction": 0.2}, "previous": {"strategy": "fedavg"}},
    )  # fmt: skip
    html = client_for("viewer").get("/").content.decode()
    activity = html.split('id="recent-activity"')[1].split("</ul>")[0]
    assert (
        "aggregation changed: " in activity
        and "aggregation: (strategy: trimmed_mean; trim fraction: 20.0%)" in activity
    )
    assert "{" not in activity


def test_overview_activity_reads_as_sentences_with_names_and_utc_times(pages_world, client_for):
    device, adapter, rollout = pages_world.devices[0], pages_world.adapter, pages_world.rollout
    DeviceEvent.objects.create(device=device, kind="approved", actor_label="alice", detail={"to": "active"})
    html = client_for("viewer").get("/").content.decode()
    activity = html.split('id="recent-activity"')[1].split("</ul>")[0]
    assert f'<a href="/devices/{device.pk}/">{device.name} approved</a>' in activity
    assert f"round {pages_world.round.pk} of {adapter.name} opened on v{pages_world.versions[-1].number}" in activity
    assert f"rollout {rollout.pk} of {adapter.name} v{rollout.version.number} created" in activity
    times = re.findall(r"<time [^>]*>([^<]+)</time>", activity)
    assert times and all(re.fullmatch(r"\d\d:\d\d:\d\d UTC", t) for t in times), times
    assert str(device.pk) not in re.sub(r'href="[^"]*"', "", activity)  # names, never ids, in the text


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


def test_filters_that_match_nothing_say_so_and_bad_filters_are_reported(pages_world, client_for):
    client = client_for("viewer")
    assert "No device matches these filters." in client.get("/devices/?q=no-such-device").content.decode()
    response = client.get("/devices/?version=abc")
    assert response.status_code == 400 and "Some filters are not valid" in response.content.decode()
    assert client.get("/devices/?page=999").status_code == 200  # the last page, not an error
    assert (
        "No received deltas in this round."
        in client.get(f"/rounds/{pages_world.round.pk}/?state=received").content.decode()
    )
    assert client.get("/devices/00000000-0000-0000-0000-000000000000/").status_code == 404
    assert client.get("/rounds/999999/").status_code == 404
    assert client.get("/rollouts/999999/").status_code == 404
    assert client.get("/adapters/999999/").status_code == 404


def test_device_filters_narrow_the_list(pages_world, client_for):
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
    assert names("?online=yes&status=active") == {d.name for d in pages_world.devices if d.online}
    assert names("?label=site=lab&status=active") == {d.name for d in pages_world.devices if d.labels["site"] == "lab"}
    assert names(f"?q={pages_world.devices[3].pk}") == {pages_world.devices[3].name}
    Device.objects.filter(pk=pages_world.devices[1].pk).update(running_version=pages_world.versions[0])
    assert names(f"?version={pages_world.versions[0].pk}") == {pages_world.devices[1].name}
    assert pages_world.devices[1].name not in names("?version=none")


# --- devices: approval and quarantine ----------------------------------------------------------------------


def test_admin_bulk_approves_pending_devices_and_each_change_is_recorded(pages_world, client_for):
    ids = [str(d.pk) for d in pages_world.pending]
    response = client_for("admin").post(
        "/devices/bulk/", {"action": "approve", "device": ids, "next": "/devices/?status=pending"}
    )
    assert response.status_code == 302 and response["Location"] == "/devices/?status=pending"
    assert set(Device.objects.filter(pk__in=ids).values_list("status", flat=True)) == {"active"}
    assert DeviceEvent.objects.filter(device_id__in=ids, kind="approved").count() == 2


def test_bulk_approve_reports_devices_that_cannot_be_approved_and_approves_the_rest(pages_world, client_for):
    client = client_for("admin")
    ids = [str(pages_world.pending[0].pk), str(pages_world.devices[0].pk)]
    response = client.post("/devices/bulk/", {"action": "approve", "device": ids}, follow=True)
    html = response.content.decode()
    assert "Approved 1 device" in html and "Cannot approve a device that is active" in html
    assert Device.objects.get(pk=pages_world.pending[0].pk).status == "active"


def test_operators_may_quarantine_but_not_approve_as_in_the_api(pages_world, client_for):
    operator = client_for("operator")
    pending = [str(d.pk) for d in pages_world.pending]
    assert operator.post("/devices/bulk/", {"action": "approve", "device": pending}).status_code == 403
    assert set(Device.objects.filter(pk__in=pending).values_list("status", flat=True)) == {"pending"}
    response = operator.post("/devices/bulk/", {"action": "quarantine", "device": [str(pages_world.devices[0].pk)]})
    assert response.status_code == 302
    assert Device.objects.get(pk=pages_world.devices[0].pk).status == "quarantined"
    viewer = client_for("viewer")
    assert (
        viewer.post("/devices/bulk/", {"action": "quarantine", "device": [str(pages_world.devices[1].pk)]}).status_code
        == 403
    )
    assert Device.objects.get(pk=pages_world.devices[1].pk).status == "active"


def test_bulk_without_a_selection_or_with_bad_ids_changes_nothing(pages_world, client_for):
    client = client_for("admin")
    html = client.post("/devices/bulk/", {"action": "approve"}, follow=True).content.decode()
    assert "Select at least one device." in html
    html = client.post("/devices/bulk/", {"action": "approve", "device": ["not-a-uuid"]}, follow=True).content.decode()
    assert "None of the selected devices exist." in html
    html = client.post(
        "/devices/bulk/", {"action": "retire", "device": [str(pages_world.devices[0].pk)]}, follow=True
    ).content.decode()
    assert "Choose approve or quarantine." in html
    assert Device.objects.filter(status="retired").count() == 0


def test_bulk_and_device_actions_need_csrf(pages_world, make_user):

    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user("admin"))
    assert (
        client.post("/devices/bulk/", {"action": "approve", "device": [str(pages_world.pending[0].pk)]}).status_code
        == 403
    )
    assert client.post(f"/devices/{pages_world.pending[0].pk}/action/", {"action": "approve"}).status_code == 403
    assert Device.objects.get(pk=pages_world.pending[0].pk).status == "pending"


def test_device_detail_offers_only_the_actions_the_role_may_take(pages_world, client_for):
    url = f"/devices/{pages_world.pending[0].pk}/"
    assert 'value="approve"' not in client_for("viewer").get(url).content.decode()
    assert 'value="approve"' not in client_for("operator").get(url).content.decode()
    admin_html = client_for("admin").get(url).content.decode()
    assert 'value="approve"' in admin_html and 'value="reject"' in admin_html
    active_url = f"/devices/{pages_world.devices[0].pk}/"
    operator_html = client_for("operator").get(active_url).content.decode()
    assert 'value="quarantine"' in operator_html and 'value="retire"' not in operator_html
    assert 'id="bulk-form"' in client_for("viewer").get("/devices/").content.decode()
    assert 'value="approve"' not in client_for("operator").get("/devices/").content.decode()
    assert 'value="quarantine"' not in client_for("viewer").get("/devices/").content.decode()


def test_device_detail_actions_change_status_or_explain_the_refusal(pages_world, client_for):
    device = pages_world.devices[0]
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


def test_device_detail_shows_identity_heartbeat_versions_deltas_and_events(pages_world, client_for):
    device = pages_world.devices[0]
    Device.objects.filter(pk=device.pk).update(
        running_version=pages_world.versions[1], desired_version=pages_world.versions[2]
    )
    DeviceEvent.objects.create(device=device, kind="enrolled", actor_label="device", detail={"token": "fet_x"})
    html = client_for("viewer").get(f"/devices/{device.pk}/").content.decode()
    assert device.public_key in html and "arm64" in html and "2048" in html
    assert "digits-lora v2" in html and "digits-lora v3" in html and "update pending" in html
    assert "norm_too_large" in html and "verified" in html
    assert f"{device.name} enrolled with token fet_x…" in html


def test_the_device_page_counts_its_rejected_deltas_beside_the_uploads_refused_at_start(pages_world, client_for):
    device = pages_world.devices[1]  # pages_world gave it one accepted delta and no rejected one
    html = client_for("viewer").get(f"/devices/{device.pk}/").content.decode()
    assert 'data-testid="deltas-rejected">none<' in html and 'data-testid="uploads-refused">none<' in html
    make_deltas([device], pages_world.adapter, pages_world.versions[-1], 7, rejected_every=1)
    html = client_for("viewer").get(f"/devices/{device.pk}/").content.decode()
    assert (
        'data-testid="deltas-rejected"><span class="bad">7</span> <span class="chip">norm_too_large × 7</span>' in html
    )
    assert "Rejected deltas</th>" in html and "Uploads refused at start</th>" in html  # two figures, two labels
    assert 'data-testid="uploads-refused">none<' in html


def test_the_device_page_shows_the_newest_assignments_and_links_to_the_rest(pages_world, client_for, make_user):

    device = pages_world.devices[0]
    versions = make_versions(pages_world.adapter, 8)
    Assignment.objects.bulk_create(
        Assignment(device=device, version=v, seq=seq, state="superseded") for seq, v in enumerate(versions, 1)
    )
    client = client_for("viewer")
    html = client.get(f"/devices/{device.pk}/").content.decode()
    shown = html.split('id="assignments"', 1)[1].split("</table>", 1)[0]
    assert shown.count("<tr><td>") == 5 and "newest 5 of 8" in shown and 'href="?assignments=all#assignments"' in shown
    every = client.get(f"/devices/{device.pk}/?assignments=all").content.decode()
    assert every.split('id="assignments"', 1)[1].split("</table>", 1)[0].count("<tr><td>") == 8


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


def test_a_new_enrollment_token_is_shown_once_and_works(pages_world, client_for):
    admin = client_for("admin")
    response = admin.post(
        "/enrollment-tokens/",
        {
            "name": "factory",
            "cohort": pages_world.cohort.pk,
            "expires_in_hours": 2,
            "uses": 3,
            "requires_approval": "on",
        },
    )
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    raw = re.search(r'<code class="secret">(fet_[^<]+)</code>', response.content.decode()).group(1)
    token = EnrollmentToken.objects.get(name="factory")
    assert token.uses_left == 3 and token.requires_approval and raw.startswith(token.prefix)
    assert raw not in admin.get("/enrollment-tokens/").content.decode()  # never shown again

    assert token.token_hash == _hash(raw)


def test_enrollment_tokens_are_revoked_by_admins_only(pages_world, client_for):
    url = f"/enrollment-tokens/{pages_world.token.pk}/revoke/"
    assert client_for("operator").post(url).status_code == 403
    assert (
        client_for("operator")
        .post("/enrollment-tokens/", {"name": "x", "cohort": pages_world.cohort.pk, "expires_in_hours": 1})
        .status_code
        == 403
    )
    assert EnrollmentToken.objects.get(pk=pages_world.token.pk).revoked_at is None
    html = client_for("admin").post(url, follow=True).content.decode()
    assert "no device can enroll with it any more" in html
    assert EnrollmentToken.objects.get(pk=pages_world.token.pk).revoked_at is not None
    assert "revoked" in client_for("viewer").get("/enrollment-tokens/").content.decode()


def test_an_invalid_token_form_says_what_is_wrong(pages_world, client_for):
    response = client_for("admin").post(
        "/enrollment-tokens/", {"name": "", "cohort": pages_world.cohort.pk, "expires_in_hours": 0}
    )
    assert response.status_code == 400
    html = response.content.decode()
    assert "This field is required." in html and "greater than or equal to 1" in html
    assert EnrollmentToken.objects.count() == 1


def test_the_role_matrix_hides_controls_from_viewers(pages_world, client_for):
    viewer = client_for("viewer")
    assert "New rollout" not in viewer.get("/rollouts/").content.decode()
    assert "Open round" not in viewer.get("/rounds/").content.decode()
    assert "Create token" not in viewer.get("/enrollment-tokens/").content.decode()
    assert "Revoke" not in viewer.get("/enrollment-tokens/").content.decode()
    assert "Create cohort" not in viewer.get("/cohorts/").content.decode()
    assert "Open round" in client_for("operator").get("/rounds/").content.decode()
    assert "Create token" not in client_for("operator").get("/enrollment-tokens/").content.decode()
    assert "Create token" in client_for("admin").get("/enrollment-tokens/").content.decode()


def test_a_live_re_read_leaves_flash_messages_for_the_page_the_user_sees_next(pages_world, client_for):
    client = client_for("operator")
    client.post(f"/devices/{pages_world.devices[0].pk}/action/", {"action": "quarantine"})
    background = client.get(f"/devices/{pages_world.devices[0].pk}/", headers={"X-Live-Refresh": "1"}).content.decode()
    assert "is now quarantined" not in background and 'data-testid="device-status">quarantined<' in background
    assert "is now quarantined" in client.get(f"/devices/{pages_world.devices[0].pk}/").content.decode()


def test_the_device_page_shows_its_protocol_and_its_refused_uploads(pages_world, client_for):
    device = pages_world.devices[0]
    Device.objects.filter(pk=device.pk).update(protocol=1)
    client = client_for("viewer")
    html = client.get(f"/devices/{device.pk}/").content.decode()
    assert "protocol 1 (accepted until 2027-06-30)" in html
    assert 'data-testid="uploads-refused">none<' in html
    upload_refused(device.pk, "bad_created_at")
    upload_refused(device.pk, "bad_signature")
    html = client.get(f"/devices/{device.pk}/").content.decode()
    assert 'data-testid="uploads-refused">2 <small>last <code>bad_signature</code>' in html
    body = client.get(f"/api/v1/devices/{device.pk}/").json()
    assert (body["protocol"], body["uploads_refused"], body["upload_refused_code"]) == (1, 2, "bad_signature")
