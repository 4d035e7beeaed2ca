"""Numbers and details as people read them: ``4.42`` not ``4.420330172652994``, ``93.2%`` for an accuracy,
``12,345`` samples, ``update norm 4.42, devices 5`` for a detail dict. The dashboard's ``fleet_ui`` filters and
the event sentences (``frontend.event_text``) use these; nothing here touches the database.
"""

from __future__ import annotations

import math
import re
from typing import Any

# A metric whose name holds one of these and whose value is in [0, 1] is a fraction: shown as a percent.
FRACTION_WORDS = ("accuracy", "precision", "recall", "f1", "fraction", "failure_rate", "acceptance_rate")


# A metric named for a gain in accuracy (``personal_gain``: personal minus shared accuracy, a difference of two
# fractions) is shown in accuracy points, as the personalization pages show gains: 0.304 is +30.4 points.
POINTS_WORDS = ("gain", "accuracy_change")


def is_fraction(key: str) -> bool:
    key = key.lower()
    return any(word in key for word in FRACTION_WORDS) and not is_points(key)


def is_points(key: str) -> bool:
    key = key.lower()
    return any(word in key for word in POINTS_WORDS)


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
        if key and is_points(key) and -1 <= value <= 1:
            return f"{value * 100:+.1f} points" if round(value * 100, 1) else "0.0 points"
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
        return "(" + detail_text(value, limit=0, separator="; ") + ")" if value else "none"
    if isinstance(value, list | tuple):
        return ", ".join(value_text(item, key) for item in value) if value else "none"
    if value is None or value == "":
        return "none"
    return number(value, key)


def detail_text(detail: Any, limit: int = 140, separator: str = "; ") -> str:
    """A detail dict on one line, ``name: value; ...`` (a nested dict in parentheses, a list comma-separated),
    cut at a word boundary within ``limit`` characters (0: never)."""
    if not isinstance(detail, dict) or not detail:
        return ""
    text = separator.join(f"{words(key)}: {value_text(value, str(key))}" for key, value in detail.items())
    return shorten(text, limit)


def shorten(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters (0: never) at the last space before it, with an ellipsis;
    never inside a word, and without a dangling separator or an open parenthesis' comma before the cut."""
    if not limit or len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    if space > limit // 3:
        cut = cut[:space]
    return cut.rstrip(" ,;:(") + "…"


_NORM_IN_MESSAGE = re.compile(r"\bnorm (?:is )?([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\b", re.IGNORECASE)


def delta_norm(norm: Any, state: str = "", detail: str = "") -> float | None:
    """A delta's update norm: the one verification stored, or for a delta rejected before it was stored the
    one its message gives ("the update's L2 norm is 1.2e+06; the adapter's bound is 1000"); None if neither."""
    if isinstance(norm, int | float) and not isinstance(norm, bool):
        return norm
    if state == "rejected" and detail and (found := _NORM_IN_MESSAGE.search(detail)):
        try:
            return float(found.group(1))
        except ValueError:
            return None
    return None


def plural(count: Any, noun: str, many: str = "") -> str:
    """``1 delta``, ``5 deltas``, ``1,200 samples`` (``many`` for irregular plurals)."""
    if not isinstance(count, int) or isinstance(count, bool):
        return f"{count} {many or noun + 's'}"
    return f"{count:,} {noun if count == 1 else many or noun + 's'}"


def duration(seconds: Any) -> str:
    """A span of time for people: ``0.35 s``, ``4.2 s``, ``12 s``, ``3 min 5 s``, ``2 h 5 min``, ``3 d 4 h``;
    ``—`` when it is not known."""
    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or math.isnan(seconds):
        return "—"
    if math.isinf(seconds):
        return "∞"
    seconds = max(0.0, float(seconds))
    if seconds < 0.01:
        return "under 0.01 s"
    if seconds < 9.95:
        return f"{seconds:.2g} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        minutes, rest = divmod(whole, 60)
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    minutes = round(seconds / 60)
    if minutes < 24 * 60:
        hours, rest = divmod(minutes, 60)
        return f"{hours} h {rest} min" if rest else f"{hours} h"
    hours = round(seconds / 3600)
    days, rest = divmod(hours, 24)
    return f"{days:,} d {rest} h" if rest else f"{days:,} d"


def round_times(aggregation_seconds: Any, release_seconds: Any, *, rerun: bool = False) -> str:
    """How long a round took, from its close (or its last re-run, ``rerun``) to its version and to its release:
    ``aggregated in 4.2 s; released 12 s after close``, ``aggregated in 4.2 s; not released``; ``—`` before it
    is aggregated, or for a round whose times were not kept."""
    if aggregation_seconds is None:
        return "—"
    since = "re-run" if rerun else "close"
    aggregated = f"aggregated in {duration(aggregation_seconds)}" + (" from re-run" if rerun else "")
    if release_seconds is None:
        return f"{aggregated}; not released"
    return f"{aggregated}; released {duration(release_seconds)} after {since}"
