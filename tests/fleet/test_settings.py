"""Settings come only from the environment and a bad value stops start-up with a clear message."""

import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from core.env import database_from_url, env_bool, env_int, env_secret

ROOT = Path(__file__).resolve().parents[2]
STRONG_SECRET = secrets.token_urlsafe(60)


def manage(*args: str, **overrides: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FLEET_ENV", "SECRET_KEY", "DEBUG", "ALLOWED_HOSTS")}
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"DEBUG": "maybe"}, "DEBUG='maybe' is not a boolean"),
        ({"DATABASE_URL": "mysql://root@localhost/fleet"}, "DATABASE_URL must be a PostgreSQL URL"),
        (
            {"DATABASE_URL": "postgresql://localhost:54x2/fleet"},
            "DATABASE_URL='postgresql://localhost:54x2/fleet' has a port that is not a number",
        ),
        ({"DATABASE_URL": None}, "DATABASE_URL is not set"),
        ({"REDIS_URL": "http://localhost:6379"}, "REDIS_URL must be a redis://"),
        ({"CHANNEL_LAYER_CAPACITY": "lots"}, "CHANNEL_LAYER_CAPACITY='lots' is not a whole number"),
        ({"AGGREGATION_WORKERS": "0"}, "AGGREGATION_WORKERS=0 is below the minimum of 1"),
        ({"FLEET_ENV": "staging"}, "FLEET_ENV='staging' is not one of: development, production"),
        ({"BLOB_STORAGE": "s3"}, "BLOB_STORAGE=s3 needs S3_BUCKET"),
        ({"SECRET_KEY_FILE": "/nonexistent/secret"}, "SECRET_KEY_FILE='/nonexistent/secret' cannot be read"),
    ],
)
def test_a_bad_environment_value_stops_start_up_with_a_clear_error(overrides, message):
    result = manage("check", **overrides)
    assert result.returncode != 0
    assert f"configuration error: {message}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({}, "SECRET_KEY (or SECRET_KEY_FILE) must be set"),
        (
            {"SECRET_KEY": "development-only-insecure-key-never-use-in-production-0123456789"},
            "SECRET_KEY is the development default",
        ),
        ({"SECRET_KEY": "short"}, "SECRET_KEY is too weak"),
        ({"SECRET_KEY": STRONG_SECRET, "DEBUG": "true"}, "DEBUG=true is refused"),
        ({"SECRET_KEY": STRONG_SECRET, "ALLOWED_HOSTS": None}, "ALLOWED_HOSTS must list"),
    ],
)
def test_production_refuses_unsafe_settings(overrides, message):
    env = {"FLEET_ENV": "production", "ALLOWED_HOSTS": "fleet.example.com", **overrides}
    result = manage("check", **env)
    assert result.returncode != 0
    assert message in result.stderr


def test_check_deploy_is_clean_with_production_settings(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(STRONG_SECRET)
    result = manage(
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        FLEET_ENV="production",
        SECRET_KEY_FILE=str(secret_file),
        ALLOWED_HOSTS="fleet.example.com",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_env_readers_parse_and_refuse(monkeypatch, tmp_path):
    monkeypatch.setenv("FLAG", "Yes")
    assert env_bool("FLAG", False) is True
    monkeypatch.setenv("NUMBER", "7")
    assert env_int("NUMBER", 1, minimum=1, maximum=9) == 7
    with pytest.raises(ImproperlyConfigured, match="above the maximum"):
        env_int("NUMBER", 1, maximum=5)
    secret = tmp_path / "s"
    secret.write_text("  hunter2-but-longer \n")
    monkeypatch.setenv("TOKEN_FILE", str(secret))
    assert env_secret("TOKEN") == "hunter2-but-longer"
    monkeypatch.setenv("TOKEN", "direct")
    with pytest.raises(ImproperlyConfigured, match="either TOKEN or TOKEN_FILE"):
        env_secret("TOKEN")


def test_database_url_supports_unix_sockets_and_options():
    config = database_from_url("DATABASE_URL", "postgresql://postgres:p%40ss@/fleet?host=/run/pg&sslmode=disable")
    assert config["HOST"] == "/run/pg"
    assert config["PASSWORD"] == "p@ss"
    assert config["NAME"] == "fleet"
    assert config["OPTIONS"] == {"sslmode": "disable"}


def test_server_processes_use_a_bounded_connection_pool_and_others_persistent_connections(db):
    """Under ASGI every request runs in a thread of its own, so fleet/asgi.py asks for a pool (Django's
    advice); a pool of N never opens more than N connections however many threads ask at once. The child
    connects to the test database (DATABASE_URL's own database need not exist on the machine)."""
    from tests.conftest import _test_database_url

    script = textwrap.dedent(
        """
        import os, threading
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleet.settings")
        import fleet.asgi
        from django.conf import settings
        from django.db import connection

        db = settings.DATABASES["default"]
        print("pool", db["OPTIONS"]["pool"]["max_size"], db["CONN_MAX_AGE"])
        barrier, pids, errors = threading.Barrier(12), set(), []

        def work():
            barrier.wait()
            try:
                with connection.cursor() as cursor:
                    cursor.execute("select pg_backend_pid(), pg_sleep(0.2)")
                    pids.add(cursor.fetchone()[0])
            except Exception as error:
                errors.append(repr(error))
            connection.close()

        threads = [threading.Thread(target=work) for _ in range(12)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print("backends", len(pids))
        print("errors", errors)
        """
    )
    env = {**os.environ, "DATABASE_POOL_SIZE": "3", "DATABASE_URL": _test_database_url()}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert lines[0] == "pool 3 0"
    assert lines[2] == "errors []", result.stdout
    assert 1 <= int(lines[1].split()[1]) <= 3

    # (Importing fleet.asgi in this test process may have set DATABASE_POOL_SIZE in os.environ.)
    plain = manage(
        "shell",
        "-c",
        "from django.conf import settings; print(settings.DATABASES['default']['CONN_MAX_AGE'])",
        DATABASE_POOL_SIZE=None,
        DATABASE_CONN_MAX_AGE=None,
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip().splitlines()[-1] == "60"
