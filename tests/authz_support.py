"""The authorization matrices' world: real objects for the calls to aim at, one of everything (``World``,
``build_world``), and a transaction per class of tests that rolls the world back after them (``rolled_back``).
The route inventory is in tests/authz_routes.py, the database snapshot in tests/authz_snapshot.py (all used by
tests/fleet/test_role_matrix.py and the device matrix, tests/devices/test_device_authz_*.py)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.utils import timezone

from tests.authz_routes import ADMIN, OPERATOR, VIEWER

FAST_PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


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
            ("adapter-personalization", "put"): {"personalization": {"method": "finetune"}},
            ("adapter-cohorts", "put"): {"cohorts": []},
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
            ("frontend:adapter-detail", "post"): {
                "method": "none",
                "lambda": 0.1,
                "epochs": 5,
                "lr": 0.01,
                "margin": 0.01,
                "min_val_samples": 10,
                "private_modules": "head",
            },
            ("frontend:adapter-cohorts", "post"): {},  # nothing ticked: the adapter would serve no cohort
            ("frontend:adapter-release-settings", "post"): {"auto_release": "on", "margin_points": "1"},
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
    from training.federation.rounds import round_open
    from training.registry.services import adapter_create, base_model_create, version_create_seeded, version_transition
    from training.rollouts.lifecycle import assignment_create, rollout_create

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
