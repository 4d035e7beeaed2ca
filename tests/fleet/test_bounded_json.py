"""core.bounded_json: the nesting of JSON is counted without recursing, brackets inside strings do not count, and
text nested deeper than the limit never reaches json.loads."""

import json

import pytest

from core.bounded_json import MAX_JSON_DEPTH, JSONTooDeep, json_depth, loads


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("1", 0),
        ('"[[[["', 0),
        ('{"a": [1, {"b": []}]}', 4),
        ('["\\"[[[", "\\\\", ["]"]]', 2),  # an escaped quote, an escaped backslash before the closing quote
        ('[{"k": "}}}]]]"}, [[]]]', 3),
        ("[" * 2000 + "]" * 2000, 2000),
    ],
)
def test_depth_counts_brackets_outside_strings(text, depth):
    assert json_depth(text) == depth
    assert json_depth(text.encode()) == depth


def test_loads_refuses_past_the_limit_before_json_recurses_and_parses_up_to_it():
    limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert loads(limit) == json.loads(limit)
    with pytest.raises(JSONTooDeep, match=f"65 levels deep; at most {MAX_JSON_DEPTH}") as refused:
        loads("[" + limit + "]")
    assert isinstance(refused.value, ValueError) and refused.value.depth == 65
    with pytest.raises(JSONTooDeep):
        loads("[" * 100_000)  # json.loads itself would raise RecursionError here
    assert loads('{"s": "' + "[" * 100_000 + '"}')["s"] == "[" * 100_000
    with pytest.raises(json.JSONDecodeError):
        loads("[[1]")
    with pytest.raises(UnicodeDecodeError):
        loads(b'"\xff"')
