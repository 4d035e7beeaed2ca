"""JSON from outside the server, parsed with a limit on how deeply it nests.

Python's ``json`` recurses once per level of nesting: a body of a few kilobytes of ``[`` raises RecursionError,
which no caller expects (a 500 on the REST API, a socket dropped without a close code). ``loads`` counts the
brackets outside strings first, without recursing, and refuses anything nested deeper than ``MAX_JSON_DEPTH``
before ``json.loads`` sees it. Every message of the protocol and every API body nests a few levels; 64 leaves
room for any of them.

The DRF parser (``core.api.parsers.BoundedJSONParser``, the default in settings) and the agent socket
(``devices.consumers``) parse through it.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

MAX_JSON_DEPTH = 64

# A JSON string (escapes included), written so the regex engine never backtracks, and anything but a bracket.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JSONTooDeep(ValueError):
    """The text nests arrays and objects deeper than the limit; ``depth`` is how deep it reached."""

    def __init__(self, depth: int, limit: int):
        super().__init__(f"JSON nested {depth} levels deep; at most {limit} are accepted")
        self.depth, self.limit = depth, limit


def json_depth(text: str | bytes) -> int:
    """How deeply ``text`` nests arrays and objects, counting brackets outside strings (0 for a scalar).

    Text that is not JSON gets a number too (an unterminated string counts the brackets after it); deciding
    that it is not JSON is ``json.loads``'s part."""
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8")
    brackets = _NOT_A_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def check_json_depth(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise JSONTooDeep when ``text`` nests deeper than ``max_depth``."""
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8")
    if text.count("[") + text.count("{") <= max_depth:  # the common case: too few brackets to reach the limit
        return
    depth = json_depth(text)
    if depth > max_depth:
        raise JSONTooDeep(depth, max_depth)


def loads(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH, **options: Any) -> Any:
    """``json.loads(text, **options)`` of text nested at most ``max_depth`` deep; JSONTooDeep (a ValueError)
    otherwise, and what ``json.loads`` raises for text that is not JSON (UnicodeDecodeError for bytes that
    are not UTF-8: also a ValueError)."""
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8")
    check_json_depth(text, max_depth=max_depth)
    return json.loads(text, **options)
