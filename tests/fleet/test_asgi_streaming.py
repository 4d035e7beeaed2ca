"""Streamed responses under the real ASGI server: a device's artifact download (whole and resumed with a range) and
static files (WhiteNoise) arrive whole, and the server never warns "StreamingHttpResponse must consume synchronous
iterators" (it did for each, and read the whole body into memory first; fleet/asgi_streaming.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.asgi_server import asgi_server
from training.registry.blobs import blob_read
from training.registry.services import version_create_seeded
from training.rollouts.lifecycle import assignment_create

WARNING = "StreamingHttpResponse must consume"


def _get(url: str, **headers) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers=headers)  # noqa: S310 (our own server)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
            return response.status, {k.title(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.title(): v for k, v in error.headers.items()}, error.read()


@pytest.mark.django_db(transaction=True)
def test_streamed_responses_under_uvicorn_arrive_whole_and_never_warn(
    adapter, cohort, enrolled, device_token, tmp_path, shared_blob_root
):
    adapter.cohorts.add(cohort)
    version = version_create_seeded(adapter=adapter, seed=3)
    device = enrolled("active")
    assignment_create(device=device.device, version=version)
    data = blob_read(version.blob_sha256)
    with asgi_server("asgi-streaming", tmp_path, BLOB_ROOT=str(shared_blob_root)) as server:
        auth = {"Authorization": f"Device {device_token(device)}"}
        blob = f"{server.url}/api/v1/device/blobs/{version.blob_sha256}/"
        status, headers, body = _get(blob, **auth)
        assert status == 200 and body == data and headers["Content-Length"] == str(len(data))
        status, headers, body = _get(blob, Range="bytes=1000-", **auth)
        assert status == 206 and body == data[1000:]
        assert headers["Content-Range"] == f"bytes 1000-{len(data) - 1}/{len(data)}"

        status, headers, css = _get(f"{server.url}/static/frontend/app.css")
        assert status == 200 and b":root" in css
        status, _, part = _get(f"{server.url}/static/frontend/app.css", Range="bytes=0-9")
        assert status == 206 and part == css[:10]
        if "Etag" in headers:
            assert _get(f"{server.url}/static/frontend/app.css", **{"If-None-Match": headers["Etag"]})[0] == 304
        status, _, icon = _get(f"{server.url}/favicon.ico")
        assert status == 200 and icon[:4] == b"\x00\x00\x01\x00"
        status, headers, body = _get(f"{server.url}/api/v1/no-such-thing/", Accept="text/html")  # DEBUG is on here
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    log = server.log_path.read_text()
    assert WARNING not in log, log[-3000:]
