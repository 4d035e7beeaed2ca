"""Display helpers of the personalization parts of the pages: gains in signed points, shares and accuracies in
percent."""

from __future__ import annotations

from django import template

register = template.Library()


@register.filter
def points(value) -> str:
    """``{{ gain|points }}``: +9.8, -0.4, 0.0 (accuracy points, one decimal); — when there is none."""
    if not isinstance(value, int | float):
        return "—"
    return f"{value:+.1f}" if round(value, 1) else "0.0"


@register.filter
def percent(value) -> str:
    """``{{ share|percent }}``: a fraction as 93.2%; — when there is none."""
    if not isinstance(value, int | float):
        return "—"
    return f"{100 * value:.1f}%"


@register.filter
def accuracy_points(value) -> str:
    """``{{ margin|accuracy_points }}``: an accuracy difference as points, 0.01 as 1.0."""
    if not isinstance(value, int | float):
        return "—"
    return f"{100 * value:.1f}"
