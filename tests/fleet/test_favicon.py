"""The dashboard's icon: /favicon.ico answers (browsers ask for it by default), and every page links it and its SVG."""

import pytest


@pytest.mark.django_db
def test_favicon_ico_is_served_without_signing_in(client):
    response = client.get("/favicon.ico")
    assert response.status_code == 200
    assert response["Content-Type"] == "image/x-icon"
    assert response.content[:4] == b"\x00\x00\x01\x00"  # an ICO directory
    assert "max-age" in response["Cache-Control"]
    assert client.head("/favicon.ico").status_code == 200
    assert client.post("/favicon.ico").status_code == 405


@pytest.mark.django_db
def test_pages_link_the_icon_and_its_svg_which_is_served(client):
    page = client.get("/login/").content.decode()
    assert '<link rel="icon" href="/favicon.ico"' in page
    assert '<link rel="icon" href="/static/frontend/favicon.svg" type="image/svg+xml">' in page
    svg = client.get("/static/frontend/favicon.svg")
    assert svg.status_code == 200 and b"<svg" in b"".join(svg.streaming_content)
