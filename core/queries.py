"""Small query helpers for the hot paths (delta intake and verification, agent hellos)."""

from __future__ import annotations


def only_row(queryset):
    """The row of a query that matches at most one (by a primary or unique key), or None.

    ``.first()`` orders by the model's ``ordering`` (or the primary key) to pick a first row, which here has
    nothing to choose from: this asks for ``LIMIT 1`` alone, sparing the ORM the ORDER BY it compiles on
    every call, a visible share of a verifying worker's time (bench/fleet_simulator.py)."""
    return next(iter(queryset.order_by()[:1]), None)
