import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_openapi_schema_generates_without_warnings_and_validates(tmp_path):
    out = tmp_path / "schema.yml"
    result = subprocess.run(
        [sys.executable, "manage.py", "spectacular", "--fail-on-warn", "--validate", "--file", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr
    schema = out.read_text()
    assert "/api/v1/me/" in schema
    assert "apiToken" in schema


@pytest.mark.django_db
def test_schema_and_interactive_docs_are_served_without_any_cdn(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    assert schema.json()["info"]["title"] == "Fleet personalization manager API"
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    html = docs.content.decode()
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/" in html
    assert "cdn" not in html.lower() and "unpkg" not in html.lower()
    asset = client.get("/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js")
    assert asset.status_code == 200


def _body_schema(schema: dict, path: str, method: str) -> dict:
    ref = schema["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]


@pytest.mark.django_db
def test_the_schema_describes_the_seed_field_and_the_adapter_cohorts_endpoint(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    seed = _body_schema(schema, "/api/v1/adapters/{id}/versions/seed/", "post")
    assert seed["required"] == ["seed"]
    field = seed["properties"]["seed"]
    assert field["type"] == "integer" and field["minimum"] == 0 and field["maximum"] == 2**63 - 1
    assert "same seed gives the same bytes" in field["description"]
    cohorts = schema["paths"]["/api/v1/adapters/{id}/cohorts/"]
    assert set(cohorts) >= {"get", "put"}
    assert {"200", "400", "401", "403", "404", "409"} <= set(cohorts["put"]["responses"])
    body = _body_schema(schema, "/api/v1/adapters/{id}/cohorts/", "put")
    assert (
        body["properties"]["cohorts"]["type"] == "array" and "replaces" in body["properties"]["cohorts"]["description"]
    )
