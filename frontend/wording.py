"""Numbers and details as people read them: ``4.42`` not ``4.420330172652994``, ``93.2%`` for an accuracy,
``12,345`` samples, ``update norm 4.42, devices 5`` for a detail dict. The dashboard's ``fleet_ui`` filters and
the event sentences (``frontend.event_text``) use these; nothing here touches the database.
"""

from __future__ import annotations

import math
from typing import Any

# A metric whose name holds one of these and whose value is in [0, 1] is a fraction: shown as a percent.
FRACTION_WORDS = ("accuracy", "precision", "recall", "f1", "fraction", "failure_rate", "acceptance_rate")


def is_fraction(key: str) -> bool:
    key = key.lower()
    return any(word in key for word in FRACTION_WORDS)


def number(value: Any, key: str = "") -> str:
    """One value for people: floats to 3 significant digits (whole ones without a point), large numbers with
    thousands separators, fractions named by ``key`` (``eval_accuracy``) as percents, booleans as yes/no."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "∞" if value > 0 else "−∞"
        if key and is_fraction(key) and 0 <= value <= 1:
            return f"{value * 100:.1f}%"
        if abs(value) >= 1000 or (value.is_integer() and abs(value) < 1e15):
            return f"{value:,.0f}"
        return f"{value:.3g}"
    return str(value)


def words(key: str) -> str:
    """A field name as words: ``update_norm`` → ``update norm``."""
    return str(key).replace("_", " ").strip()


def value_text(value: Any, key: str = "") -> str:
    """A detail value: numbers through ``number``, lists and dicts spelled out, text as it is."""
    if isinstance(value, dict):
        return "{" + detail_text(value, limit=0) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(value_text(item, key) for item in value) + "]"
    if value is None:
        return "none"
    return number(value, key)


def detail_text(detail: Any, limit: int = 140) -> str:
    """A detail dict on one line, ``name value, ...``, cut at ``limit`` characters (0: never)."""
    if not isinstance(detail, dict) or not detail:
        return ""
    text = ", ".join(f"{words(key)} {value_text(value, str(key))}" for key, value in detail.items())
    return text if not limit or len(text) <= limit else text[: limit - 1] + "…"


def plural(count: Any, noun: str, many: str = "") -> str:
    """``1 delta``, ``5 deltas``, ``1,200 samples`` (``many`` for irregular plurals)."""
    if not isinstance(count, int) or isinstance(count, bool):
        return f"{count} {many or noun + 's'}"
    return f"{count:,} {noun if count == 1 else many or noun + 's'}"
