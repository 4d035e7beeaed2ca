"""Describe API token authentication in the OpenAPI schema (imported by AccountsConfig.ready)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiTokenScheme(OpenApiAuthenticationExtension):
    target_class = "accounts.authentication.ApiTokenAuthentication"
    name = "apiToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An operator API token (`fpm_...`), created in the dashboard or at /api/v1/api-tokens/.",
        }


class DeviceTokenScheme(OpenApiAuthenticationExtension):
    target_class = "devices.authentication.DeviceTokenAuthentication"
    name = "deviceToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": (
                "`Device <token>` from /api/v1/device-auth/token/ (a signed nonce exchanged for a short-lived token)."
            ),
        }
