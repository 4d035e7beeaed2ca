"""Each role against each kind of endpoint and page: allowed where it should be, 401/403 everywhere else.

Add every new endpoint to ENDPOINTS with the lowest role that may use it.
"""

import pytest

ROLES = [None, "viewer", "operator", "admin"]
RANK = {None: 0, "viewer": 1, "operator": 2, "admin": 3}

# (method, path, lowest role allowed, body)
ENDPOINTS = [
    ("get", "/api/v1/me/", "viewer", None),
    ("get", "/api/v1/system/status/", "viewer", None),
    ("get", "/api/v1/api-tokens/", "viewer", None),
    ("post", "/api/v1/api-tokens/", "viewer", {"name": "matrix"}),
    ("post", "/api/v1/system/diagnostic/", "operator", None),
    ("get", "/api/v1/cohorts/", "viewer", None),
    ("get", "/api/v1/devices/", "viewer", None),
    ("get", "/api/v1/enrollment-tokens/", "viewer", None),
    ("post", "/api/v1/cohorts/", "admin", {"name": "matrix-cohort"}),
    (
        "post",
        "/api/v1/enrollment-tokens/",
        "admin",
        {"name": "t", "cohort": "matrix", "expires_at": "2099-01-01T00:00:00Z"},
    ),
    ("get", "/api/v1/base-models/", "viewer", None),
    ("get", "/api/v1/adapters/", "viewer", None),
    ("get", "/api/v1/adapter-versions/", "viewer", None),
    ("post", "/api/v1/base-models/", "admin", {"name": "matrix-base", "family": "digits-cnn"}),
    ("get", "/api/v1/rollouts/", "viewer", None),
    ("post", "/api/v1/rollouts/", "operator", {"version": 999999, "cohort": "matrix", "phases": [{"percent": 10}]}),
    ("get", "/api/v1/rounds/", "viewer", None),
    ("get", "/api/v1/deltas/", "viewer", None),
    ("post", "/api/v1/rounds/", "operator", {"adapter": "no-such-adapter"}),
    ("post", "/api/v1/rounds/999999/close/", "operator", None),
    ("put", "/api/v1/adapters/999999/aggregation/", "operator", {"aggregation": {"strategy": "median"}}),
    ("get", "/api/v1/users/", "admin", None),
    ("post", "/api/v1/users/", "admin", {"username": "newbie", "role": "viewer"}),
]

PAGES = [
    ("/", "viewer"),
    ("/devices/", "viewer"),
    ("/cohorts/", "viewer"),
    ("/enrollment-tokens/", "viewer"),
    ("/models/", "viewer"),
    ("/rounds/", "viewer"),
    ("/rollouts/", "viewer"),
    ("/rollouts/new/", "operator"),
    ("/system/", "viewer"),
    ("/settings/api-tokens/", "viewer"),
    ("/settings/users/", "admin"),
]


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES, ids=lambda r: r or "anonymous")
@pytest.mark.parametrize(("method", "path", "lowest", "body"), ENDPOINTS, ids=lambda v: v if isinstance(v, str) else "")
def test_api_role_matrix(api_client_for, role, method, path, lowest, body):
    from devices.services import cohort_create

    cohort_create(name="matrix")
    if path == "/api/v1/system/diagnostic/" and RANK[role] >= RANK[lowest]:
        pytest.skip("needs a worker; allowed calls are covered in test_celery_worker")
    response = getattr(api_client_for(role), method)(path, body, format="json")
    if role is None:
        assert response.status_code == 401
    elif RANK[role] < RANK[lowest]:
        assert response.status_code == 403, response.content
        assert response.json()["error"]["code"] == "permission_denied"
    elif body and (body.get("version") == 999999 or body.get("adapter") == "no-such-adapter"):
        assert response.status_code == 400  # allowed through the role check; the object does not exist
    elif "999999" in path:
        assert response.status_code == 404, response.content  # allowed through the role check; no such object
    else:
        assert response.status_code in (200, 201), response.content


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES, ids=lambda r: r or "anonymous")
@pytest.mark.parametrize(("path", "lowest"), PAGES)
def test_page_role_matrix(client, make_user, role, path, lowest):
    if role is not None:
        client.force_login(make_user(role))
    response = client.get(path)
    if role is None:
        assert response.status_code == 302
        assert response["Location"].startswith("/login/")
    elif RANK[role] < RANK[lowest]:
        assert response.status_code == 403
    else:
        assert response.status_code == 200


@pytest.mark.django_db
def test_viewer_is_not_offered_admin_navigation(client, make_user):
    client.force_login(make_user("viewer"))
    html = client.get("/").content.decode()
    assert "/settings/users/" not in html
    client.force_login(make_user("admin"))
    assert "/settings/users/" in client.get("/").content.decode()


@pytest.mark.django_db
def test_session_api_calls_need_a_csrf_token(make_user):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user("admin"))
    response = client.post("/api/v1/api-tokens/", {"name": "x"}, content_type="application/json")
    assert response.status_code == 403
    assert "CSRF" in response.json()["error"]["message"]


@pytest.mark.django_db
def test_a_deactivated_user_loses_access_even_with_a_token(api_client_for):
    client = api_client_for("admin")
    from accounts.models import User

    User.objects.update(is_active=False)
    assert client.get("/api/v1/me/").status_code == 401
