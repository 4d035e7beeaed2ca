"""The device protocol served beside the REST API's documents: ``/api/protocol/asyncapi.json`` (AsyncAPI 3, the
same document as docs/protocol/asyncapi.json) and ``/api/docs/protocol/``, its messages as tables. Both are
built from ``edge_agent.wire`` by ``fleet.protocol_docs``; public, like ``/api/schema/``."""

from __future__ import annotations

import functools
import re

from django.http import JsonResponse
from django.shortcuts import render
from django.utils.html import escape
from django.utils.safestring import mark_safe
from django.views.decorators.http import require_GET

from fleet.protocol_docs import asyncapi, components, field_rows, message_groups


@functools.cache
def _document() -> dict:
    return asyncapi()


@require_GET
def asyncapi_json(request):
    return JsonResponse(_document(), json_dumps_params={"ensure_ascii": False})


def _cell(markdown: str) -> str:
    """A reference cell (backticks and ``[Name](#name)`` links) as HTML: a markdown table's escaped ``\\|`` is a
    plain ``|`` here, and a long identifier may wrap after its underscores (``<wbr>``), never inside a word."""
    text = escape(markdown.replace("\\|", "|"))
    text = re.sub(r"\[([A-Za-z0-9]+)\]\(#([a-z0-9]+)\)", r'<a href="#\2">\1</a>', text)
    text = re.sub(r"`([^`]*)`", lambda code: "<code>" + code.group(1).replace("_", "_<wbr>") + "</code>", text)
    return text


COLUMNS = ("field", "type", "required", "bounds", "meaning")


@functools.cache
def _groups() -> list[dict]:
    """The message groups with each model's rows as HTML cells (built once: the document never changes)."""
    schemas = components()
    return [
        {
            "title": title,
            "models": [
                {
                    "name": model.__name__,
                    "anchor": model.__name__.lower(),
                    "rows": [
                        [
                            {"label": label, "html": mark_safe(_cell(cell))}  # noqa: S308 (escaped by _cell)
                            for label, cell in zip(COLUMNS, (f"`{row[0]}`", *row[1:]), strict=True)
                        ]
                        for row in field_rows(schemas[model.__name__])
                    ],
                }
                for model in models
            ],
        }
        for title, models in message_groups()
    ]


@require_GET
def protocol_page(request):
    """The protocol's messages as tables, in the dashboard's page (its navigation for a signed-in user)."""
    return render(request, "frontend/protocol.html", {"groups": _groups(), "columns": COLUMNS})
