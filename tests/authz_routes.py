"""The authorization matrices' route inventory: every route the URL resolver serves (``routes()``, so a new
route cannot be left out) and who may use each one: the public routes, the device routes, and the lowest role
for each method of the API and of the pages (used by tests/fleet/test_role_matrix.py and the device matrix,
tests/devices/test_device_authz_*.py)."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from django.urls import NoReverseMatch, get_resolver, reverse


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
    "favicon",
    "healthz",
    "readyz",
    "api-schema",
    "api-docs",
    "api-redoc",
    "protocol-asyncapi",
    "protocol-docs",
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
    "device-delta": ("get", "put", "delete"),
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
    "device-personalization": {"get": VIEWER},
    "base-model-list": {"get": VIEWER, "post": ADMIN},
    "base-model-detail": {"get": VIEWER},
    "base-model-modules": {"get": VIEWER},
    "adapter-list": {"get": VIEWER, "post": ADMIN},
    "adapter-detail": {"get": VIEWER},
    "adapter-versions": {"get": VIEWER},
    "adapter-seed": {"post": OPERATOR},
    "adapter-import-version": {"post": OPERATOR},
    "adapter-aggregation": {"put": OPERATOR},
    "adapter-personalization": {"get": VIEWER, "put": OPERATOR},
    "adapter-cohorts": {"get": VIEWER, "put": ADMIN},
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
    "frontend:models": {"get": VIEWER, "post": ADMIN},
    "frontend:adapters": {"get": VIEWER, "post": VIEWER},  # a redirect to the models page
    "frontend:adapter-detail": {"get": VIEWER, "post": OPERATOR},  # a POST changes the personalization setting
    "frontend:adapter-cohorts": {"get": NOBODY, "post": ADMIN},
    "frontend:adapter-release-settings": {"get": NOBODY, "post": OPERATOR},
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
