"""``edge-agent enroll``: join a fleet with an enrollment token; pins the server's public key."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from edge_agent import __version__
from edge_agent.identity import STATE_FILE, AgentState, load_or_create_key, public_key_b64
from edge_agent.sysinfo import hardware_profile


class EnrollmentError(Exception):
    """The server refused the enrollment; the message is the server's explanation."""


def post_json(url: str, payload: dict, *, timeout: float = 30.0, headers: dict | None = None) -> dict:
    if not url.startswith(("http://", "https://")):
        raise EnrollmentError(f"not an http(s) URL: {url}")
    request = urllib.request.Request(  # noqa: S310  (scheme checked above)
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", "Accept": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            return json.load(response)
    except urllib.error.HTTPError as error:
        try:
            body = json.load(error)["error"]
            raise EnrollmentError(f"{body['message']} ({body['code']}, HTTP {error.code})") from None
        except (ValueError, KeyError, TypeError):
            raise EnrollmentError(f"HTTP {error.code} from {url}") from None


def enroll(
    *, home: Path, server: str, token: str, name: str, labels: dict | None = None, force: bool = False
) -> AgentState:
    server = server.rstrip("/")
    if not server.startswith(("http://", "https://")):
        raise EnrollmentError("--server must be an http:// or https:// URL")
    if (home / STATE_FILE).exists() and not force:
        raise EnrollmentError(f"already enrolled ({home / STATE_FILE}); use --force to enroll again")
    key = load_or_create_key(home)
    try:
        answer = post_json(
            f"{server}/api/v1/enroll/",
            {
                "token": token,
                "public_key": public_key_b64(key),
                "name": name,
                "hardware": hardware_profile(),
                "labels": labels or {},
                "agent_version": __version__,
            },
        )
    except urllib.error.URLError as error:
        raise EnrollmentError(f"cannot reach {server}: {error.reason}") from None
    state = AgentState(
        server=server,
        device_id=answer["device_id"],
        server_public_key=answer["server_public_key"],
        cohort=answer["cohort"],
        status=answer["status"],
        websocket_path=answer["websocket_path"],
        heartbeat_interval=int(answer["heartbeat_interval"]),
    )
    state.save(home)
    return state
