"""A device's whole life against the real product: enroll, wait for approval, connect, survive a server
restart, go offline when it dies.

Real processes only: the launcher (uvicorn + Celery worker + beat) on the machine's PostgreSQL and Redis
(a fresh database, a unique Redis prefix), an admin API token made through the product's own services,
the REST API over HTTP, and `python -m edge_agent` as a device would run it. Presence is sped up with
HEARTBEAT_INTERVAL_SECONDS=1, DEVICE_OFFLINE_AFTER_SECONDS=4 and PRESENCE_FLUSH_SECONDS=1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.e2e.support import (
    ROOT,
    drop_stack,
    free_port,
    kill,
    spawn,
    stack_env,
    start_launcher,
    stop_launcher,
    wait_for,
)

HEARTBEAT_INTERVAL = 1
OFFLINE_AFTER = 4
FLUSH_EVERY = 1
MAX_BACKOFF = 2

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


# --- processes ----------------------------------------------------------------------------------------------


def _agent(home: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edge_agent", "--home", str(home), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _agent_status(home: Path) -> dict:
    result = _agent(home, "status", timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


# --- the REST API over HTTP ---------------------------------------------------------------------------------


class _Api:
    def __init__(self, port: int, token: str):
        self.base = f"http://127.0.0.1:{port}/api/v1"
        self.token = token

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(  # noqa: S310  (our own http URL)
            self.base + path,
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers={
                "Authorization": f"Bearer {self.token}",
                "Accept": "application/json",
                **({"Content-Type": "application/json"} if body is not None else {}),
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
                return response.status, json.load(response)
        except urllib.error.HTTPError as error:
            raw = error.read()
            try:
                return error.code, json.loads(raw)
            except ValueError:
                return error.code, {"raw": raw.decode(errors="replace")[:500]}

    def device(self, device_id: str) -> dict:
        status, body = self.call("GET", f"/devices/{device_id}/")
        assert status == 200, body
        return body


def _say(message: str) -> None:
    print(f"[e2e] {message}", flush=True)


def _timestamp(text: str | None) -> float:
    return datetime.fromisoformat(text).timestamp() if text else 0.0


# --- the test -----------------------------------------------------------------------------------------------


def test_agent_enrolls_waits_for_approval_survives_a_server_restart_and_goes_offline_when_killed(tmp_path):
    env = stack_env(
        tmp_path,
        HEARTBEAT_INTERVAL_SECONDS=str(HEARTBEAT_INTERVAL),
        DEVICE_OFFLINE_AFTER_SECONDS=str(OFFLINE_AFTER),
        PRESENCE_FLUSH_SECONDS=str(FLUSH_EVERY),
    )
    port = free_port()
    home = tmp_path / "agent-home"  # does not exist yet: enrollment creates it
    admin_name = f"e2e-admin-{uuid.uuid4().hex[:6]}"

    launcher = agent = None
    launcher_output = agent_output = None
    try:
        # 1. The product, as `make run` starts it.
        launcher, launcher_output = start_launcher(env, port)

        # 2. An admin and their API token, through the product's own services; the rest over HTTP.
        shell = subprocess.run(
            [
                sys.executable,
                "manage.py",
                "shell",
                "-c",
                "from accounts.services import api_token_create, user_create; "
                f"user = user_create(username={admin_name!r}, role='admin'); "
                "print('TOKEN=' + api_token_create(user=user, name='e2e').raw)",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shell.returncode == 0, shell.stdout + shell.stderr
        api_token = next(line for line in shell.stdout.splitlines() if line.startswith("TOKEN=")).split("=", 1)[1]
        api = _Api(port, api_token)

        status, cohort = api.call("POST", "/cohorts/", {"name": "e2e-lab", "description": "agent lifecycle"})
        assert status == 201, cohort
        expires = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        status, issued = api.call(
            "POST",
            "/enrollment-tokens/",
            {"cohort": "e2e-lab", "name": "lab bench", "expires_at": expires, "requires_approval": True},
        )
        assert status == 201, issued
        assert issued["requires_approval"] is True and issued["token"].startswith("fet_"), issued

        # 3. Enrollment: a pending device with a private key only its owner can read.
        enrolled = _agent(
            home, "enroll", "--server", f"http://127.0.0.1:{port}", "--token", issued["token"], "--name", "bench-1"
        )
        assert enrolled.returncode == 0, enrolled.stdout + enrolled.stderr
        assert "(status: pending)" in enrolled.stdout, enrolled.stdout
        assert oct((home / "device_key.pem").stat().st_mode & 0o777) == "0o600"
        assert oct((home / "agent.json").stat().st_mode & 0o777) == "0o600"
        device_id = json.loads((home / "agent.json").read_text())["device_id"]

        status, listing = api.call("GET", "/devices/")
        assert status == 200, listing
        listed = {row["id"]: row for row in listing["results"]}
        assert device_id in listed, listing
        assert listed[device_id]["status"] == "pending"
        assert listed[device_id]["online"] is False
        assert listed[device_id]["cohort"] == "e2e-lab"
        assert listed[device_id]["name"] == "bench-1"

        # 4. `edge-agent run` while pending: refused, retried, never online.
        agent, agent_output = spawn(
            [sys.executable, "-m", "edge_agent", "--home", str(home), "run", "--max-backoff", str(MAX_BACKOFF)],
            env={k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")},
        )

        def refused():
            connection = _agent_status(home)["connection"]
            return connection if "device_pending" in (connection.get("error") or "") else None

        refusal, _ = wait_for(refused, timeout=60, interval=0.5)  # each status read starts a process (torch)
        assert refusal is not None, "the pending agent never recorded a refusal:\n" + agent_output.tail()
        assert refusal["connected"] is False
        assert refusal["retry_in"] <= MAX_BACKOFF, refusal
        # The inbox is there from the first run, and the agent says where (the application needs no mkdir).
        assert (home / "inbox").is_dir(), agent_output.tail()
        assert any(f"files dropped in {home / 'inbox'}" in line for line in agent_output.lines), agent_output.tail()
        watch_until = time.monotonic() + OFFLINE_AFTER  # several flushes and retries
        while time.monotonic() < watch_until:
            device = api.device(device_id)
            assert device["status"] == "pending"
            assert device["online"] is False, "a pending device showed up online: " + json.dumps(device)
            time.sleep(0.5)
        assert agent.poll() is None, "the agent gave up while pending:\n" + agent_output.tail()
        assert any("refused" in line and "device_pending" in line for line in agent_output.lines), agent_output.tail()

        # Approve: the agent, retrying every <= MAX_BACKOFF seconds, connects; the flush marks it online.
        status, approved = api.call("POST", f"/devices/{device_id}/approve/", {"reason": "e2e bench device"})
        assert status == 200, approved
        assert approved["status"] == "active"
        online, waited = wait_for(lambda: (d := api.device(device_id))["online"] and d, timeout=10)
        assert online, f"not online within 10 s of approval:\n{agent_output.tail()}\n{launcher_output.tail(30)}"
        _say(f"online {waited:.1f}s after approval")
        connection, _ = wait_for(lambda: (c := _agent_status(home)["connection"]).get("connected") and c, timeout=5)
        assert connection and connection["device_status"] == "active", connection
        seen, _ = wait_for(lambda: api.device(device_id)["last_seen_at"], timeout=5)
        assert seen, "an online device has no last_seen_at"
        seen_before_restart = _timestamp(seen)

        # 5. Stop the whole server; the agent notices and keeps retrying.
        left = stop_launcher(launcher)
        assert launcher.returncode == 0, launcher_output.tail()
        assert not left, f"launcher children outlived it: {left}"
        stopped_at = time.time()
        assert agent.poll() is None, "the agent exited when the server went away:\n" + agent_output.tail()
        dropped, _ = wait_for(lambda: _agent_status(home)["connection"].get("connected") is False, timeout=10)
        assert dropped, "the agent still says connected with the server down:\n" + agent_output.tail()

        # Same port, same database and data folder: the agent comes back by itself.
        launcher, launcher_output = start_launcher(env, port)
        reconnected, waited = wait_for(
            lambda: (c := _agent_status(home)["connection"]).get("connected") and c.get("since", 0) > stopped_at and c,
            timeout=15,
        )
        assert reconnected, "the agent did not reconnect within 15 s of the restart:\n" + "\n".join(
            [agent_output.tail(), launcher_output.tail(30)]
        )
        assert reconnected["device_status"] == "active", reconnected
        _say(f"agent reconnected {waited:.1f}s after the restarted server was ready")
        fresh, waited = wait_for(
            lambda: (d := api.device(device_id))["online"] and _timestamp(d["last_seen_at"]) > stopped_at and d,
            timeout=15,
        )
        assert fresh, f"no fresh presence after the restart: {api.device(device_id)}\n{launcher_output.tail(30)}"
        assert _timestamp(fresh["last_seen_at"]) > seen_before_restart
        status_output = _agent(home, "status")
        assert '"connected": true' in status_output.stdout, status_output.stdout

        # 6. The agent dies without closing its socket itself: offline within the horizon plus a flush or two.
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        offline, waited = wait_for(lambda: not api.device(device_id)["online"], timeout=OFFLINE_AFTER + 4)
        assert offline, f"still online {OFFLINE_AFTER + 4} s after the agent was killed: {api.device(device_id)}"
        _say(f"offline {waited:.1f}s after the agent was killed")

        events = api.device(device_id)["recent_events"]
        by_kind: dict[str, list[dict]] = {}
        for event in events:
            by_kind.setdefault(event["kind"], []).append(event)
        assert {"enrolled", "approved", "online", "offline"} <= set(by_kind), [e["kind"] for e in events]
        assert by_kind["enrolled"][0]["actor_label"] == "device"
        assert [e["actor_label"] for e in by_kind["approved"]] == [admin_name], by_kind["approved"]
        assert by_kind["approved"][0]["detail"] == {"from": "pending", "to": "active", "reason": "e2e bench device"}
        assert events[0]["kind"] == "offline", [e["kind"] for e in events]  # newest first: the kill is last
        first_online = min(_timestamp(e["created_at"]) for e in by_kind["online"])
        assert first_online >= _timestamp(by_kind["approved"][0]["created_at"]), "online before approval"
    finally:
        kill(agent)
        if launcher is not None:
            stop_launcher(launcher)
        drop_stack(env)
