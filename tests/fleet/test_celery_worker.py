import time

import pytest

from fleet.tasks import system_diagnostic


@pytest.mark.django_db(transaction=True)
def test_task_runs_in_a_real_worker_over_redis_and_reaches_the_database(celery_worker_process):
    result = system_diagnostic.apply_async(kwargs={"sent_at": time.time()})
    report = result.get(timeout=30)
    assert report["database"] == "ok"
    assert report["worker"]
    assert report["queue_delay_ms"] >= 0


@pytest.mark.django_db(transaction=True)
def test_operator_runs_the_worker_diagnostic_through_the_api(celery_worker_process, api_client_for):
    response = api_client_for("operator").post("/api/v1/system/diagnostic/")
    assert response.status_code == 200, response.content
    assert response.json()["database"] == "ok"
    assert response.json()["round_trip_ms"] > 0


@pytest.mark.django_db(transaction=True)
def test_readyz_reports_every_dependency_ok_with_a_worker_running(celery_worker_process, client):
    response = client.get("/readyz")
    body = response.json()
    assert response.status_code == 200, body
    assert body["ok"] is True
    assert {"database", "redis", "worker"} <= {name for name, check in body["checks"].items() if check["ok"]}
    assert any(name.startswith("test-") for name in body["checks"]["worker"]["workers"])


def test_a_process_that_only_set_up_django_queues_tasks_on_the_projects_broker(settings):
    """A web server process that has only served WebSockets never loaded the URLconf (nor, through it, the
    Celery app): its tasks must still go to the configured broker, not to Celery's fallback amqp://localhost."""
    import os
    import subprocess
    import sys

    code = (
        "import django; django.setup(); from training.tasks import verify_delta; "
        "print(verify_delta.app.main, verify_delta.app.conf.broker_url)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["fleet", settings.CELERY_BROKER_URL]
