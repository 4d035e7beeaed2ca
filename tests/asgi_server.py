"""A real uvicorn process serving ``fleet.asgi:application`` from the test database and this run's Redis
namespace, for tests that talk to the product as a client would (a browser, a WebSocket client, another
language's device). Each test commits its rows (``transactional_db``) so the server sees them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleet.pytest_plugin import RUN_ID
from tests.conftest import ROOT, _test_database_url
from tests.e2e.support import free_port


@dataclass(frozen=True)
class AsgiServer:
    url: str  # http://127.0.0.1:<port>
    blob_root: Path
    staging_dir: Path
    log_path: Path

    @property
    def ws_url(self) -> str:
        return "ws" + self.url[len("http") :]


@contextmanager
def asgi_server(name: str, tmp_root: Path, **env_overrides: str) -> Iterator[AsgiServer]:
    """Start uvicorn (``name`` labels its log in tests/artifacts), wait for /healthz, stop it afterwards."""
    port = free_port()
    blob_root, staging = tmp_root / "blobs", tmp_root / "uploads"
    env = {
        **os.environ,
        "DATABASE_URL": _test_database_url(),
        "DATABASE_CONN_MAX_AGE": "0",
        "BLOB_ROOT": str(blob_root),
        "DELTA_STAGING_DIR": str(staging),
        "PYTHONUNBUFFERED": "1",
        **env_overrides,
    }
    log_path = ROOT / "tests" / "artifacts" / f"uvicorn-{name}-{RUN_ID}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "fleet.asgi:application", "--host", "127.0.0.1", "--port", str(port),
             "--ws", "wsproto", "--lifespan", "off", "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1) as response:  # noqa: S310 (our own server)
                if response.status == 200:
                    break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"uvicorn did not come up:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    try:
        yield AsgiServer(url=url, blob_root=blob_root, staging_dir=staging, log_path=log_path)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
