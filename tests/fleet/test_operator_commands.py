"""The account commands a newcomer meets first: create_operator (with its first API token, no dashboard needed) and
the demo login the launcher prints (only one that works: with --no-demo, an earlier run's demo account or none)."""

from __future__ import annotations

import io
import re

import pytest
from django.core.management import call_command
from rest_framework.test import APIClient

from accounts.models import User


def _run(*args) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_create_operator_with_api_token_prints_a_token_that_acts_with_the_new_role():
    said = _run("create_operator", "alice", "--role", "admin", "--api-token")
    assert re.search(r"^created admin 'alice' with password: \S{10,}$", said, re.M), said
    token = re.search(r"^API token \(shown once\): (fpm_\S+)$", said, re.M)[1]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    me = client.get("/api/v1/me/").json()
    assert (me["username"], me["effective_role"]) == ("alice", "admin")
    tokens = client.get("/api/v1/api-tokens/").json()["results"]
    assert [t["name"] for t in tokens] == ["created with the account"]

    named = _run("create_operator", "bob", "--api-token", "grafana")
    assert "created viewer 'bob'" in named and "fpm_" in named
    assert "API token" not in _run("create_operator", "carol", "--password", "correct-horse-battery-9")


@pytest.mark.django_db
def test_the_demo_login_is_reported_only_while_it_works(settings, tmp_path):
    settings.DATA_DIR = tmp_path
    assert _run("ensure_demo_operator", "--existing") == ""  # no demo account yet: nothing to print, none made

    assert not User.objects.filter(username="demo").exists()
    login = _run("ensure_demo_operator").split()
    assert login[0] == "demo" and _run("ensure_demo_operator", "--existing").split() == login
    user = User.objects.get(username="demo")
    user.set_password("changed-by-its-owner-1")
    user.save()
    assert _run("ensure_demo_operator", "--existing") == ""  # a login that no longer works is not printed
    assert User.objects.get(username="demo").check_password("changed-by-its-owner-1")  # and nothing was changed
