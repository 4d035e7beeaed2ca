"""``python -m fleet.serve`` (the production image's CMD) becomes uvicorn with the product's flags, and serves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.e2e.support import free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_python_m_fleet_serve_execs_uvicorn_with_the_flags_and_serves(tmp_path):
    port = free_port()
    env = {**os.environ, "FLEET_DATA_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "fleet.serve", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--forwarded-allow-ips", "*"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline, status = time.monotonic() + 60, None
        while status != 200:
            assert process.poll() is None, f"fleet.serve exited:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no answer on /healthz:\n{log_path.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:  # noqa: S310
                    status = response.status
            except OSError:
                time.sleep(0.2)
        # The same process, now uvicorn itself (exec: signals from the container runtime reach it directly).
        command = psutil.Process(process.pid).cmdline()
        assert command[1:4] == ["-m", "uvicorn", "fleet.asgi:application"], command
        joined = " ".join(command)
        for flags in (
            "--host 127.0.0.1",
            f"--port {port}",
            "--workers 1",
            "--ws wsproto",
            "--ws-ping-interval 60 --ws-ping-timeout 30",
            "--loop uvloop --http httptools --lifespan off --no-access-log",
            "--proxy-headers --forwarded-allow-ips *",
        ):
            assert flags in joined, command
        assert "--timeout-graceful-shutdown" not in command  # the image never had it; the launcher passes 10
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
