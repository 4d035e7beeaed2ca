"""Each role against every endpoint and page: allowed where it should be, 401/403 everywhere else.

The URL resolver is the inventory (``routes()``). Every route and method is placed in API_ROLES or
PAGE_ROLES with the lowest role that may use it, or in DEVICE_ROUTES or PUBLIC_ROUTES (the Django admin is
staff-only as a whole), so a new endpoint fails ``test_every_route_and_method_is_placed_in_the_matrix``
until someone decides who may use it. ``TestCompleteMatrix`` then calls every one of them as every role,
against real objects: the roles below the lowest are refused and change nothing, the others get past the
role check. ENDPOINTS and PAGES call a sample with real bodies as the allowed roles.

The device half (a device credential on every route, operators on device routes, devices acting as other
devices) is tests/devices/test_device_authz_matrix.py (with test_device_authz_other_device.py and
test_device_authz_socket.py); the inventory is in tests/authz_routes.py, the world in tests/authz_support.py and
``db_state`` in tests/authz_snapshot.py.
"""

from __future__ import annotations

import itertools

import pytest

from tests.authz_routes import (
    API_ROLES,
    DEVICE_ROUTES,
    NOBODY,
    PAGE_ROLES,
    PUBLIC_ROUTES,
    VIEWER,
    WAITS_FOR_WORKERS,
    routes,
    routes_by_name,
)
from tests.authz_snapshot import db_changes, db_state
from tests.authz_support import FAST_PASSWORD_HASHERS, build_world, rolled_back

ROLES = [None, "viewer", "operator", "admin"]
RANK = {None: 0, "viewer": 1, "operator": 2, "admin": 3}


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    """These tests make users by the dozen; how slowly a password hashes is not what they are about."""
    settings.PASSWORD_HASHERS = FAST_PASSWORD_HASHERS


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
    ("get", "/api/v1/adapters/999999/personalization/", "viewer", None),
    ("put", "/api/v1/adapters/999999/personalization/", "operator", {"personalization": {"method": "none"}}),
    ("get", "/api/v1/adapters/999999/cohorts/", "viewer", None),
    ("put", "/api/v1/adapters/999999/cohorts/", "admin", {"cohorts": ["matrix"]}),
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


def test_every_route_and_method_is_placed_in_the_matrix():
    tables = [set(API_ROLES), set(PAGE_ROLES), set(DEVICE_ROUTES), PUBLIC_ROUTES]
    for first, second in itertools.combinations(tables, 2):
        assert not first & second, f"placed twice: {first & second}"
    problems = []
    served = set()
    for route in routes():
        served.add(route.name)
        if route.name in PUBLIC_ROUTES or route.is_django_admin:
            continue
        device = dict.fromkeys(DEVICE_ROUTES.get(route.name, ()))
        placed = API_ROLES.get(route.name) or PAGE_ROLES.get(route.name) or device
        if not placed:
            problems.append(f"{route.name} ({route.pattern}) is in no table: decide who may use it")
        elif set(placed) != set(route.methods):
            problems.append(f"{route.name} answers {sorted(route.methods)}; the matrix says {sorted(placed)}")
    stale = (set().union(*tables)) - served
    assert not problems, "\n".join(problems)
    assert not stale, f"the matrix names routes that no longer exist: {sorted(stale)}"


# --- the complete matrix ---------------------------------------------------------------------------------------

API_CASES = [(name, method, lowest) for name, methods in API_ROLES.items() for method, lowest in methods.items()]
PAGE_CASES = [(name, method, lowest) for name, methods in PAGE_ROLES.items() for method, lowest in methods.items()]


def _call(client, method: str, url: str, body, *, form: bool = False):
    if form:
        return getattr(client, method)(url, body or {})
    return getattr(client, method)(url, body, format="json")


def _refused_by_api(response, role) -> str:
    """ "" when the API refused the call as it should (401 anonymous, 403 ``permission_denied``), else why not."""
    if role is None:
        return "" if response.status_code == 401 else f"anonymous got {response.status_code}"
    if response.status_code != 403 or response.json()["error"]["code"] != "permission_denied":
        return f"got {response.status_code} {response.content[:200]!r}"
    return ""


def _refused_page(response, role, lowest) -> str:
    if lowest == NOBODY:
        return "" if response.status_code == 405 else f"got {response.status_code}, not 405"
    if role is None:
        to_login = response.status_code == 302 and response["Location"].startswith("/login/")
        return "" if to_login or response.status_code == 401 else f"anonymous got {response.status_code}"
    return "" if response.status_code == 403 else f"got {response.status_code}"


def _past_the_role_check(response) -> bool:
    if response.status_code in (401, 403, 405):
        return False
    return not (response.status_code == 302 and response["Location"].startswith("/login/"))


@pytest.fixture(scope="class")
def world(django_db_setup, django_db_blocker, shared_blob_root):
    with rolled_back(django_db_blocker, shared_blob_root):
        yield build_world()


@pytest.fixture(scope="module")
def inventory():
    return routes_by_name()


class TestCompleteMatrix:
    """Every API route and page as every role (API: by token and by session)."""

    @pytest.mark.django_db
    @pytest.mark.parametrize(("name", "method", "lowest"), API_CASES, ids=[f"{m} {n}" for n, m, _ in API_CASES])
    def test_api(self, world, inventory, name, method, lowest):
        route = inventory[name]
        url, body = route.url(**world.targets(name)), world.bodies().get((name, method))
        before = db_state()
        failures = []
        for role in [role for role in ROLES if RANK[role] < RANK[lowest]]:
            for label, client in world.api_clients(role):
                why = _refused_by_api(_call(client, method, url, body), role)
                failures += [f"{label}: {why}"] if why else []
        assert not failures, f"{method.upper()} {url} should need {lowest}:\n" + "\n".join(failures)
        assert db_state() == before, f"refused calls changed:\n{db_changes(before, db_state())}"
        if (name, method) in WAITS_FOR_WORKERS:
            return
        # The others get past the role check: asked about objects that do not exist, with empty bodies, they
        # hear "not found" or "invalid", not "forbidden".
        made_up = route.url()
        for role in [role for role in ROLES if role is not None and RANK[role] >= RANK[lowest]]:
            for label, client in world.api_clients(role):
                response = _call(client, method, made_up, None if method == "get" else {})
                assert _past_the_role_check(response), f"{label}: {method.upper()} {made_up} {response.status_code}"

    @pytest.mark.django_db
    @pytest.mark.parametrize(("name", "method", "lowest"), PAGE_CASES, ids=[f"{m} {n}" for n, m, _ in PAGE_CASES])
    def test_page(self, world, inventory, name, method, lowest):
        route = inventory[name]
        url, body = route.url(**world.targets(name)), world.bodies().get((name, method))
        before = db_state()
        failures = []
        for role in [role for role in ROLES if lowest == NOBODY or RANK[role] < RANK[lowest]]:
            why = _refused_page(_call(world.page_client(role), method, url, body, form=True), role, lowest)
            failures += [f"{role or 'anonymous'}: {why}"] if why else []
        assert not failures, f"{method.upper()} {url} should need {lowest}:\n" + "\n".join(failures)
        assert db_state() == before, f"refused calls changed:\n{db_changes(before, db_state())}"
        if lowest == NOBODY or (name, method) in WAITS_FOR_WORKERS:
            return
        made_up = route.url()
        for role in [role for role in ROLES if role is not None and RANK[role] >= RANK[lowest]]:
            response = _call(world.page_client(role), method, made_up, {}, form=True)
            assert _past_the_role_check(response), f"{role}: {method.upper()} {made_up} {response.status_code}"

    @pytest.mark.django_db
    def test_the_django_admin_is_for_staff_only(self, world, inventory):
        before = db_state()
        failures = []
        for route in [route for route in inventory.values() if route.is_django_admin]:
            if route.name in PUBLIC_ROUTES:
                continue
            url = route.url()
            for role in ROLES:
                for method in route.methods:
                    response = _call(world.page_client(role), method, url, {}, form=True)
                    location = response.get("Location", "")
                    if not (response.status_code == 302 and location.startswith("/admin/login/")):
                        failures.append(f"{role or 'anonymous'}: {method.upper()} {url} {response.status_code}")
        assert not failures, "\n".join(failures)
        assert db_state() == before, db_changes(before, db_state())

    @pytest.mark.django_db
    def test_a_viewer_can_neither_see_nor_revoke_another_users_api_token(self, world):
        token = world.other_token
        for label, client in world.api_clients(VIEWER):
            assert client.get(f"/api/v1/api-tokens/{token.pk}/").status_code == 404, label
            assert client.post(f"/api/v1/api-tokens/{token.pk}/revoke/").status_code == 404, label
            listed = client.get("/api/v1/api-tokens/").json()["results"]
            assert token.pk not in [row["id"] for row in listed], label
        page = world.page_client(VIEWER).post(f"/settings/api-tokens/{token.pk}/revoke/")
        assert page.status_code == 404
        token.refresh_from_db()
        assert token.revoked_at is None
