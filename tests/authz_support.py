"""The authorization matrices' shared parts: the route inventory with who may use each route, a snapshot of
the database to prove a refused call changed nothing, and the world of real objects the calls aim at (used by
tests/fleet/test_role_matrix.py and tests/devices/test_device_authz_matrix.py)."""

from __future__ import annotations

import difflib
import itertools
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.urls import NoReverseMatch, get_resolver, reverse
from django.utils import timezone

FAST_PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


# --- the inventory: every route the resolver serves, and who may use it --------------------------------------


@dataclass(frozen=True)
class Route:
    """One URL pattern of the project, as the resolver holds it."""

    name: str  # the URL name with its namespace ("device-list", "frontend:devices"); unnamed: its pattern
    pattern: str
    methods: tuple[str, ...]  # lower case; a function view is asked with GET and POST
    arguments: tuple[str, ...]
    named: bool
    callback: object = field(compare=False, repr=False, default=None)  # what the resolver calls

    def url(self, **values) -> str:
        """The route's URL with ``values`` for its arguments and made-up ones (no such object) for the rest."""
        unknown = [name for name in self.arguments if name not in values and name not in MADE_UP_ARGUMENTS]
        assert not unknown, f"{self.name}: add a made-up value for {unknown} to MADE_UP_ARGUMENTS"
        choices = [[values[name]] if name in values else MADE_UP_ARGUMENTS[name] for name in self.arguments]
        for combination in itertools.product(*choices):
            kwargs = {name: str(value) for name, value in zip(self.arguments, combination, strict=True)}
            if not self.named:  # the admin's catch-all and redirects
                groups = r"\(\?P<(\w+)>[^)]*\)|<(?:\w+:)?(\w+)>"
                filled = re.sub(groups, lambda m, kw=kwargs: kw[m[1] or m[2]], self.pattern)
                return "/" + filled.replace("^", "").replace("$", "")
            try:
                return reverse(self.name, kwargs=kwargs)
            except NoReverseMatch:
                continue
        raise AssertionError(f"no URL for {self.name} with {values}")

    @property
    def is_django_admin(self) -> bool:
        return self.pattern.startswith("admin/")


MISSING_UUID = "6a1c1c52-8f1e-4a43-9d7b-3c2f50a1e001"
# Values for route arguments that name no object; the first one the route's converter accepts is used.
MADE_UP_ARGUMENTS = {
    "pk": [999999, MISSING_UUID],
    "assignment_id": [999999],
    "sha256": ["0" * 64],
    "action": ["start"],
    "app_label": ["accounts"],
    "object_id": [999999],
    "id": [999999],
    "content_type_id": [999999],
    "url": ["no-such-page/"],
}


def _methods(callback) -> tuple[str, ...]:
    view = getattr(callback, "cls", None) or getattr(callback, "view_class", None)
    if view is None:
        return ("get", "post")  # a function view answers any method unless it refuses it itself
    actions = getattr(callback, "actions", None)  # a viewset route: only the methods mapped to actions
    if actions:
        return tuple(m for m in actions if m in view.http_method_names and m not in ("head", "options"))
    return tuple(m for m in view.http_method_names if m not in ("head", "options") and hasattr(view, m))


def routes() -> list[Route]:
    """Every URL pattern of the project, from the resolver (so a new one cannot be left out)."""
    found: list[Route] = []

    def walk(patterns, prefix: str, namespace: str, arguments: tuple[str, ...]) -> None:
        for entry in patterns:
            names = arguments + tuple(entry.pattern.regex.groupindex)
            if hasattr(entry, "url_patterns"):
                inner = ":".join(part for part in (namespace, entry.namespace) if part)
                walk(entry.url_patterns, prefix + str(entry.pattern), inner, names)
                continue
            pattern = prefix + str(entry.pattern)
            name = f"{namespace}:{entry.name}" if namespace and entry.name else entry.name or pattern
            methods = _methods(entry.callback)
            found.append(Route(name, pattern, methods, names, entry.name is not None, entry.callback))

    walk(get_resolver().url_patterns, "", "", ())
    return found


VIEWER, OPERATOR, ADMIN = "viewer", "operator", "admin"
NOBODY = "nobody"  # the method is refused (405) whoever asks

# Open to anyone: probes, the API's description, how a device gets its credential (an enrollment token or
# its signature is checked inside), signing in and out.
PUBLIC_ROUTES = {
    "healthz",
    "readyz",
    "api-schema",
    "api-docs",
    "api-redoc",
    "enroll",
    "device-challenge",
    "device-token",
    "frontend:login",
    "frontend:logout",
    "admin:login",
    "admin:logout",  # signs nobody in: without a staff session it redirects to the admin's login
}

# Only a device credential (``Authorization: Device <token>``), never an operator's: see
# tests/devices/test_device_authz_matrix.py.
DEVICE_ROUTES = {
    "device-self": ("get",),
    "device-heartbeat": ("post",),
    "device-blob": ("get",),
    "device-delta": ("get", "put"),
    "device-assignment": ("get",),
    "device-assignment-report": ("post",),
}

# The REST API, by API token or session: the lowest role for each method.
API_ROLES = {
    "me": {"get": VIEWER},
    "user-list": {"get": ADMIN, "post": ADMIN},
    "user-detail": {"get": ADMIN, "patch": ADMIN},
    "api-token-list": {"get": VIEWER, "post": VIEWER},
    "api-token-detail": {"get": VIEWER},
    "api-token-revoke": {"post": VIEWER},
    "cohort-list": {"get": VIEWER, "post": ADMIN},
    "cohort-detail": {"get": VIEWER, "patch": ADMIN, "delete": ADMIN},
    "enrollment-token-list": {"get": VIEWER, "post": ADMIN},
    "enrollment-token-detail": {"get": VIEWER},
    "enrollment-token-revoke": {"post": ADMIN},
    "device-list": {"get": VIEWER},
    "device-detail": {"get": VIEWER, "patch": ADMIN},
    "device-approve": {"post": ADMIN},
    "device-reject": {"post": ADMIN},
    "device-quarantine": {"post": OPERATOR},
    "device-reactivate": {"post": OPERATOR},
    "device-retire": {"post": ADMIN},
    "base-model-list": {"get": VIEWER, "post": ADMIN},
    "base-model-detail": {"get": VIEWER},
    "adapter-list": {"get": VIEWER, "post": ADMIN},
    "adapter-detail": {"get": VIEWER},
    "adapter-versions": {"get": VIEWER},
    "adapter-seed": {"post": OPERATOR},
    "adapter-import-version": {"post": OPERATOR},
    "adapter-aggregation": {"put": OPERATOR},
    "adapter-version-list": {"get": VIEWER},
    "adapter-version-detail": {"get": VIEWER},
    "adapter-version-export": {"get": OPERATOR},
    "adapter-version-release": {"post": OPERATOR},
    "adapter-version-revoke": {"post": OPERATOR},
    "rollout-list": {"get": VIEWER, "post": OPERATOR},
    "rollout-detail": {"get": VIEWER},
    "rollout-assignments": {"get": VIEWER},
    "rollout-start": {"post": OPERATOR},
    "rollout-pause": {"post": OPERATOR},
    "rollout-resume": {"post": OPERATOR},
    "rollout-abort": {"post": OPERATOR},
    "rollout-rollback": {"post": OPERATOR},
    "round-list": {"get": VIEWER, "post": OPERATOR},
    "round-detail": {"get": VIEWER},
    "round-close": {"post": OPERATOR},
    "round-rerun": {"post": OPERATOR},
    "delta-list": {"get": VIEWER},
    "delta-detail": {"get": VIEWER},
    "system-status": {"get": VIEWER},
    "system-diagnostic": {"post": OPERATOR},
}

# Pages, by session (anonymous visitors are sent to the login page); GET and POST of each.
PAGE_ROLES = {
    "metrics": {"get": VIEWER, "post": VIEWER},  # or the METRICS_TOKEN; anonymous callers get a 401, not a redirect
    "frontend:overview": {"get": VIEWER, "post": VIEWER},
    "frontend:devices": {"get": VIEWER, "post": VIEWER},
    "frontend:device-bulk": {"get": NOBODY, "post": OPERATOR},
    "frontend:device-detail": {"get": VIEWER, "post": VIEWER},
    "frontend:device-action": {"get": NOBODY, "post": OPERATOR},
    "frontend:cohorts": {"get": VIEWER, "post": ADMIN},
    "frontend:enrollment-tokens": {"get": VIEWER, "post": ADMIN},
    "frontend:enrollment-token-revoke": {"get": NOBODY, "post": ADMIN},
    "frontend:models": {"get": VIEWER, "post": VIEWER},
    "frontend:adapter-detail": {"get": VIEWER, "post": VIEWER},
    "frontend:rounds": {"get": VIEWER, "post": OPERATOR},
    "frontend:round-detail": {"get": VIEWER, "post": VIEWER},
    "frontend:round-action": {"get": NOBODY, "post": OPERATOR},
    "frontend:rollouts": {"get": VIEWER, "post": VIEWER},
    "frontend:rollout-create": {"get": OPERATOR, "post": OPERATOR},
    "frontend:rollout-detail": {"get": VIEWER, "post": VIEWER},
    "frontend:rollout-action": {"get": NOBODY, "post": OPERATOR},
    "frontend:system": {"get": VIEWER, "post": VIEWER},
    "frontend:api-tokens": {"get": VIEWER, "post": VIEWER},
    "frontend:api-token-revoke": {"get": NOBODY, "post": VIEWER},
    "frontend:users": {"get": ADMIN, "post": ADMIN},
    "frontend:user-role": {"get": NOBODY, "post": ADMIN},
}

# Allowed calls that wait for the Celery workers (readiness pings them; the diagnostic needs one): their
# allowed side is covered by ENDPOINTS / PAGES above and tests/fleet/test_celery_worker.py.
WAITS_FOR_WORKERS = {
    ("system-status", "get"),
    ("system-diagnostic", "post"),
    ("frontend:system", "get"),
    ("frontend:system", "post"),
}


def routes_by_name() -> dict[str, Route]:
    return {route.name: route for route in routes()}


# --- the database, to prove a refused call changed nothing ----------------------------------------------------

PROJECT_APPS = ("accounts", "devices", "training")
# Written by a successful sign-in or token check even when the call is then refused; not what it asked for.
VOLATILE_FIELDS = {"accounts.User": {"last_login"}, "accounts.ApiToken": {"last_used_at"}}


def db_state() -> dict[str, list[tuple]]:
    """Every row of the project's models (but the sign-in bookkeeping above), ordered by primary key."""
    from django.apps import apps

    state = {}
    for model in apps.get_models():
        label = model._meta.label
        if model._meta.app_label not in PROJECT_APPS:
            continue
        skip = VOLATILE_FIELDS.get(label, set())
        fields = [column.attname for column in model._meta.concrete_fields if column.name not in skip]
        state[label] = list(model.objects.order_by("pk").values_list(*fields))
    return state


def db_changes(before: dict, after: dict) -> str:
    """What differs between two ``db_state()``s, readably ("" when nothing does)."""
    lines = []
    for label in sorted(before):
        if before[label] != after[label]:
            diff = difflib.unified_diff(list(map(repr, before[label])), list(map(repr, after[label])), lineterm="", n=0)
            lines.append(f"{label}:\n  " + "\n  ".join(list(diff)[2:12]))
    return "\n".join(lines)


# --- the world: one of everything, for the calls to aim at ----------------------------------------------------


@dataclass
class World:
    """A small fleet with one of every object, so a call that is refused but still acts leaves a trace."""

    users: dict  # role -> User
    api_tokens: dict  # role -> raw bearer token
    sessions: dict  # role -> session key of a signed-in browser
    other_token: object  # an ApiToken of a viewer who is never the caller
    cohort: object
    enrollment_token: object
    alpha: object  # EnrolledDevice, active: it runs the released version
    bravo: object  # EnrolledDevice, active: it is assigned the candidate and has uploaded a delta
    pending: object
    quarantined: object
    base_model: object
    adapter: object
    released: object  # AdapterVersion 1, assigned to alpha
    candidate: object  # AdapterVersion 2, assigned to bravo
    alpha_assignment: object
    bravo_assignment: object
    rollout: object  # a draft
    round: object  # collecting
    bravo_delta: object

    def targets(self, name: str) -> dict:
        """Real objects for a route's arguments: ones its action would change, where there is one."""
        devices = {
            "device-approve": self.pending,
            "device-reject": self.pending,
            "device-reactivate": self.quarantined,
            "frontend:device-action": self.alpha,
        }
        by_prefix = {
            "user-": self.users["viewer"].pk,
            "frontend:user-": self.users["viewer"].pk,
            "api-token-": self.other_token.pk,
            "frontend:api-token-": self.other_token.pk,
            "cohort-": self.cohort.pk,
            "enrollment-token-": self.enrollment_token.pk,
            "frontend:enrollment-token-": self.enrollment_token.pk,
            "device-": devices.get(name, self.alpha).id,
            "frontend:device-": devices.get(name, self.alpha).id,
            "base-model-": self.base_model.pk,
            "adapter-version-": self.candidate.pk,
            "adapter-": self.adapter.pk,
            "frontend:adapter-": self.adapter.pk,
            "rollout-": self.rollout.pk,
            "frontend:rollout-": self.rollout.pk,
            "round-": self.round.pk,
            "frontend:round-": self.round.pk,
            "delta-": self.bravo_delta.pk,
        }
        pk = next((value for prefix, value in by_prefix.items() if name.startswith(prefix)), None)
        values = {} if pk is None else {"pk": pk}
        if name == "frontend:round-action":
            values["action"] = "close"
        if name == "frontend:rollout-action":
            values["action"] = "start"
        if name == "frontend:device-bulk":
            values = {}
        return values

    def bodies(self) -> dict:
        """What a caller who should be refused sends: requests that would change something if obeyed."""
        password = "correct-horse-battery-9"
        return {
            ("user-list", "post"): {"username": "intruder", "role": "admin", "password": password},
            ("user-detail", "patch"): {"role": "admin"},
            ("api-token-list", "post"): {"name": "intruder"},
            ("cohort-list", "post"): {"name": "intruders"},
            ("cohort-detail", "patch"): {"description": "changed"},
            ("enrollment-token-list", "post"): {
                "name": "intruder",
                "cohort": self.cohort.name,
                "expires_at": "2099-01-01T00:00:00Z",
                "requires_approval": False,
            },
            ("device-detail", "patch"): {"name": "renamed", "labels": {"owned": "yes"}},
            ("base-model-list", "post"): {"name": "intruder-base", "family": "digits-cnn"},
            ("adapter-list", "post"): {
                "name": "intruder-lora",
                "base_model": self.base_model.name,
                "rank": 4,
                "alpha": 8.0,
            },
            ("adapter-seed", "post"): {"seed": 7},
            ("adapter-aggregation", "put"): {"aggregation": {"strategy": "median"}},
            ("rollout-list", "post"): {
                "version": self.candidate.pk,
                "cohort": self.cohort.name,
                "phases": [{"percent": 100}],
            },
            ("round-list", "post"): {"adapter": self.adapter.name},
            ("frontend:cohorts", "post"): {"name": "intruders"},
            ("frontend:enrollment-tokens", "post"): {
                "name": "intruder",
                "cohort": self.cohort.pk,
                "expires_in_hours": 1,
                "uses": 5,
            },
            ("frontend:device-bulk", "post"): {"action": "quarantine", "device": [self.alpha.id]},
            ("frontend:device-action", "post"): {"action": "quarantine", "reason": "intruder"},
            ("frontend:rounds", "post"): {"adapter": self.adapter.pk},
            ("frontend:rollout-create", "post"): {
                "version": self.candidate.pk,
                "cohort": self.cohort.pk,
                "phases": "100:0",
                "on_breach": "pause",
                "max_failure_rate": 0.2,
            },
            ("frontend:api-tokens", "post"): {"name": "intruder"},
            ("frontend:users", "post"): {"username": "intruder", "role": "admin", "password": password},
            ("frontend:user-role", "post"): {"role": "admin"},
        }

    def api_clients(self, role):
        """Clients acting as ``role`` on the API: with its API token and with its browser session."""
        from rest_framework.test import APIClient

        if role is None:
            return [("anonymous", APIClient())]
        by_token, by_session = APIClient(), APIClient()
        by_token.credentials(HTTP_AUTHORIZATION=f"Bearer {self.api_tokens[role]}")
        self._sign_in(by_session, role)
        return [(f"{role} token", by_token), (f"{role} session", by_session)]

    def page_client(self, role):
        """A browser signed in as ``role`` (anonymous for None); it posts forms, as the pages expect."""
        from django.test import Client

        return self._sign_in(Client(), role)

    def _sign_in(self, client, role):
        from django.conf import settings

        if role is not None:
            client.cookies[settings.SESSION_COOKIE_NAME] = self.sessions[role]
        return client


def _enroll(cohort, admin, name: str, status: str = "active"):
    from devices.services import device_enroll, enrollment_token_create
    from edge_agent.identity import public_key_b64
    from tests.conftest import EnrolledDevice

    key = Ed25519PrivateKey.generate()
    issued = enrollment_token_create(
        cohort=cohort,
        name=f"for {name}",
        expires_at=timezone.now() + timedelta(hours=1),
        uses=1,
        requires_approval=status == "pending",
        created_by=admin,
    )
    device = device_enroll(token=issued.raw, public_key=public_key_b64(key), name=name)
    if status == "quarantined":
        from devices.services import device_transition

        device = device_transition(device=device, action="quarantine", actor=admin)
    return EnrolledDevice(device=device, key=key)


def build_world() -> World:
    """Real services all the way; slow parts (two adapter versions) are why the matrices share one world."""
    from django.contrib.sessions.backends.db import SessionStore

    from accounts.services import api_token_create, user_create
    from devices.services import cohort_create, enrollment_token_create
    from tests.training.test_rounds import make_delta_tensors, receive
    from training.rollouts import assignment_create, rollout_create
    from training.rounds import round_open
    from training.services import adapter_create, base_model_create, version_create_seeded, version_transition

    users = {role: user_create(username=f"matrix-{role}", role=role) for role in (VIEWER, OPERATOR, ADMIN)}
    api_tokens = {role: api_token_create(user=user, name="matrix").raw for role, user in users.items()}
    sessions = {}
    for role, user in users.items():
        session = SessionStore()
        session["_auth_user_id"] = str(user.pk)
        session["_auth_user_backend"] = "django.contrib.auth.backends.ModelBackend"
        session["_auth_user_hash"] = user.get_session_auth_hash()
        session.create()
        sessions[role] = session.session_key
    bystander = user_create(username="matrix-bystander", role=VIEWER)
    other_token = api_token_create(user=bystander, name="not yours").token
    admin = users[ADMIN]

    cohort = cohort_create(name="matrix")
    enrollment_token = enrollment_token_create(
        cohort=cohort, name="spare", expires_at=timezone.now() + timedelta(days=1), uses=10, created_by=admin
    ).token
    alpha, bravo = _enroll(cohort, admin, "alpha"), _enroll(cohort, admin, "bravo")
    pending, quarantined = _enroll(cohort, admin, "pending", "pending"), _enroll(cohort, admin, "q", "quarantined")

    base_model = base_model_create(name="matrix-base", family="digits-cnn", family_config={"seed": 1}, actor=admin)
    adapter = adapter_create(name="matrix-lora", base_model=base_model, rank=4, alpha=8.0, actor=admin)
    adapter.cohorts.add(cohort)
    released = version_transition(version=version_create_seeded(adapter=adapter, seed=1), action="release", actor=admin)
    candidate = version_create_seeded(adapter=adapter, seed=2)
    alpha_assignment = assignment_create(device=alpha.device, version=released)
    bravo_assignment = assignment_create(device=bravo.device, version=candidate)
    for enrolled in (alpha, bravo):
        enrolled.device.refresh_from_db()
    rollout = rollout_create(version=released, cohort=cohort, phases=[{"percent": 100}], actor=users[OPERATOR])
    round_ = round_open(adapter=adapter, actor=users[OPERATOR])
    bravo_delta = receive(bravo, adapter, make_delta_tensors(adapter, seed=1), counter=1)
    return World(
        users=users,
        api_tokens=api_tokens,
        sessions=sessions,
        other_token=other_token,
        cohort=cohort,
        enrollment_token=enrollment_token,
        alpha=alpha,
        bravo=bravo,
        pending=pending,
        quarantined=quarantined,
        base_model=base_model,
        adapter=adapter,
        released=released,
        candidate=candidate,
        alpha_assignment=alpha_assignment,
        bravo_assignment=bravo_assignment,
        rollout=rollout,
        round=round_,
        bravo_delta=bravo_delta,
    )


@contextmanager
def rolled_back(django_db_blocker, blob_root: Path, **overrides):
    """Open a transaction for a class of tests and roll it back after them: each test then runs in a
    savepoint inside it (pytest-django's non-transactional tests), so the world is built once per class."""
    from django.conf import settings
    from django.db import transaction
    from django.test import override_settings

    storage = {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(blob_root)}}
    with (
        django_db_blocker.unblock(),
        override_settings(
            STORAGES={**settings.STORAGES, "default": storage, "blobs": storage},  # where tests/conftest.py puts them
            PASSWORD_HASHERS=FAST_PASSWORD_HASHERS,
            **overrides,
        ),
        transaction.atomic(),
    ):
        try:
            yield
        finally:
            transaction.set_rollback(True)
