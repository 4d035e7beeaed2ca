"""Every API failure has the same body: {"error": {"code", "message", "details"}}."""

import pytest


def assert_error(response, status: int, code: str):
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.django_db
def test_unauthenticated_call_is_401_with_an_error_body_and_a_challenge(client):
    response = client.get("/api/v1/me/")
    assert_error(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.django_db
def test_unknown_api_path_is_a_json_404(api_client_for):
    assert_error(api_client_for("viewer").get("/api/v1/no-such-thing/"), 404, "not_found")
    assert_error(api_client_for(None).get("/api/nothing-here"), 404, "not_found")


@pytest.mark.django_db
def test_missing_object_is_a_404_error_body(api_client_for):
    assert_error(api_client_for("admin").get("/api/v1/users/999999/"), 404, "not_found")


@pytest.mark.django_db
def test_validation_failure_lists_the_fields(api_client_for):
    error = assert_error(
        api_client_for("admin").post("/api/v1/users/", {"username": "x y", "role": "king"}), 400, "invalid"
    )
    assert set(error["details"]) >= {"username", "role"}


@pytest.mark.django_db
def test_wrong_role_is_403_with_an_error_body(api_client_for):
    assert_error(api_client_for("viewer").get("/api/v1/users/"), 403, "permission_denied")


@pytest.mark.django_db
def test_method_not_allowed_has_an_error_body(api_client_for):
    assert_error(api_client_for("admin").delete("/api/v1/me/"), 405, "method_not_allowed")
