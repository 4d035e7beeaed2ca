"""The run command, as a new user starts it: services, migrations, demo login, web + worker + beat.

One test against the machine's PostgreSQL and Redis (a fresh database), one in the embedded mode (no
DATABASE_URL / REDIS_URL: the launcher starts its own PostgreSQL and Redis in the data folder).
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.e2e.support import drop_stack, free_port, stack_env, start_launcher, stop_launcher

pytestmark = pytest.mark.e2e


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


def _check_run(env: dict, tmp_path: Path) -> list[str]:
    port = free_port()
    launcher, output = start_launcher(env, port)
    try:
        status, report = _get_json(urllib.request.build_opener(), f"http://127.0.0.1:{port}/readyz")
        assert status == 200 and report["ok"] is True, report
        assert all(report["checks"][name]["ok"] for name in ("database", "redis", "worker"))
        login = next(line for line in output.lines if "sign in as" in line).split("sign in as ")[1].split(" / ")
        opener = _sign_in(port, login[0], login[1].strip())
        status, me = _get_json(opener, f"http://127.0.0.1:{port}/api/v1/me/")
        assert status == 200 and me["effective_role"] == "admin"
        login_file = tmp_path / "data" / "demo-login.txt"
        assert oct(login_file.stat().st_mode & 0o777) == "0o600"
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
