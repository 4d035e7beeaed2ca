"""``edge-agent enroll``: join a fleet with an enrollment token; pins the server's public key."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from pathlib import Path
from time import sleep

from edge_agent import __version__, bounded_json
from edge_agent.identity import STATE_FILE, AgentState, load_or_create_key, public_key_b64
from edge_agent.sysinfo import hardware_profile

logger = logging.getLogger(__name__)


class EnrollmentError(Exception):
    """The server refused the enrollment; the message is the server's explanation."""

    def __init__(self, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after  # seconds the server asked to wait (HTTP 429), if it said


# A refusal for going too fast (HTTP 429) is waited out and tried again, this many times, when the server asks
# for at most MAX_WAIT_SECONDS; a longer wait is reported with how long.
RATE_LIMIT_RETRIES = 3
MAX_WAIT_SECONDS = 120.0


def _explained(error: urllib.error.HTTPError, url: str) -> EnrollmentError:
    """The server's error body in words: its message, the fields it names, its code, and when to try again."""
    retry_after = _seconds(error.headers.get("Retry-After"))
    try:
        body = bounded_json.loads(error.read())["error"]
        message, code = str(body["message"]), str(body["code"])
    except (ValueError, KeyError, TypeError):
        return EnrollmentError(f"HTTP {error.code} from {url}", retry_after=retry_after)
    details = body.get("details") if isinstance(body.get("details"), dict) else {}
    fields = "; ".join(
        f"{name}: {' '.join(map(str, problems)) if isinstance(problems, list) else problems}"
        for name, problems in details.items()
    )
    wait = f"; try again in {retry_after:.0f} s" if retry_after is not None else ""
    return EnrollmentError(
        f"{message}{f' ({fields})' if fields else ''} [{code}, HTTP {error.code}]{wait}", retry_after=retry_after
    )


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


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
            return bounded_json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise _explained(error, url) from None


def enroll(
    *, home: Path, server: str, token: str, name: str, labels: dict | None = None, force: bool = False
) -> AgentState:
    server = server.rstrip("/")
    if not server.startswith(("http://", "https://")):
        raise EnrollmentError("--server must be an http:// or https:// URL")
    if (home / STATE_FILE).exists() and not force:
        raise EnrollmentError(f"already enrolled ({home / STATE_FILE}); use --force to enroll again")
    if not token.strip():
        raise EnrollmentError("--token is empty: pass the enrollment token an operator created (fet_...)")
    key = load_or_create_key(home)
    body = {
        "token": token.strip(),
        "public_key": public_key_b64(key),
        "name": name,
        "hardware": hardware_profile(),
        "labels": labels or {},
        "agent_version": __version__,
    }
    for attempt in range(RATE_LIMIT_RETRIES + 1):
        try:
            answer = post_json(f"{server}/api/v1/enroll/", body)
            break
        except EnrollmentError as refused:
            wait = refused.retry_after
            if wait is None or wait > MAX_WAIT_SECONDS or attempt == RATE_LIMIT_RETRIES:
                raise
            logger.warning("the server asks to wait %.0f s before enrolling again; waiting", wait)
            sleep(wait)
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
