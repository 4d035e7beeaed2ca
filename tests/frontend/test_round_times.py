"""How long a round took, from its close (or its last re-run) to its result version and to that version's
release (``Round.aggregated_at``, ``released_at``, ``reran_at``): set by a real Celery worker aggregating and
auto-releasing, by an operator's first rollout of the result, counted from a re-run for a round that failed, and
reported in the round API (list and detail, documented in the schema) and on the rounds pages in words."""

from __future__ import annotations

import math
import re
from datetime import timedelta

import pytest
from django.utils import timezone

from frontend.wording import duration, round_times
from tests.training.test_rounds import make_delta_tensors, receive, wait_for
from training.federation.rounds import round_open
from training.models import AdapterVersion, Delta, Rollout, Round
from training.registry.services import adapter_set_aggregation, version_create_seeded

# Generous: a round of a few deltas of the digits adapter is aggregated in well under a second on one worker.
PLAUSIBLE_SECONDS = 120


@pytest.fixture
def fleet(adapter, cohort, enrolled):
    adapter.cohorts.add(cohort)
    version = version_create_seeded(adapter=adapter, seed=3)
    return adapter, version, [enrolled("active", name=f"d{i}") for i in range(4)]


def api_round(client, round_id: int) -> dict:
    """The round as the API gives it, in its detail and in the list (the same fields)."""
    detail = client.get(f"/api/v1/rounds/{round_id}/")
    assert detail.status_code == 200, detail.content
    listed = {row["id"]: row for row in client.get("/api/v1/rounds/").json()["results"]}
    assert listed[round_id] == detail.json()
    return detail.json()


def page_times(client, round_id: int) -> tuple[str, str]:
    """What the round list's column and the round's page say of its times."""
    listing = client.get("/rounds/").content.decode()
    cell = re.search(rf'data-testid="round-times-{round_id}">([^<]*)<', listing)
    detail = client.get(f"/rounds/{round_id}/").content.decode()
    line = re.search(r'data-testid="round-times">([^<]*)<', detail)
    assert cell and line, (listing[:2000], detail[:2000])
    return cell.group(1).strip(), line.group(1).strip()


def assert_times(round_: Round, body: dict) -> None:
    """Set, ordered (close ≤ aggregated ≤ released), plausible, and the API's seconds are the timestamps'."""
    start = round_.reran_at or round_.closed_at
    assert start <= round_.aggregated_at <= round_.released_at
    assert 0 <= body["aggregation_seconds"] <= body["release_seconds"] < PLAUSIBLE_SECONDS, body
    assert math.isclose(body["aggregation_seconds"], (round_.aggregated_at - start).total_seconds(), abs_tol=1e-3)
    assert math.isclose(body["release_seconds"], (round_.released_at - start).total_seconds(), abs_tol=1e-3)


@pytest.mark.django_db(transaction=True)
def test_a_round_a_real_worker_aggregates_and_auto_releases_reports_its_times_in_the_api_and_on_the_pages(
    fleet, celery_worker_process, api_client_for, client_for
):
    adapter, _, devices = fleet
    adapter_set_aggregation(
        adapter=adapter, actor=None, aggregation={"buffer_size": 3, "min_deltas": 1, "auto_release": True}
    )
    for i in range(3):
        receive(devices[i], adapter, make_delta_tensors(adapter, seed=100 + i), counter=1)
    # The worker verifies the deltas, closes the full round, aggregates it and releases its version.
    round_ = wait_for(lambda: Round.objects.filter(released_at__isnull=False).first())
    version = AdapterVersion.objects.get(round=round_)
    rollout = Rollout.objects.get(version=version)
    assert round_.state == Round.State.COMPLETED and round_.close_reason == "buffer_full" and round_.reran_at is None
    # Stored with the version, in one transaction; released when its rollout started.
    assert round_.aggregated_at == round_.completed_at == version.created_at
    assert round_.released_at == rollout.started_at and rollout.state == Rollout.State.RUNNING

    body = api_round(api_client_for("viewer"), round_.pk)
    assert_times(round_, body)
    assert body["reran_at"] is None and body["aggregated_at"] and body["released_at"]

    said = round_times(body["aggregation_seconds"], body["release_seconds"])
    assert re.fullmatch(r"aggregated in [\d.]+ s; released [\d.]+ s after close", said), said
    assert page_times(client_for("viewer"), round_.pk) == (said, said)

    # The next round, collecting: no times yet, in the API or on the pages.
    collecting = round_open(adapter=adapter, actor=None)
    body = api_round(api_client_for("viewer"), collecting.pk)
    assert [body[k] for k in ("aggregated_at", "released_at", "aggregation_seconds", "release_seconds")] == [None] * 4
    assert page_times(client_for("viewer"), collecting.pk) == ("—", "—")


@pytest.mark.django_db(transaction=True)
def test_an_operator_s_first_rollout_of_the_result_releases_the_round_and_later_ones_change_nothing(
    fleet, celery_worker_process, api_client_for, client_for
):
    adapter, _, devices = fleet
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation={"buffer_size": 2, "min_deltas": 1})
    for i in range(2):
        receive(devices[i], adapter, make_delta_tensors(adapter, seed=200 + i), counter=1)
    round_ = wait_for(lambda: Round.objects.filter(state=Round.State.COMPLETED).first())
    version = AdapterVersion.objects.get(round=round_)
    viewer, operator = api_client_for("viewer"), api_client_for("operator")
    body = api_round(viewer, round_.pk)
    assert 0 <= body["aggregation_seconds"] < PLAUSIBLE_SECONDS and body["release_seconds"] is None
    said = page_times(client_for("viewer"), round_.pk)[1]
    assert re.fullmatch(r"aggregated in [\d.]+ s; not released", said), said

    rollout = {"version": version.pk, "cohort": adapter.cohorts.get().name, "phases": [{"percent": 100}]}
    created = operator.post("/api/v1/rollouts/", rollout, format="json")
    assert created.status_code == 201, created.content
    assert api_round(viewer, round_.pk)["released_at"] is None  # a draft reaches no device: not released
    assert operator.post(f"/api/v1/rollouts/{created.json()['id']}/start/").status_code == 200
    round_.refresh_from_db()
    assert round_.released_at == Rollout.objects.get(pk=created.json()["id"]).started_at
    assert_times(round_, api_round(viewer, round_.pk))

    # Stopped and rolled out again later: released is when it first went out.
    assert operator.post(f"/api/v1/rollouts/{created.json()['id']}/abort/", {}, format="json").status_code == 200
    again = operator.post("/api/v1/rollouts/", rollout, format="json").json()
    assert operator.post(f"/api/v1/rollouts/{again['id']}/start/").status_code == 200
    assert Round.objects.get(pk=round_.pk).released_at == round_.released_at


@pytest.mark.django_db(transaction=True)
def test_a_failed_round_run_again_counts_its_times_from_the_re_run(
    fleet, celery_worker_process, api_client_for, client_for
):
    adapter, _, devices = fleet
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation={"buffer_size": 30, "min_deltas": 1})
    for i in range(2):
        receive(devices[i], adapter, make_delta_tensors(adapter, seed=300 + i), counter=1)
    wait_for(lambda: Delta.objects.filter(state=Delta.State.ACCEPTED).count() == 2)
    round_ = Round.objects.get()
    # One delta's file is missing from blob storage: the worker's aggregation fails the round.
    lost = Delta.objects.filter(round=round_).order_by("id").first()
    Delta.objects.filter(pk=lost.pk).update(blob_sha256="0" * 64)
    operator, viewer = api_client_for("operator"), api_client_for("viewer")
    assert operator.post(f"/api/v1/rounds/{round_.pk}/close/").status_code == 200
    failed = wait_for(lambda: Round.objects.filter(pk=round_.pk, state=Round.State.FAILED).first())
    assert "FileNotFoundError" in failed.failure and failed.aggregated_at is None
    assert api_round(viewer, round_.pk)["aggregation_seconds"] is None
    assert page_times(client_for("viewer"), round_.pk) == ("—", "—")

    # The file is back, an hour later: an operator runs the round again.
    Delta.objects.filter(pk=lost.pk).update(blob_sha256=lost.blob_sha256)
    Round.objects.filter(pk=round_.pk).update(closed_at=timezone.now() - timedelta(hours=1))
    rerun = operator.post(f"/api/v1/rounds/{round_.pk}/rerun/")
    assert rerun.status_code == 200 and rerun.json()["reran_at"] is not None
    done = wait_for(lambda: Round.objects.filter(pk=round_.pk, state=Round.State.COMPLETED).first())
    assert done.closed_at < done.reran_at <= done.aggregated_at and done.released_at is None
    body = api_round(viewer, round_.pk)
    assert 0 <= body["aggregation_seconds"] < PLAUSIBLE_SECONDS  # not the hour it sat failed
    assert math.isclose(body["aggregation_seconds"], (done.aggregated_at - done.reran_at).total_seconds(), abs_tol=1e-3)
    cell, line = page_times(client_for("viewer"), round_.pk)
    assert re.fullmatch(r"aggregated in [\d.]+ s from re-run; not released", line) and cell == line, line
    assert "its times count from here" in client_for("viewer").get(f"/rounds/{round_.pk}/").content.decode()


@pytest.mark.django_db
def test_a_round_whose_times_were_not_kept_shows_none(pages_world, client_for):
    """Rounds from before the times were kept: completed, with null times."""
    Round.objects.filter(pk=pages_world.round.pk).update(
        state=Round.State.COMPLETED, closed_at=timezone.now(), completed_at=timezone.now()
    )
    assert page_times(client_for("viewer"), pages_world.round.pk) == ("—", "—")


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (None, "—"),
        (0.0004, "under 0.01 s"),
        (0.353, "0.35 s"),
        (4.2099, "4.2 s"),
        (9.97, "10 s"),
        (12.4, "12 s"),
        (59.6, "1 min"),
        (185, "3 min 5 s"),
        (3599.7, "1 h"),
        (7500, "2 h 5 min"),
        (3 * 86400 + 4 * 3600 + 100, "3 d 4 h"),
        (-0.5, "under 0.01 s"),  # hosts' clocks a little apart: never a negative time
    ],
)
def test_durations_read_for_people(seconds, shown):
    assert duration(seconds) == shown


def test_a_round_s_times_read_as_one_sentence():
    assert round_times(None, None) == "—"
    assert round_times(4.21, None) == "aggregated in 4.2 s; not released"
    assert round_times(4.21, 12.3) == "aggregated in 4.2 s; released 12 s after close"
    assert round_times(0.5, 75, rerun=True) == "aggregated in 0.5 s from re-run; released 1 min 15 s after re-run"


@pytest.mark.django_db
def test_the_schema_documents_the_round_s_times(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    fields = schema["components"]["schemas"]["Round"]["properties"]
    for name in ("aggregation_seconds", "release_seconds"):
        assert fields[name]["type"] == "number" and fields[name]["nullable"] and fields[name]["readOnly"], fields[name]
    for name in ("reran_at", "aggregated_at", "released_at"):
        assert fields[name]["format"] == "date-time" and fields[name]["nullable"], fields[name]
    assert "close" in fields["aggregation_seconds"]["description"]
    assert "first rollout" in fields["release_seconds"]["description"]
    assert "re-run" in fields["aggregation_seconds"]["description"]
