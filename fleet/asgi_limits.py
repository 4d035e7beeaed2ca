"""Request body limits enforced while the body streams in, in front of Django.

Django's ASGI handler reads a whole request body (spooling it to disk) before any view runs, so a view
cannot refuse an oversized upload in time. This middleware refuses it from ``Content-Length`` at once, and
counts the bytes of a body without one, answering 413 and ending the request the moment it passes the
limit: nothing past the limit is read or stored.
"""

from __future__ import annotations

import json


class BodyLimitMiddleware:
    def __init__(self, app, *, limits: list[tuple[str, int]], default: int):
        self.app = app
        self.limits = sorted(limits, key=lambda item: -len(item[0]))
        self.default = default

    def limit_for(self, path: str) -> int:
        for prefix, limit in self.limits:
            if path.startswith(prefix):
                return limit
        return self.default

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope.get("path", ""))
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await _refuse(send, 400, "bad_request", "Content-Length is not a number")
                if declared > limit:
                    return await _refuse(send, 413, "too_large", f"the body is above the {limit}-byte limit")
        received = 0
        refused = False
        started = False

        async def limited_receive():
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused = True
                    if not started:
                        await _refuse(send, 413, "too_large", f"the body is above the {limit}-byte limit")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if refused:
                return  # the 413 has been sent; whatever the app answers after the abort is dropped
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        return await self.app(scope, limited_receive, guarded_send)


async def _refuse(send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"code": code, "message": message, "details": {}}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
