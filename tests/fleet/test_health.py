import pytest


def test_healthz_answers_without_touching_dependencies(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"ok": True}


@pytest.mark.django_db
def test_readyz_is_503_and_names_the_worker_when_no_worker_answers(client):
    # No worker consumes this run's queue unless the worker fixture started one; the control exchange is
    # namespaced per run, so workers of other stacks on the same Redis do not answer.
    from fleet.celery import app

    if app.control.ping(timeout=0.5):
        pytest.skip("a worker of this run is up (fixture order); covered by the worker tests")
    response = client.get("/readyz")
    body = response.json()
    assert response.status_code == 503
    assert body["ok"] is False
    assert body["checks"]["database"]["ok"] and body["checks"]["redis"]["ok"]
    assert "no Celery worker answered" in body["checks"]["worker"]["error"]


@pytest.mark.django_db
def test_metrics_refuse_anonymous_callers_and_accept_the_metrics_token(client, settings):
    settings.METRICS_TOKEN = "scrape-secret-123"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    response = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret-123")
    assert response.status_code == 200
    text = response.content.decode()
    assert "fleet_http_requests_total" in text
    assert 'fleet_operator_accounts{role="admin"}' in text


@pytest.mark.django_db
def test_metrics_are_readable_by_a_signed_in_viewer(client, make_user):
    client.force_login(make_user("viewer"))
    assert client.get("/metrics").status_code == 200
