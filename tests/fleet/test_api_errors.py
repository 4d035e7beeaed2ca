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
@pytest.mark.parametrize("path", ["/api/v1/no-such-thing/", "/api/v1/devices/not-a-uuid/x/", "/api/nothing-here",
                                  "/api/v1/", "/api/docs/protocol/nope/"])  # fmt: skip
def test_unknown_api_path_is_a_json_404_with_debug_on_too(client, settings, path):
    """With DEBUG on (development, `make run`) Django answered these with its HTML debug page, not handler404."""
    settings.DEBUG = True
    for accept in ("application/json", "text/html,application/xhtml+xml", "*/*"):
        response = client.get(path, HTTP_ACCEPT=accept)
        assert response["Content-Type"] == "application/json", (path, accept)
        assert_error(response, 404, "not_found")


@pytest.mark.django_db
def test_an_api_path_without_its_slash_is_still_redirected_to_it(client, settings):
    settings.DEBUG = True
    response = client.get("/api/v1/devices")
    assert response.status_code == 301 and response["Location"] == "/api/v1/devices/"


@pytest.mark.django_db
def test_a_404_outside_the_api_stays_the_dashboard_s_page(client, settings):
    settings.DEBUG = False
    response = client.get("/no-such-page/")
    assert response.status_code == 404 and not response["Content-Type"].startswith("application/json")


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


# About 1,000 levels in 2 KB: DRF's own parser let json's RecursionError out, a 500 on an anonymous endpoint.
DEEP = "[" * 1000 + "]" * 1000


@pytest.mark.django_db
@pytest.mark.parametrize(("role", "path"), [(None, "/api/v1/enroll/"), ("admin", "/api/v1/cohorts/")])
def test_json_nested_too_deep_is_a_400_json_too_deep_and_creates_nothing(api_client_for, role, path):
    from devices.models import Cohort, Device

    before = (Cohort.objects.count(), Device.objects.count())
    for body in (DEEP, '{"name": ' + '{"a": ' * 65 + "1" + "}" * 65 + "}"):
        response = api_client_for(role).post(path, body, content_type="application/json")
        error = assert_error(response, 400, "json_too_deep")
        assert error["details"]["max_depth"] == 64 and error["details"]["depth"] > 64
        assert "64" in error["message"]
    assert (Cohort.objects.count(), Device.objects.count()) == before


@pytest.mark.django_db
def test_json_nested_as_deep_as_the_limit_is_parsed_and_judged_by_its_fields(api_client_for):
    body = '{"name": ' + "[" * 63 + "]" * 63 + "}"  # 64 levels with the object around it
    error = assert_error(api_client_for("admin").post("/api/v1/cohorts/", body, content_type="application/json"),
                         400, "invalid")  # fmt: skip
    assert "name" in error["details"]
    brackets_in_strings = {"name": "[" * 5000, "description": "{" * 5000 + '\\"[' * 100}
    response = api_client_for("admin").post("/api/v1/cohorts/", brackets_in_strings, format="json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid"  # the slug, not the depth
