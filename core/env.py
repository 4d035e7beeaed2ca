"""Typed readers for settings that come from the environment.

Every reader fails loudly with ``ImproperlyConfigured`` naming the variable and the bad value, so a typo in a
deployment stops the process at start-up instead of surfacing later as odd behaviour. Secrets can also be
given as ``NAME_FILE`` (a path whose contents are the value), the usual way to pass Docker or Kubernetes
secrets.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def env_str(name: str, default: str | None = None, *, choices: tuple[str, ...] | None = None) -> str | None:
    value = _raw(name)
    if value is None:
        return default
    if choices is not None and value not in choices:
        raise ImproperlyConfigured(f"{name}={value!r} is not one of: {', '.join(choices)}")
    return value


def env_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={value!r} is not a boolean: use one of true/false, 1/0, yes/no, on/off")


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a whole number") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number} is below the minimum of {minimum}")
    if maximum is not None and number > maximum:
        raise ImproperlyConfigured(f"{name}={number} is above the maximum of {maximum}")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    value = _raw(name)
    if value is None:
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


def env_secret(name: str) -> str | None:
    """Read a secret from ``NAME`` or from the file named by ``NAME_FILE`` (not both)."""
    value = _raw(name)
    path = _raw(f"{name}_FILE")
    if value is not None and path is not None:
        raise ImproperlyConfigured(f"set either {name} or {name}_FILE, not both")
    if path is None:
        return value
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise ImproperlyConfigured(f"{name}_FILE={path!r} cannot be read: {exc.strerror}") from None
    if not secret:
        raise ImproperlyConfigured(f"{name}_FILE={path!r} is empty")
    return secret


def database_from_url(name: str, url: str) -> dict:
    """Turn ``postgresql://user:pass@host:port/dbname?host=/socket/dir&sslmode=...`` into a Django DATABASES entry."""
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ImproperlyConfigured(
            f"{name} must be a PostgreSQL URL (postgresql://user:password@host:port/dbname), "
            f"got scheme {parts.scheme!r}"
        )
    dbname = unquote(parts.path.lstrip("/"))
    if not dbname:
        raise ImproperlyConfigured(f"{name}={url!r} names no database (add /dbname to the URL)")
    try:
        port = parts.port
    except ValueError:
        raise ImproperlyConfigured(f"{name}={url!r} has a port that is not a number") from None
    options = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    host = options.pop("host", None) or (unquote(parts.hostname) if parts.hostname else "")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": dbname,
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": host,
        "PORT": str(port or ""),
        "OPTIONS": options,
    }


def redis_url(name: str, url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ImproperlyConfigured(f"{name} must be a redis://, rediss:// or unix:// URL, got scheme {parts.scheme!r}")
    try:
        _ = parts.port
    except ValueError:
        raise ImproperlyConfigured(f"{name}={url!r} has a port that is not a number") from None
    return url
