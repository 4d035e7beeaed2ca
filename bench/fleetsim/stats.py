"""Percentiles, summaries and number formatting for the benchmark tables."""

from __future__ import annotations

import math
import statistics


def percentile(values: list[float], fraction: float) -> float | None:
    """Nearest-rank percentile of an unsorted list."""
    if not values:
        return None
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1))
    return ordered[index]


def summary(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "p50": percentile(values, 0.50),
        "p90": percentile(values, 0.90),
        "p99": percentile(values, 0.99),
        "p999": percentile(values, 0.999),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"
