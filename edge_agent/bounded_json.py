"""JSON from outside the agent's own files (sample files, the server's messages and replies, downloaded file
headers), parsed with a limit on how deeply it nests.

Python's ``json`` recurses once per level: a few hundred kilobytes of ``[`` raise RecursionError, which no caller
expects and which says nothing of the input. ``loads`` measures the nesting first, without recursing, and refuses
anything deeper than ``MAX_JSON_DEPTH`` (64, as the server: every message and sample nests a few levels) with a
``JSONTooDeep``, a ValueError that says how deep.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_JSON_DEPTH = 64

# A JSON string with its escapes (unrolled so the regex engine never backtracks), and runs of brackets that open
# or that close. Brackets inside strings are not nesting.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_RUN = re.compile(r"[\[{]+|[\]}]+")


class JSONTooDeep(ValueError):
    """The text nests arrays and objects deeper than the limit."""

    def __init__(self, depth: int, limit: int):
        super().__init__(f"JSON nested {depth} levels deep; at most {limit} are accepted")
        self.depth, self.limit = depth, limit


def _text(data: str | bytes | bytearray) -> str:
    if isinstance(data, bytes | bytearray):
        return bytes(data).decode(json.detect_encoding(data), "surrogatepass")  # as json.loads decodes bytes
    return data


def json_depth(text: str | bytes) -> int:
    """How deeply ``text`` nests arrays and objects (0 for a scalar), counted without recursion. Text that is
    not JSON gets a number too; saying it is not JSON is ``json.loads``'s part."""
    depth = deepest = 0
    for run in _RUN.finditer(_STRING.sub("", _text(text))):
        if run.group()[0] in "[{":
            depth += len(run.group())
            deepest = max(deepest, depth)
        else:
            depth -= len(run.group())
    return deepest


def loads(data: str | bytes | bytearray, *, max_depth: int = MAX_JSON_DEPTH, **options: Any) -> Any:
    """``json.loads(data, **options)`` of text nested at most ``max_depth`` deep, else ``JSONTooDeep``."""
    text = _text(data)
    if text.count("[") + text.count("{") > max_depth:  # fewer brackets cannot nest deeper: nothing to measure
        depth = json_depth(text)
        if depth > max_depth:
            raise JSONTooDeep(depth, max_depth)
    return json.loads(text, **options)
