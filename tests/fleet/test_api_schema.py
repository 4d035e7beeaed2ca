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
