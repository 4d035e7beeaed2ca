"""Devices in the authorization matrix: a device's credential opens nothing but the device routes, no
operator credential opens a device route, and no device can act as another one, over REST or the agent
socket. Every refusal has a clear error code and leaves the database as it was (``db_state`` before and
after; the one thing a failed signature writes is a rate-limited ``auth_failed`` event, checked as such).

This module holds which credential opens which route: a device's token on every other route and page, and
every operator credential on the device routes. A device acting as another one over REST (and revoked
devices and dead tokens) is test_device_authz_other_device.py; the agent socket test_device_authz_socket.py;
the fleet they share device_authz_support.py and conftest.py. The inventory of routes (from the URL resolver:
a new route is a new case here), the world the calls aim at and ``db_state`` come from tests/authz_routes.py,
tests/authz_support.py and tests/authz_snapshot.py, shared with tests/fleet/test_role_matrix.py (the operator
half); the socket and REST helpers from the device and delta tests. ``alpha`` is the device making the calls,
``bravo`` the device it tries to be.
"""

from __future__ import annotations

import pytest
from django.test import Client
from rest_framework.test import APIClient

from devices.authentication import DeviceTokenAuthentication, IsDevice
from edge_agent.delta import encode_delta, sign_delta
from tests.authz_routes import DEVICE_ROUTES, PUBLIC_ROUTES, routes
from tests.authz_snapshot import db_changes, db_state
from tests.devices.device_authz_support import DEVICE_ROUTE_METHODS, error_code, presence_of
from tests.devices.test_device_rest_auth import as_device
from tests.training.delta_support import upload
from tests.training.test_rounds import make_delta_tensors

# Every route that is neither a device route nor public, straight from the resolver (the Django admin is
# one case of its own).
OPERATOR_ROUTES = sorted(
    route.name
    for route in routes()
    if route.name not in DEVICE_ROUTES and route.name not in PUBLIC_ROUTES and not route.is_django_admin
)
SIGN_IN_PAGES = ("/login/", "/admin/login/")


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def bearer(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def unauthenticated(response) -> bool:
    """The API's answer to a caller whose credential it does not take here: 401 with a stable code."""
    codes = ("not_authenticated", "authentication_failed", "auth_failed", "token_expired")
    return response.status_code == 401 and error_code(response) in codes


def refused(response) -> bool:
    """How a page refuses a caller without the right credential: 401/403/405, or off to a sign-in page."""
    if response.status_code in (401, 403, 405):
        return True
    return response.status_code == 302 and response["Location"].startswith(SIGN_IN_PAGES)


# --- the resolver's device routes are the ones that take a device credential, and only that -----------------


def test_device_routes_are_exactly_the_routes_that_take_a_device_credential():
    problems = []
    for route in routes():
        view = getattr(route.callback, "cls", None) or getattr(route.callback, "view_class", None)
        overrides = getattr(route.callback, "initkwargs", None) or {}
        authentication = list(overrides.get("authentication_classes", getattr(view, "authentication_classes", [])))
        permissions = list(overrides.get("permission_classes", getattr(view, "permission_classes", [])))
        if route.name in DEVICE_ROUTES:
            if authentication != [DeviceTokenAuthentication] or permissions != [IsDevice]:
                problems.append(f"{route.name} must take a device token and nothing else: {authentication}")
        elif DeviceTokenAuthentication in authentication:
            problems.append(f"{route.name} takes a device token but is not in DEVICE_ROUTES")
    assert not problems, "\n".join(problems)


# --- REST, against one world per class ------------------------------------------------------------------------


@pytest.mark.django_db
class TestDeviceCredentialsOverRest:
    @pytest.fixture(autouse=True)
    def _fleet_staging(self, device_fleet, settings):
        settings.DELTA_STAGING_DIR = device_fleet.staging

    @pytest.mark.parametrize("name", OPERATOR_ROUTES)
    def test_a_device_token_opens_no_operator_endpoint_or_page(self, device_fleet, inventory, name):
        """Every method of every non-device route, aimed at real objects (the device itself, and another
        device where the route takes a device id), with the device token as ``Device`` and as ``Bearer``."""
        world, token = device_fleet.world, device_fleet.tokens["alpha"]
        route = inventory[name]
        targets = [world.targets(name)]
        if targets[0].get("pk") == world.alpha.id:
            targets.append({"pk": world.bravo.id})
        is_api = route.pattern.startswith("api/")
        before = db_state()
        failures = []
        for url in [route.url(**target) for target in targets]:
            for method in route.methods:
                body = world.bodies().get((name, method))
                if is_api:
                    for scheme in ("Device", "Bearer"):
                        client = APIClient()
                        client.credentials(HTTP_AUTHORIZATION=f"{scheme} {token}")
                        response = getattr(client, method)(url, body, format="json")
                        if not unauthenticated(response):
                            failures.append(f"{scheme}: {method.upper()} {url} {response.status_code}")
                else:
                    call = getattr(Client(), method)
                    response = call(url, body or {}, headers={"Authorization": f"Device {token}"})
                    if not refused(response):
                        failures.append(f"{method.upper()} {url} {response.status_code}")
        assert not failures, "a device token was not refused:\n" + "\n".join(failures)
        assert db_state() == before, db_changes(before, db_state())
        # The token itself is good: where it belongs, it works.
        assert as_device(token).get("/api/v1/device/").status_code == 200

    def test_a_device_token_opens_no_page_of_the_django_admin(self, device_fleet, inventory):
        token = device_fleet.tokens["alpha"]
        before = db_state()
        failures = []
        for route in [route for route in inventory.values() if route.is_django_admin]:
            for method in route.methods:
                response = getattr(Client(), method)(route.url(), {}, headers={"Authorization": f"Device {token}"})
                signs_in = route.name in PUBLIC_ROUTES and response.status_code in (200, 302)
                if not (refused(response) or signs_in):
                    failures.append(f"{method.upper()} {route.url()} {response.status_code}")
        assert not failures, "\n".join(failures)
        assert db_state() == before, db_changes(before, db_state())

    @pytest.mark.parametrize(("name", "method"), DEVICE_ROUTE_METHODS)
    def test_operator_credentials_open_no_device_endpoint(self, device_fleet, inventory, name, method):
        """Sessions and API tokens of every role, an API token under the ``Device`` scheme and a device
        token under ``Bearer``: a device endpoint takes a device's own token and nothing else."""
        world, alpha = device_fleet.world, device_fleet.world.alpha
        route = inventory[name]
        url = route.url(
            sha256=world.released.blob_sha256 if name == "device-blob" else world.bravo_delta.sha256,
            assignment_id=world.alpha_assignment.pk,
        )
        credentials = [("anonymous", APIClient())]
        for role in ("viewer", "operator", "admin"):
            credentials += world.api_clients(role)
        admin_token = APIClient()
        admin_token.credentials(HTTP_AUTHORIZATION=f"Device {world.api_tokens['admin']}")
        credentials += [
            ("admin API token as Device", admin_token),
            ("device token as Bearer", bearer(device_fleet.tokens["alpha"])),
        ]
        data = encode_delta(make_delta_tensors(world.adapter, seed=3))
        signed = sign_delta(
            alpha.key, data, device_id=alpha.id, adapter=world.adapter.name, base_version=1, num_samples=4, counter=7
        )
        bodies = {"device-heartbeat": {"seq": 1, "battery": 5.0}, "device-assignment-report": {"status": "installed"}}
        before, alpha_presence = db_state(), presence_of(alpha.id)
        failures = []
        for label, client in credentials:
            if method == "put":  # a device's signed upload, replayed by someone holding no device token
                response = upload(client, data, signed)
            else:
                response = getattr(client, method)(url, bodies.get(name), format="json")
            if not unauthenticated(response):
                failures.append(f"{label}: {response.status_code} {response.content[:120]!r}")
        assert not failures, f"{method.upper()} {url} was not refused:\n" + "\n".join(failures)
        assert db_state() == before, db_changes(before, db_state())
        assert presence_of(alpha.id) == alpha_presence
