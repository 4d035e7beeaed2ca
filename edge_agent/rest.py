"""The agent's REST side: a short-lived device token from a signed nonce, JSON calls, downloads."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_agent import bounded_json
from edge_agent.protocol import PROTOCOL_VERSION, sign, token_request_payload

TOKEN_MARGIN_SECONDS = 60


class ServerError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{message} ({code}, HTTP {status})")
        self.status, self.code, self.message = status, code, message


class DeviceSession:
    def __init__(self, *, server: str, device_id: str, key: Ed25519PrivateKey, timeout: float = 30.0):
        if not server.startswith(("http://", "https://")):
            raise ValueError(f"not an http(s) server URL: {server}")
        self.server, self.device_id, self.key, self.timeout = server.rstrip("/"), device_id, key, timeout
        self._token: str | None = None
        self._token_expires = 0.0

    def _call(self, method: str, path: str, body: dict | None = None, *, auth: bool = True) -> dict | None:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if auth:
            headers["Authorization"] = f"Device {self.token()}"
        request = urllib.request.Request(  # noqa: S310  (scheme checked in __init__)
            self.server + path,
            data=json.dumps(body).encode() if body is not None else None,
            headers=headers,
            method=method,
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310
                raw = response.read()
                return bounded_json.loads(raw) if raw else None
        except urllib.error.HTTPError as error:
            try:
                detail = bounded_json.loads(error.read())["error"]
                raise ServerError(error.code, detail["code"], detail["message"]) from None
            except (ValueError, KeyError, TypeError):
                raise ServerError(error.code, "http_error", f"HTTP {error.code} for {path}") from None

    def token(self) -> str:
        if self._token is None or time.time() > self._token_expires - TOKEN_MARGIN_SECONDS:
            nonce = self._call("POST", "/api/v1/device-auth/challenge/", {"device_id": self.device_id}, auth=False)[
                "nonce"
            ]
            signature = sign(self.key, token_request_payload(nonce=nonce, device_id=self.device_id))
            answer = self._call(
                "POST",
                "/api/v1/device-auth/token/",
                {"device_id": self.device_id, "nonce": nonce, "signature": signature, "protocol": PROTOCOL_VERSION},
                auth=False,
            )
            self._token, self._token_expires = answer["token"], time.time() + answer["expires_in"]
        return self._token

    def get(self, path: str) -> dict | None:
        return self._call("GET", path)

    def post(self, path: str, body: dict) -> dict | None:
        return self._call("POST", path, body)

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Device {self.token()}"}
