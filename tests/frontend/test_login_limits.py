"""Sign-in is rate limited: after too many failures from one address or for one user name, even the right
password is refused for a while, with a clear message."""

import uuid

import pytest


@pytest.mark.django_db
def test_repeated_failed_sign_ins_are_refused_with_a_clear_message(client, make_user, settings):
    settings.LOGIN_FAILURE_LIMIT = 3
    name = f"op-{uuid.uuid4().hex[:6]}"
    make_user("operator", username=name, password="right-password-123")
    for _ in range(3):
        response = client.post("/login/", {"username": name, "password": "wrong"})
        assert response.status_code == 200  # the form again, with the usual error
    blocked = client.post("/login/", {"username": name, "password": "right-password-123"})
    assert blocked.status_code == 429
    assert b"Too many failed sign-ins" in blocked.content
    assert "_auth_user_id" not in client.session


@pytest.mark.django_db
def test_a_successful_sign_in_below_the_limit_works(client, make_user, settings):
    settings.LOGIN_FAILURE_LIMIT = 3
    name = f"op-{uuid.uuid4().hex[:6]}"
    make_user("operator", username=name, password="right-password-123")
    client.post("/login/", {"username": name, "password": "wrong"})
    response = client.post("/login/", {"username": name, "password": "right-password-123"})
    assert response.status_code == 302 and "_auth_user_id" in client.session
