"""The operator-side steps over the product's REST API, with an API token (``Authorization: Bearer fpm_...``).

The token's user must be an admin: enrollment tokens, cohorts and adapter cohorts are fleet settings. On first
use it creates, under a fresh suffix, a cohort, a base model (``digits-cnn``, the family's seeded weights), an
adapter on it serving the cohort, and version 1 from a seed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any


class OperatorError(Exception):
    pass


class RestOperator:
    def __init__(self, server_url: str, api_token: str, *, family: str = "digits-cnn", rank: int = 2):
        self.base_url = server_url.rstrip("/")
        self.api_token = api_token
        self.family = family
        self.rank = rank
        self.suffix = uuid.uuid4().hex[:8]
        self.cohort = f"conformance-{self.suffix}"
        self.version_id: int | None = None

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method)  # noqa: S310
        request.add_header("Authorization", f"Bearer {self.api_token}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 (the server under test)
                raw = response.read()
        except urllib.error.HTTPError as error:
            raise OperatorError(f"{method} {path}: HTTP {error.code}: {error.read()[:500]!r}") from None
        return json.loads(raw) if raw else None

    def setup(self) -> None:
        if self.version_id is not None:
            return
        self.call("POST", "/api/v1/cohorts/", {"name": self.cohort})
        base = self.call("POST", "/api/v1/base-models/", {"name": f"conf-base-{self.suffix}", "family": self.family})
        adapter = self.call(
            "POST",
            "/api/v1/adapters/",
            {
                "name": f"conf-{self.suffix}",
                "base_model": base["name"],
                "rank": self.rank,
                "alpha": 2.0 * self.rank,
                "cohorts": [self.cohort],
            },
        )
        version = self.call("POST", f"/api/v1/adapters/{adapter['id']}/versions/seed/", {"seed": 1})
        self.version_id = version["id"]

    def enrollment_token(self) -> str:
        self.setup()
        expires = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        issued = self.call(
            "POST",
            "/api/v1/enrollment-tokens/",
            {"name": "conformance", "cohort": self.cohort, "expires_at": expires, "requires_approval": False},
        )
        return issued["token"]

    def start_rollout(self, device_id: str) -> None:
        self.setup()
        rollout = self.call(
            "POST",
            "/api/v1/rollouts/",
            {"version": self.version_id, "cohort": self.cohort, "phases": [{"percent": 100, "min_soak_seconds": 0}]},
        )
        self.call("POST", f"/api/v1/rollouts/{rollout['id']}/start/", {})
