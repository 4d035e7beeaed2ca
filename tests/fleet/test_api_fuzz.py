"""Fuzz every API operation against the API's own OpenAPI schema with schemathesis, all checks on: as each role
and as nobody, the device endpoints as a device, and chains of calls as an admin.

The schema comes from /api/schema/ of the WSGI application, and every request goes through the real
middleware, authentication and database, inside the test's transaction. A few deterministic examples per
operation and role (positive and negative data, with schemathesis' coverage cases) keep the module within a few
minutes; raise MAX_EXAMPLES and STATEFUL_SCENARIOS locally to dig deeper.
"""

from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from schemathesis.checks import positive_data_acceptance
from schemathesis.core.failures import FailureGroup
from schemathesis.generation.stateful import run_state_machine_as_test

ROLES = [None, "viewer", "operator", "admin"]
MAX_EXAMPLES = 8
STATEFUL_SCENARIOS = 20
STATEFUL_STEPS = 8

# Operations whose requests obey rules that no JSON schema can state, so a schema-valid request may rightly be
# refused with a 400; positive_data_acceptance ("schema-valid data is accepted") cannot hold for them.
RULES_BEYOND_THE_SCHEMA = {
    "POST /api/v1/api-tokens/": "expires_at must be in the future; user must name an existing account",
    "POST /api/v1/users/": "the username must be new; the password must pass the password validators",
    "POST /api/v1/cohorts/": "the name must be new",
    "PATCH /api/v1/cohorts/{id}/": "the name must be new",
    "POST /api/v1/enrollment-tokens/": "cohort must name an existing cohort; expires_at must be in the future",
    "PATCH /api/v1/devices/{id}/": "cohort must name an existing cohort; no control characters in the name or labels",
    "POST /api/v1/enroll/": "public_key must encode a point on the curve, canonically, not of small order; no "
    "control characters in the name, labels, agent_version or hardware",
    "POST /api/v1/base-models/": "the name must be new; family must name an importable model family",
    "POST /api/v1/adapters/": "base_model, cohorts and target modules must exist; aggregation settings valid together",
    "POST /api/v1/adapters/{id}/versions/import/": "adapter_model must be a safetensors file matching the adapter",
    "PUT /api/v1/adapters/{id}/aggregation/": "settings depend on each other (min_deltas ≤ buffer_size, ...)",
    "PUT /api/v1/adapters/{id}/personalization/": "private_modules must be the adapter's own modules",
    "PUT /api/v1/adapters/{id}/cohorts/": "cohorts must name existing cohorts, each once",
    "POST /api/v1/rollouts/": "version and cohort must exist; phase percents must rise",
    "POST /api/v1/rounds/": "adapter must name an existing adapter with a version",
    "POST /api/v1/device/heartbeat/": "metric names are at most 64 characters (OpenAPI 3.0 cannot bound key length); "
    "personal.updated_at at most a day ahead of the server's clock",
    "POST /api/v1/device/assignments/{assignment_id}/report/": "the same rule for metric names",
}

# Known and not fixed yet: the deltas list's round and device filters look the id up and refuse an unknown one
# with a 400 instead of listing nothing (a plain number filter would cap the id below what the schema allows).
KNOWN_GAPS = {"GET /api/v1/deltas/": [positive_data_acceptance]}

schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application())
# No NUL characters in generated strings: PostgreSQL cannot store them, so every string field refuses them with a
# 400, a rule the schema does not repeat on each field.
schema.config.generation.update(max_examples=MAX_EXAMPLES, deterministic=True, database="none", allow_x00=False)


@pytest.fixture
def _fast_password_hashing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def _in_process_requests(db):
    """The WSGI handler runs in this thread, on this test's connection and transaction: keep Django from closing
    that connection when each request starts and ends (its test client does the same)."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.fixture
def fleet(celery_worker_process, _fast_password_hashing, _in_process_requests, cohort, adapter, enrolled):
    """Something for the API to work on: a cohort, a device in it, an adapter on a base model. The worker answers
    the system status and diagnostic endpoints, which otherwise wait for one."""
    enrolled()


def _bearer(user) -> dict:
    from accounts.services import api_token_create

    return {"Authorization": f"Bearer {api_token_create(user=user, name='fuzz').raw}"}


@pytest.fixture(params=ROLES, ids=lambda role: role or "anonymous")
def auth_headers(request, fleet, make_user):
    return _bearer(make_user(request.param)) if request.param else {}


@pytest.fixture
def admin_headers(fleet, make_user):
    return _bearer(make_user("admin"))


@pytest.fixture
def device_headers(fleet, enrolled):
    """A device's own token (``Authorization: Device ...``), through the real signed challenge."""
    from devices.identity import rest_challenge_create, rest_token_issue
    from edge_agent.protocol import sign, token_request_payload

    device = enrolled()
    nonce = rest_challenge_create(device_id=device.id)
    signature = sign(device.key, token_request_payload(nonce=nonce, device_id=device.id))
    issued = rest_token_issue(device_id=device.id, nonce=nonce, signature=signature, protocol=2)
    return {"Authorization": f"Device {issued.token}"}


def _excluded_checks(case) -> list:
    excluded = list(KNOWN_GAPS.get(case.operation.label, []))
    if case.operation.label in RULES_BEYOND_THE_SCHEMA:
        excluded.append(positive_data_acceptance)
    return excluded


@schema.parametrize()
@hypothesis.settings(suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
def test_api_conforms_to_its_schema(case, auth_headers):
    case.call_and_validate(headers=auth_headers, excluded_checks=_excluded_checks(case))


# What a device calls as itself. The delta upload is fuzzed by tests/training/test_upload_fuzz.py, with
# envelopes and signatures schemathesis cannot make.
device_schema = schema.include(path_regex=r"^/api/v1/device/").exclude(
    method="PUT", path="/api/v1/device/deltas/{sha256}/"
)


@device_schema.parametrize()
@hypothesis.settings(suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
def test_device_api_conforms_to_its_schema(case, device_headers):
    case.call_and_validate(headers=device_headers, excluded_checks=_excluded_checks(case))


def test_api_workflows_keep_their_resources_consistent(admin_headers):
    """Chains of calls along the links schemathesis infers (create, then read, change or delete what was made), so
    the checks that need an earlier response run too: use_after_free, ensure_resource_availability."""
    failures = []

    class Workflow(schema.as_state_machine()):
        def get_call_kwargs(self, case):
            return {"headers": admin_headers}

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            try:
                case.validate_response(
                    response,
                    additional_checks=additional_checks,
                    excluded_checks=_excluded_checks(case),
                    headers=admin_headers,  # so ignored_auth knows these credentials are real, not generated
                    transport_kwargs=kwargs or None,
                    recorder=self.recorder,
                )
            except FailureGroup as failure:
                failures.append(failure)
                raise

    settings = hypothesis.settings(
        max_examples=STATEFUL_SCENARIOS,
        stateful_step_count=STATEFUL_STEPS,
        derandomize=True,
        database=None,
        deadline=None,
        # No shrinking: replaying a scenario against a database it already changed is not the same scenario
        # (schemathesis' own state machine settings do the same).
        phases=[hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    try:
        run_state_machine_as_test(Workflow, settings=settings)
    except hypothesis.errors.Flaky:
        # Hypothesis runs a failing scenario again to report it, and the second run, on a changed database,
        # differs. Report the failure itself, as schemathesis' own runner does; a Flaky without one is only that.
        if failures:
            raise failures[0] from None
