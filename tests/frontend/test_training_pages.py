"""The training pages' actions: models and adapters, rounds and rollouts (allowed, refused, and their errors),
on the ``pages_world`` of conftest.py (every page for every role is in test_pages.py)."""

from __future__ import annotations

import io
import re
import zipfile
from datetime import timedelta

import pytest
from django.utils import timezone

from devices.models import Cohort
from tests.frontend.conftest import make_deltas, make_devices, make_versions
from training.federation.release_gate import gate_record
from training.federation.rounds import round_open
from training.models import AdapterVersion, Assignment, Delta, Rollout, Round, TrainingEvent
from training.registry.services import version_create_seeded
from training.rollouts.lifecycle import device_bucket, rollout_start

pytestmark = pytest.mark.django_db


# --- models and adapters ----------------------------------------------------------------------------------


def test_adapter_page_shows_lineage_with_parents_a_metrics_chart_and_export_for_operators(pages_world, client_for):

    branch = AdapterVersion.objects.create(
        adapter=pages_world.adapter,
        number=4,
        parent=pages_world.versions[0],
        blob_sha256="f" * 64,
        size=1,
        source="import",
    )
    html = client_for("viewer").get(f"/adapters/{pages_world.adapter.pk}/").content.decode()
    assert html.count('class="line"') == 2  # eval_accuracy and eval_loss
    assert html.count('class="point"') == 2 * 3  # the branch has no metrics
    assert re.search(rf'data-version="{branch.number}">.*?--depth: 1.*?↳', html, re.S)  # a fork is indented
    assert re.search(r'data-version="3">.*?--depth: 0.*?<td>v2</td>', html, re.S)  # the chain stays flat
    assert "export PEFT" not in html
    operator_html = client_for("operator").get(f"/adapters/{pages_world.adapter.pk}/").content.decode()
    assert f"/api/v1/adapter-versions/{pages_world.versions[0].pk}/export/" in operator_html


def test_the_export_link_serves_a_peft_zip_to_operators(adapter, client_for):

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


def test_closing_a_round_needs_an_operator_and_an_accepted_delta(pages_world, client_for):
    empty = Round.objects.create(
        adapter=pages_world.adapter,
        base_version=pages_world.versions[0],
        strategy="fedavg",
        buffer_size=5,
        state="failed",
    )
    url = f"/rounds/{pages_world.round.pk}/close/"
    assert client_for("viewer").post(url).status_code == 403
    html = client_for("operator").post(url, follow=True).content.decode()
    assert f"Closed round {pages_world.round.pk}" in html
    pages_world.round.refresh_from_db()
    assert pages_world.round.state == "aggregating" and pages_world.round.close_reason == "manual"
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


def test_round_detail_lists_every_delta_that_joined_and_offers_actions_by_role(pages_world, client_for):
    html = client_for("viewer").get(f"/rounds/{pages_world.round.pk}/").content.decode()
    assert html.count("data-delta=") == 6  # 8 deltas, every 4th rejected: a rejected delta joins no round
    assert "norm_too_large" not in html and "6 joined: 6 accepted, 0 aggregated" in html
    assert 'data-testid="round-progress">6 / 50<' in html and "fedavg" in html
    assert "Close now" not in html
    assert "Close now" in client_for("operator").get(f"/rounds/{pages_world.round.pk}/").content.decode()


def test_rounds_count_the_adapters_deltas_rejected_while_they_collected_not_a_rejected_count_that_is_always_0(
    adapter, cohort, client_for, make_user
):
    (version,) = make_versions(adapter, 1)
    devices = make_devices(cohort, 3)
    now = timezone.now()
    closed = Round.objects.create(
        adapter=adapter, base_version=version, strategy="fedavg", buffer_size=5, state="completed",
        created_at=now - timedelta(hours=3), closed_at=now - timedelta(hours=2),
    )  # fmt: skip
    current = round_open(adapter=adapter, actor=make_user("operator"))
    later = timezone.now()
    rejected = make_deltas(devices, adapter, version, 6, rejected_every=1)
    # 4 h ago: before both rounds; 150 and 140 minutes ago: while the closed round collected; 90 minutes ago:
    # between the two rounds; now (twice): while the current round collects.
    times = [*(now - timedelta(hours=hours) for hours in (4, 2.5, 2.33, 1.5)), later, later]
    for delta, received_at in zip(rejected, times, strict=True):
        Delta.objects.filter(pk=delta.pk).update(received_at=received_at)
    viewer = client_for("viewer")
    listing = viewer.get("/rounds/").content.decode()
    for round_ in (closed, current):
        link = f'<a class="bad" href="/rounds/{round_.pk}/?state=rejected">2</a>'
        assert f'data-testid="rejected-meanwhile-{round_.pk}">{link}' in listing
    detail = viewer.get(f"/rounds/{closed.pk}/").content.decode()
    assert f"2 deltas</a> for {adapter.name} rejected while this round collected" in detail
    assert "rejected meanwhile (2)" in detail and "0 joined" in detail
    listed = viewer.get(f"/rounds/{closed.pk}/?state=rejected").content.decode()
    assert {int(pk) for pk in re.findall(r'data-delta="(\d+)"', listed)} == {rejected[1].pk, rejected[2].pk}
    assert listed.count("norm_<wbr>too_<wbr>large") == 2  # a code that wraps only at its underscores
    Delta.objects.filter(adapter=adapter).delete()
    empty = viewer.get(f"/rounds/{current.pk}/?state=rejected").content.decode()
    assert f"No delta for {adapter.name} was rejected while this round collected." in empty
    assert f'data-testid="rejected-meanwhile-{current.pk}">0<' in viewer.get("/rounds/").content.decode()


def test_the_rounds_pages_and_the_api_count_the_same_rejected_deltas_and_show_a_rejected_deltas_norm(
    pages_world, client_for
):
    round_ = pages_world.round  # pages_world: 8 deltas over the last minutes, every 4th rejected
    viewer = client_for("viewer")
    body = viewer.get(f"/api/v1/rounds/{round_.pk}/").json()
    listing = viewer.get("/rounds/").content.decode()
    # the one received now, not the one 4 minutes ago, before the round opened; never "0" from a count of
    # rejected deltas in the round (none ever joins one)
    assert body["rejected"] == 1 and body["accepted"] == 6
    link = f'<a class="bad" href="/rounds/{round_.pk}/?state=rejected">1<'
    assert f'data-testid="rejected-meanwhile-{round_.pk}">{link}' in listing
    assert "the API's <code>rejected</code> counts the same" in listing
    schema = viewer.get("/api/schema/", headers={"Accept": "application/json"}).json()
    assert (
        "received while the round collected (from its opening to its close, or now while it collects) and rejected"
        in schema["components"]["schemas"]["Round"]["properties"]["rejected"]["description"]
    )
    Delta.objects.filter(state="rejected").update(
        norm=None, rejection_detail="the update's L2 norm is 1.234e+06; the adapter's bound is 1000"
    )
    rejected = viewer.get(f"/rounds/{round_.pk}/?state=rejected").content.decode()
    assert rejected.count('<td class="opt">1,234,000</td>') == 1 and '<td class="opt">—</td>' not in rejected


# --- rollouts --------------------------------------------------------------------------------------------


def test_operator_creates_a_rollout_from_the_form(pages_world, client_for):
    response = client_for("operator").post(
        "/rollouts/new/",
        {
            "version": pages_world.versions[1].pk,
            "cohort": pages_world.cohort.pk,
            "phases": "20:60, 100:0",
            "guards": "eval_accuracy min 0.7 3\nlatency_ms max 50",
            "on_breach": "rollback",
            "max_failure_rate": "0.1",
        },
    )
    rollout = Rollout.objects.exclude(pk=pages_world.rollout.pk).get()
    assert response.status_code == 302 and response["Location"] == f"/rollouts/{rollout.pk}/"
    assert rollout.phases == [{"percent": 20.0, "min_soak_seconds": 60}, {"percent": 100.0, "min_soak_seconds": 0}]
    assert rollout.guards == [
        {"metric": "eval_accuracy", "min": 0.7, "min_reports": 3},
        {"metric": "latency_ms", "max": 50.0, "min_reports": 1},
    ]
    assert rollout.on_breach == "rollback" and rollout.state == "draft"


def test_a_bad_rollout_form_says_what_is_wrong_and_creates_nothing(pages_world, client_for):
    client = client_for("operator")
    base = {
        "version": pages_world.versions[1].pk,
        "cohort": pages_world.cohort.pk,
        "on_breach": "pause",
        "max_failure_rate": "0.2",
    }
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


def test_rollout_lifecycle_from_the_detail_page(pages_world, client_for):

    url = f"/rollouts/{pages_world.rollout.pk}"
    operator = client_for("operator")
    assert client_for("viewer").post(f"{url}/start/").status_code == 403
    assert 'data-action="start"' not in client_for("viewer").get(f"{url}/").content.decode()
    assert 'data-action="start"' in operator.get(f"{url}/").content.decode()
    assert "started" in operator.post(f"{url}/start/", follow=True).content.decode()
    pages_world.rollout.refresh_from_db()
    first = sum(device_bucket(pages_world.rollout.pk, d.pk) < 50 for d in pages_world.devices)  # phase 0: 50%
    assert pages_world.rollout.state == "running" and pages_world.rollout.assignments.count() == first > 0
    html = operator.post(f"{url}/pause/", {"reason": "checking metrics"}, follow=True).content.decode()
    assert "paused" in html and "checking metrics" in html
    assert "Cannot pause a rollout that is paused." in operator.post(f"{url}/pause/", follow=True).content.decode()
    operator.post(f"{url}/resume/")
    pages_world.rollout.refresh_from_db()
    assert pages_world.rollout.state == "running"
    operator.post(f"{url}/rollback/", {"reason": "bad"})
    pages_world.rollout.refresh_from_db()
    assert pages_world.rollout.state == "rolled_back"
    assert operator.post(f"{url}/explode/").status_code == 404


def test_rollout_detail_shows_phases_with_assignment_counts_and_guards_against_thresholds(
    pages_world, client_for, make_user
):

    rollout_start(rollout=pages_world.rollout, actor=make_user("operator"))
    assigned = list(pages_world.rollout.assignments.all())
    Assignment.objects.filter(pk=assigned[0].pk).update(state="installed", metrics={"eval_accuracy": 0.5})
    html = client_for("viewer").get(f"/rollouts/{pages_world.rollout.pk}/").content.decode()
    assert re.search(r'data-phase="0">.*?current.*?1 / ' + str(len(assigned)), html, re.S)
    assert re.search(r'data-phase="1">.*?upcoming', html, re.S)
    assert re.search(r'class="breached">\s*<td>eval_accuracy</td>\s*<td>≥ 80.0%', html)  # numbers for people
    assert "50.0% breached" in html and "failure_rate" in html


def test_rollout_history_reads_as_sentences_and_a_personal_gain_is_in_points(pages_world, client_for, make_user):

    rollout = pages_world.rollout
    TrainingEvent.objects.create(
        kind="rollout.paused", adapter=pages_world.adapter, version=rollout.version,
        detail={"rollout": rollout.pk, "reason": "", "guards": [], "phases": [{"percent": 34, "min_soak_seconds": 60}]},
    )  # fmt: skip
    rollout_start(rollout=rollout, actor=make_user("operator"))
    assigned = rollout.assignments.first()
    Assignment.objects.filter(pk=assigned.pk).update(state="installed", metrics={"personal_gain": 0.304})
    html = client_for("viewer").get(f"/rollouts/{rollout.pk}/").content.decode()
    history = html.split("<h2>History</h2>", 1)[1]
    assert f"rollout {rollout.pk} of {pages_world.adapter.name} v{rollout.version.number} paused" in history
    assert "phases: (percent: 34; min soak seconds: 60)" in history
    assert "reason ," not in history and "guards []" not in history and "{" not in history
    assert "personal gain: +30.4 points" in html and "0.304" not in html


# --- the release gate ------------------------------------------------------------------------------------------


def _failed_candidate(pages_world):
    """A round's version worse than the best released one (pages_world's v3 at 0.75), judged as rounds judge."""

    worse = AdapterVersion.objects.create(
        adapter=pages_world.adapter, number=4, parent=pages_world.versions[-1], blob_sha256="e" * 64, size=1,
        source="round", metrics={"eval_accuracy": 0.4},
    )  # fmt: skip
    gate_record(worse)
    return worse


def test_a_version_that_failed_the_gate_shows_why_on_the_adapter_page_and_the_overview(pages_world, client_for):
    worse = _failed_candidate(pages_world)
    html = client_for("viewer").get(f"/adapters/{pages_world.adapter.pk}/").content.decode()
    gate = html[html.index(f'data-testid="gate-{worse.number}"') :].split("</td>")[0]
    assert "failed" in gate and "35.0 points below v3&#x27;s 0.750, the best released version" in gate
    notice = html[html.index('data-testid="adapter-notice"') :].split("</div>")[0]
    assert "v4 failed the release gate and stays a candidate" in notice and "Devices keep v3" in notice
    assert 'data-testid="release-form"' not in html  # viewers read, operators change
    overview = client_for("viewer").get("/").content.decode()
    attention = overview[overview.index('data-testid="overview-notices"') :].split("</section>")[0]
    assert f"{pages_world.adapter.name}</a>: v4 failed the release gate" in attention


def test_the_rollout_form_shows_evaluations_defaults_to_a_version_that_passed_and_asks_for_an_override(
    pages_world, client_for
):
    worse = _failed_candidate(pages_world)
    client = client_for("operator")
    page = client.get("/rollouts/new/").content.decode()
    assert "v4 (candidate, eval_accuracy 0.400, failed the release gate)" in page
    selected = re.search(r'<option value="(\d+)"[^>]*selected', page)
    assert selected and int(selected.group(1)) == pages_world.versions[-1].pk  # v3, released, not v4
    body = {"version": worse.pk, "cohort": pages_world.cohort.pk, "phases": "10:60, 100:0", "on_breach": "pause",
            "max_failure_rate": "0.2"}  # fmt: skip
    refused = client.post("/rollouts/new/", body)
    assert refused.status_code == 400 and "failed the release gate" in refused.content.decode()
    assert not Rollout.objects.filter(version=worse).exists()
    made = client.post("/rollouts/new/", {**body, "override_gate": "on", "override_reason": "canary first"})
    assert made.status_code == 302 and Rollout.objects.filter(version=worse).exists()
    assert TrainingEvent.objects.get(kind="version.gate_overridden").detail["reason"] == "canary first"


def test_operators_turn_automatic_release_off_and_set_the_margin_on_the_adapter_page(pages_world, client_for):
    adapter = pages_world.adapter
    url = f"/adapters/{adapter.pk}/release/"
    assert client_for("viewer").post(url, {"margin_points": "2"}).status_code == 403
    client = client_for("operator")
    response = client.post(url, {"auto_release": "on", "margin_points": "2.5"}, follow=True)
    adapter.refresh_from_db()
    assert adapter.aggregation["auto_release"] is True and adapter.aggregation["release_margin"] == 0.025
    assert "automatic release on, release margin 2.5 points" in response.content.decode()
    client.post(url, {"margin_points": "1"})
    adapter.refresh_from_db()
    assert adapter.aggregation["auto_release"] is False and adapter.aggregation["release_margin"] == 0.01
    bad = client.post(url, {"margin_points": "-3"}, follow=True).content.decode()
    adapter.refresh_from_db()
    assert "Nothing was changed" in bad and adapter.aggregation["release_margin"] == 0.01
    assert TrainingEvent.objects.filter(kind="adapter.aggregation_changed").count() == 2
