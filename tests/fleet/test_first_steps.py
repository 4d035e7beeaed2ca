"""The README's "First steps through the API" work as written: its shell commands run with bash and curl against the
real server (uvicorn), with the API token create_operator prints, and make what they say (a cohort, an enrollment
token valid for 7 days, a base model registered from a multipart form with its weights and family_config as a JSON
string, an adapter, version 1 rolled out)."""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from tests.asgi_server import asgi_server
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not shutil.which("curl"), reason="the README's commands use curl")


def _readme_blocks(title: str = "### First steps through the API", end: str = "\n## ") -> list[str]:
    """The shell blocks of the README's section ``title`` (up to ``end``)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split(title, 1)[1].split(end, 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


@pytest.mark.django_db(transaction=True)
def test_the_readme_s_first_steps_run_as_written_against_the_real_server(tmp_path, shared_blob_root):
    from devices.models import Cohort, EnrollmentToken
    from training.models import Adapter, BaseModel, Rollout

    account, commands = _readme_blocks()
    assert "create_operator alice --role admin --api-token" in account
    said = io.StringIO()
    call_command("create_operator", "alice", "--role", "admin", "--api-token", stdout=said)  # what the block runs
    token = re.search(r"API token \(shown once\): (fpm_\S+)", said.getvalue())[1]

    # Then the README's "Your own model": the example .pt2 and its card registered, its modules listed, an adapter.
    (own,) = _readme_blocks("### Your own model, without code", "\n### ")
    script = (commands + own).replace(
        ".venv/bin/python", sys.executable
    )  # the checkout's interpreter, as in the README
    with asgi_server("first-steps", tmp_path / "server", BLOB_ROOT=str(shared_blob_root)) as server:
        env = {**os.environ, "FLEET": server.url, "TOKEN": token, "PYTHONPATH": str(ROOT)}
        ran = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=180)  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr

    cohort = Cohort.objects.get(name="field-units")
    issued = EnrollmentToken.objects.get(cohort=cohort, name="first devices")
    assert timedelta(days=6, hours=23) < issued.expires_at - timezone.now() <= timedelta(days=7)
    assert issued.requires_approval is False and '"token":"fet_' in ran.stdout.replace(" ", "")
    base = BaseModel.objects.get(name="digits-base")
    weights = (tmp_path / "digits.safetensors").read_bytes()
    assert (base.family, base.family_config) == ("digits-cnn", {"seed": 1})
    assert base.weights_sha256 == hashlib.sha256(weights).hexdigest()  # the file sent, not the seeded init
    adapter = Adapter.objects.get(name="digits-adapter")
    assert adapter.base_model == base and [c.name for c in adapter.cohorts.all()] == ["field-units"]
    rollout = Rollout.objects.get(version__adapter=adapter)
    assert rollout.version.number == 1 and rollout.cohort == cohort and rollout.state == "running"

    own = BaseModel.objects.get(name="wrist-cnn")
    assert own.family == "exported-program" and own.family_config["classes"] == 4
    assert own.weights_sha256 == hashlib.sha256((tmp_path / "wearable" / "sensor.pt2").read_bytes()).hexdigest()
    assert '"name":"conv1","kind":"weight","shape":[8,3,5]' in ran.stdout.replace(" ", "")
    wrist = Adapter.objects.get(name="wrist-lora")
    assert (wrist.base_model, wrist.target_modules, wrist.modules_to_save) == (own, ["conv1", "conv2", "fc"], ["head"])
