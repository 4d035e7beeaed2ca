from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.models import ApiToken
from accounts.services import api_token_create, hash_token


def bearer(raw: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


@pytest.mark.django_db
def test_token_is_shown_once_stored_hashed_and_acts_with_its_owners_role(make_user):
    owner = make_user("operator")
    client = APIClient()
    client.force_authenticate(owner)
    response = client.post("/api/v1/api-tokens/", {"name": "ci"}, format="json")
    assert response.status_code == 201
    raw = response.json()["token"]
    assert raw.startswith("fpm_")
    stored = ApiToken.objects.get(pk=response.json()["id"])
    assert stored.token_hash == hash_token(raw) and raw not in (stored.prefix, stored.token_hash)
    assert "token" not in client.get(f"/api/v1/api-tokens/{stored.pk}/").json()
    me = bearer(raw).get("/api/v1/me/").json()
    assert me["username"] == owner.username and me["effective_role"] == "operator"


@pytest.mark.django_db
def test_revoked_expired_unknown_and_malformed_tokens_are_refused(make_user):
    user = make_user("viewer")
    revoked = api_token_create(user=user, name="old")
    client = APIClient()
    client.force_authenticate(user)
    assert client.post(f"/api/v1/api-tokens/{revoked.token.pk}/revoke/").status_code == 200
    expired = api_token_create(user=user, name="exp", expires_at=timezone.now() - timedelta(seconds=1))
    cases = {
        revoked.raw: "This API token was revoked.",
        expired.raw: "This API token has expired.",
        "fpm_" + "x" * 43: "Unknown API token.",
        "not-a-token": "Malformed API token.",
    }
    for raw, reason in cases.items():
        response = bearer(raw).get("/api/v1/me/")
        assert response.status_code == 401, raw
        assert response.json()["error"]["message"] == reason


@pytest.mark.django_db
def test_non_admins_see_only_their_own_tokens_and_cannot_issue_for_others(make_user):
    alice, bob = make_user("operator"), make_user("viewer")
    api_token_create(user=alice, name="alice-token")
    bobs = api_token_create(user=bob, name="bob-token")
    client = APIClient()
    client.force_authenticate(alice)
    names = [row["name"] for row in client.get("/api/v1/api-tokens/").json()["results"]]
    assert names == ["alice-token"]
    assert client.post(f"/api/v1/api-tokens/{bobs.token.pk}/revoke/").status_code == 404
    response = client.post("/api/v1/api-tokens/", {"name": "sneaky", "user": bob.username}, format="json")
    assert response.status_code == 403
    assert ApiToken.objects.filter(name="sneaky").count() == 0


@pytest.mark.django_db
def test_admin_issues_a_token_for_another_user(make_user):
    admin, viewer = make_user("admin"), make_user("viewer")
    client = APIClient()
    client.force_authenticate(admin)
    response = client.post("/api/v1/api-tokens/", {"name": "grafana", "user": viewer.username}, format="json")
    assert response.status_code == 201
    assert bearer(response.json()["token"]).get("/api/v1/me/").json()["username"] == viewer.username


@pytest.mark.django_db
def test_dashboard_shows_a_new_token_once(client, make_user):
    client.force_login(make_user("viewer"))
    response = client.post("/settings/api-tokens/", {"name": "laptop"})
    token = ApiToken.objects.get(name="laptop")
    assert token.prefix in response.content.decode()
    assert "will not be shown again" in response.content.decode()
    assert "will not be shown again" not in client.get("/settings/api-tokens/").content.decode()


@pytest.mark.django_db
def test_admin_cannot_demote_themselves(make_user):
    admin = make_user("admin")
    client = APIClient()
    client.force_authenticate(admin)
    response = client.patch(f"/api/v1/users/{admin.pk}/", {"role": "viewer"}, format="json")
    assert response.status_code == 403
    admin.refresh_from_db()
    assert admin.role == "admin"
