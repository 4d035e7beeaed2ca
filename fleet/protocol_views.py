"""The device protocol served beside the REST API's documents: ``/api/protocol/asyncapi.json`` (AsyncAPI 3, the
same document as docs/protocol/asyncapi.json) and ``/api/docs/protocol/``, its messages as tables. Both are
built from ``edge_agent.wire`` by ``fleet.protocol_docs``; public, like ``/api/schema/``."""

from __future__ import annotations

import functools
import re

from django.http import HttpResponse, JsonResponse
from django.utils.html import escape
from django.views.decorators.http import require_GET

from fleet.protocol_docs import asyncapi, components, field_rows, message_groups


@functools.cache
def _document() -> dict:
    return asyncapi()


@require_GET
def asyncapi_json(request):
    return JsonResponse(_document(), json_dumps_params={"ensure_ascii": False})


def _cell(markdown: str) -> str:
    """A reference cell (backticks and ``[Name](#name)`` links) as HTML."""
    text = escape(markdown)
    text = re.sub(r"\[([A-Za-z0-9]+)\]\(#([a-z0-9]+)\)", r'<a href="#\2">\1</a>', text)
    return re.sub(r"`([^`]*)`", r"<code>\1</code>", text)


@functools.cache
def _page() -> str:
    schemas = components()
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><title>Device protocol</title>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        "<style>body{font-family:system-ui,sans-serif;margin:1.5rem;max-width:72rem}table{border-collapse:collapse;"
        "width:100%;margin-bottom:1.5rem}td,th{border:1px solid #ccc;padding:.3rem .5rem;text-align:left;"
        "vertical-align:top;overflow-wrap:anywhere}code{font-size:.9em}</style></head><body>",
        "<h1>Device protocol</h1><p>Every message of the agent socket and the device REST payloads. "
        "Machine-readable: <a href='/api/protocol/asyncapi.json'>AsyncAPI 3</a>; the REST API: "
        "<a href='/api/docs/'>OpenAPI</a>. The specification is docs/protocol/README.md in the repository.</p>",
    ]
    for title, models in message_groups():
        parts.append(f"<h2>{escape(title)}</h2>")
        for model in models:
            name = model.__name__
            parts.append(f"<h3 id='{name.lower()}'>{name}</h3><table><tr><th>field</th><th>type</th>"
                         "<th>required</th><th>bounds</th><th>meaning</th></tr>")  # fmt: skip
            for row in field_rows(schemas[name]):
                parts.append(
                    "<tr>" + "".join(f"<td>{_cell(cell)}</td>" for cell in (f"`{row[0]}`", *row[1:])) + "</tr>"
                )
            parts.append("</table>")
    parts.append("</body></html>")
    return "".join(parts)


@require_GET
def protocol_page(request):
    return HttpResponse(_page())
