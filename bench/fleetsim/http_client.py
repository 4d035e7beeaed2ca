"""A minimal asyncio HTTP/1.1 client (one connection per request, ``Connection: close``) for thousands of
simulated agents in one process: far less CPU per request than a general client, which matters when the
simulator shares the machine's two cores with the server it measures."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body) if self.body else None

    @property
    def error_code(self) -> str:
        """The product's ``{"error": {"code"}}``, else the status."""
        try:
            return str(self.json()["error"]["code"])
        except (ValueError, TypeError, KeyError):
            return f"http {self.status}"


class HttpError(Exception):
    def __init__(self, response: Response, what: str):
        super().__init__(f"{what}: HTTP {response.status} {response.body[:300]!r}")
        self.response = response


def _dechunk(body: bytes) -> bytes:
    out, position = bytearray(), 0
    while True:
        end = body.index(b"\r\n", position)
        size = int(body[position:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[end + 2 : end + 2 + size]
        position = end + 2 + size + 2


async def request(
    base_url: str,
    method: str,
    path: str,
    *,
    body: bytes | memoryview | None = None,
    json_body=None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> Response:
    parts = urlsplit(base_url)
    host, port = parts.hostname, parts.port or 80
    if json_body is not None:
        body = json.dumps(json_body).encode()
        headers = {"Content-Type": "application/json", **(headers or {})}
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(head)
            if body is not None:
                writer.write(body)
            await writer.drain()
            raw = await reader.read(-1)
        finally:
            writer.close()
    header_end = raw.find(b"\r\n\r\n")
    if header_end < 0:
        raise ConnectionError(f"{method} {path}: incomplete response ({len(raw)} bytes)")
    status_line, *header_lines = raw[:header_end].decode("latin-1").split("\r\n")
    response_headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        response_headers[name.strip().lower()] = value.strip()
    content = raw[header_end + 4 :]
    if response_headers.get("transfer-encoding", "").lower() == "chunked":
        content = _dechunk(content)
    return Response(int(status_line.split(" ", 2)[1]), response_headers, content)


class Api:
    """The product's REST API with an operator's API token (``Authorization: Bearer fpm_...``)."""

    def __init__(self, base_url: str, token: str | None):
        self.base_url, self.token = base_url, token

    async def call(self, method: str, path: str, json_body=None, expect: tuple[int, ...] = (200, 201)):
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        response = await request(self.base_url, method, path, json_body=json_body, headers=headers)
        if response.status not in expect:
            raise HttpError(response, f"{method} {path}")
        return response.json()
