"""The run command, as a new user starts it: services, migrations, web + worker + beat, and how to sign in.

One test against the machine's PostgreSQL and Redis (a fresh database), one in the embedded mode (no
DATABASE_URL / REDIS_URL: the launcher starts its own PostgreSQL and Redis in the data folder). Both run
``--no-demo``: the launcher says how to create an operator (no demo login), and the command it prints works (an
account and an API token, through ``launcher exec`` while the product runs). ``--devices 0`` seeds the demo setup
and its login without a fleet.
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import shlex
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.e2e.support import ROOT, drop_stack, free_port, stack_env, start_launcher, stop_launcher, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def _get_json(opener, url: str) -> tuple[int, dict]:
    try:
        with opener.open(url, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def _sign_in(port: int, username: str, password: str):
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    base = f"http://127.0.0.1:{port}"
    opener.open(f"{base}/login/", timeout=10).read()
    csrf = next(cookie.value for cookie in jar if cookie.name == "csrftoken")
    form = f"username={username}&password={password}&csrfmiddlewaretoken={csrf}".encode()
    opener.open(urllib.request.Request(f"{base}/login/", data=form, headers={"Referer": f"{base}/login/"}), timeout=10)
    return opener


def _create_operator_as_printed(output, env: dict) -> tuple[str, str]:
    """Run the command the launcher printed for creating an operator (NAME filled in); returns its password and
    API token."""
    hint = next(line for line in output.lines if "to create one" in line)
    command = shlex.split(hint.split("to create one (with an API token): ", 1)[1].replace("NAME", "alice"))
    created = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert created.returncode == 0, created.stdout + created.stderr
    password = re.search(r"created admin 'alice' with password: (\S+)", created.stdout)[1]
    token = re.search(r"API token \(shown once\): (fpm_\S+)", created.stdout)[1]
    return password, token


def _check_run(env: dict, tmp_path: Path) -> list[str]:
    port = free_port()
    launcher, output = start_launcher(env, port)
    try:
        status, report = _get_json(urllib.request.build_opener(), f"http://127.0.0.1:{port}/readyz")
        assert status == 200 and report["ok"] is True, report
        assert all(report["checks"][name]["ok"] for name in ("database", "redis", "worker"))
        assert not any("sign in as" in line for line in output.lines), output.tail()  # --no-demo: no demo account
        assert any("sign in with an operator account" in line for line in output.lines), output.tail()
        password, token = _create_operator_as_printed(output, env)
        opener = _sign_in(port, "alice", password)
        status, me = _get_json(opener, f"http://127.0.0.1:{port}/api/v1/me/")
        assert status == 200 and me["effective_role"] == "admin"
        bearer = urllib.request.build_opener()
        bearer.addheaders = [("Authorization", f"Bearer {token}")]
        status, me = _get_json(bearer, f"http://127.0.0.1:{port}/api/v1/me/")
        assert status == 200 and me["username"] == "alice", me
        assert not (tmp_path / "data" / "demo-login.txt").exists()
    finally:
        left = stop_launcher(launcher)
    assert launcher.returncode == 0, output.tail()
    assert not left, f"processes outlived the launcher: {left}"
    assert any("[fleet] stopped" in line for line in output.lines)
    return output.lines


def test_run_command_with_the_machines_postgres_and_redis(tmp_path):
    env = stack_env(tmp_path)
    try:
        lines = _check_run(env, tmp_path)
        assert any("postgres: from DATABASE_URL" in line for line in lines)
    finally:
        drop_stack(env)


def test_run_command_embedded_mode_starts_and_stops_its_own_postgres_and_redis(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "CELERY_QUEUE")}
    env["FLEET_DATA_DIR"] = str(tmp_path / "data")
    lines = _check_run(env, tmp_path)
    assert any("postgres: embedded" in line for line in lines)
    assert any("redis: embedded" in line for line in lines)
    leftovers = [
        p.info
        for p in psutil.process_iter(["name", "cmdline"])
        if p.info["cmdline"] and str(tmp_path) in " ".join(p.info["cmdline"])
    ]
    assert not leftovers, leftovers


def test_devices_0_seeds_the_demo_setup_and_its_login_and_starts_no_fleet(tmp_path):
    env = stack_env(tmp_path)
    port = free_port()
    try:
        launcher, output = start_launcher(env, port, demo_devices=0)
        try:
            login = next(line for line in output.lines if "sign in as" in line).split("sign in as ")[1].split(" / ")
            opener = _sign_in(port, login[0], login[1].strip())
            status, adapters = _get_json(opener, f"http://127.0.0.1:{port}/api/v1/adapters/")
            assert status == 200 and [a["name"] for a in adapters["results"]] == ["digits-lora"], adapters
            assert adapters["results"][0]["latest_version"] is not None
            status, cohorts = _get_json(opener, f"http://127.0.0.1:{port}/api/v1/cohorts/")
            assert sorted(c["name"] for c in cohorts["results"]) == ["eu-phones", "us-wearables"]
            assert any("no simulated devices (--devices 0)" in line for line in output.lines), output.tail()
            assert not any(line.lstrip().startswith("demo |") for line in output.lines)  # no fleet process
            status, devices = _get_json(opener, f"http://127.0.0.1:{port}/api/v1/devices/")
            assert status == 200 and devices["count"] == 0
        finally:
            assert not stop_launcher(launcher)
        assert launcher.returncode == 0, output.tail()
    finally:
        drop_stack(env)


def _web_shutdown(line: str) -> bool:
    return line.lstrip().startswith("web |") and "Shutting down" in line


def test_ctrl_c_stops_the_demo_fleet_before_the_web_server_and_promptly(tmp_path):
    """The demo's agents stop while the server they talk to still answers: none of them logs a refused connection,
    and the fleet does not hold the stop up (it was killed after 20 s, its agents finishing passes one by one)."""
    env = stack_env(tmp_path)
    port = free_port()
    try:
        launcher, output = start_launcher(env, port, demo_devices=3)
        try:
            busy, _ = wait_for(lambda: sum(": trained on v" in line for line in output.lines) >= 1, 180)
            assert busy, output.tail()
        finally:
            began = len(output.lines)
            signalled = time.monotonic()
            assert not stop_launcher(launcher)
            took = time.monotonic() - signalled
        assert launcher.returncode == 0, output.tail()
        after = output.lines[began:]
        fleet_stopped = next(i for i, line in enumerate(after) if "[demo] fleet stopped" in line)
        web_stops = next(
            i for i, line in enumerate(after) if line.lstrip().startswith("web |") and "Shutting down" in line
        )
        assert fleet_stopped < web_stops, "\n".join(after)
        refused = [line for line in after if "refused" in line.lower() or "disconnected" in line]
        assert not refused, "\n".join(after)
        assert not [line for line in after if "did not stop in" in line], "\n".join(after)
        assert took < 20, f"stopping took {took:.0f}s\n" + "\n".join(after)
        print(f"stopped in {took:.1f}s")
    finally:
        drop_stack(env)


def test_the_demo_homes_are_kept_for_the_same_server_and_database_and_start_anew_for_another(tmp_path):
    """The demo devices' homes in the data folder outlive a run; started again on another port, the demo starts them
    anew with one line saying why (demo.fleet_demo), and no device is left calling the old port. Kept for the same
    server and database, reset for another database: tests/fleet/test_demo_homes.py (two launcher runs here, not
    four: each costs a minute of the suite)."""
    env = stack_env(tmp_path)
    port, moved = free_port(), free_port()
    homes = [tmp_path / "data" / "demo" / f"device-{i:02d}" for i in range(3)]

    def enrolled() -> list[str] | None:
        states = [home / "agent.json" for home in homes]
        return [json.loads(s.read_text())["device_id"] for s in states] if all(s.exists() for s in states) else None

    def run(stack: dict, on: int) -> tuple[list[str], list[str]]:
        """The device ids the fleet runs as, and what the demo said of its homes' binding."""
        launcher, output = start_launcher(stack, on, demo_devices=3)
        try:
            # homes are kept or removed before the fleet starts; removed ones then enroll again
            fleet, _ = wait_for(lambda: any("[demo] 3 devices:" in line for line in output.lines), 60)
            assert fleet, output.tail()
            ids, _ = wait_for(enrolled, 90)
            assert ids, output.tail()
        finally:
            stop_launcher(launcher)
        dead = [line for line in output.lines if "[demo]" in line and "refused" in line.lower()]
        assert not dead, "\n".join(dead)
        return ids, [line.split("[demo] ", 1)[1] for line in output.lines if "demo devices anew" in line]

    try:
        first, said = run(env, port)
        assert not said, said
        moved_ids, said = run(env, moved)
        assert len(said) == 1 and f"enrolled with http://127.0.0.1:{port}, not" in said[0], said
        assert "their 3 old devices here are retired" in said[0], said
        assert not set(moved_ids) & set(first)
    finally:
        drop_stack(env)
