"""API token authentication: ``Authorization: Bearer fpm_...``."""

from __future__ import annotations

from rest_framework import authentication, exceptions

from accounts.models import ApiToken
from accounts.services import TOKEN_PREFIX, api_token_touch, hash_token


class ApiTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        scheme, _, raw = header.partition(" ")
        if scheme != self.keyword:
            return None
        raw = raw.strip()
        if not raw.startswith(TOKEN_PREFIX):
            raise exceptions.AuthenticationFailed("Malformed API token.")
        token = ApiToken.objects.select_related("user").filter(token_hash=hash_token(raw)).first()
        if token is None:
            raise exceptions.AuthenticationFailed("Unknown API token.")
        if token.revoked_at is not None:
            raise exceptions.AuthenticationFailed("This API token was revoked.")
        if not token.is_usable:
            raise exceptions.AuthenticationFailed("This API token has expired.")
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("The account behind this API token is deactivated.")
        api_token_touch(token=token)
        return token.user, token

    def authenticate_header(self, request) -> str:
        return f'{self.keyword} realm="api"'
