"""Small charts as inline SVG, laid out on the server: no chart library, nothing fetched by the browser.

These functions only compute geometry; the templates ``frontend/_line_chart.html`` and ``_bar_chart.html``
draw it (so every label goes through the template's escaping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from frontend.wording import is_fraction, number

WIDTH, HEIGHT = 600, 200
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 64, 12, 12, 28


NICE_STEPS = (1, 2, 2.5, 5, 10)


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is at least ``value`` (> 0): a round top."""
    power = 10 ** math.floor(math.log10(value))
    return next(step * power for step in NICE_STEPS if step * power >= value * (1 - 1e-12))


def _divisions(span: float) -> int:
    """How many equal steps split ``span`` into round ones (2.5 in 5 steps of 0.5, not 4 of 0.625)."""
    return next((n for n in (4, 5, 2, 8, 10) if math.isclose(nice_ceiling(span / n), span / n)), 4)


def y_range(ys: list[float], metric: str = "") -> tuple[float, float]:
    """The y-axis for ``ys``: never the data's own minimum, which magnifies noise into a cliff. A fraction
    (``eval_accuracy``, all in [0, 1]) gets 0..1; values that are never negative (losses, counts) run from 0
    to a round top; only a series with negative values gets a round range around its data."""
    low, high = min(ys), max(ys)
    if is_fraction(metric) and low >= 0 and high <= 1:
        return 0.0, 1.0
    if low >= 0:
        return 0.0, nice_ceiling(high) if high > 0 else 1.0
    span = nice_ceiling(max(abs(low), abs(high)))
    return (-span, span) if high > 0 else (-span, 0.0)


class _Frame:
    """Where the plot area sits in the SVG, for the templates' axes and labels."""

    width = WIDTH
    height = HEIGHT
    left = PAD_LEFT
    right = WIDTH - PAD_RIGHT
    top = PAD_TOP
    bottom = HEIGHT - PAD_BOTTOM
    label_x = PAD_LEFT - 6  # y-axis labels end here
    label_y = HEIGHT - 8  # x-axis labels sit on this line


@dataclass
class LineChart(_Frame):
    title: str
    points: list[dict] = field(default_factory=list)  # {x, y, label, value}
    path: str = ""
    y_ticks: list[dict] = field(default_factory=list)  # {y, label}
    x_ticks: list[dict] = field(default_factory=list)  # {x, label}

    @property
    def empty(self) -> bool:
        return not self.points


def line_chart(title: str, series: list[tuple[int, float]], *, x_label: str = "v", metric: str = "") -> LineChart:
    """A line over ``[(x, y)]`` (x increasing), with round ticks on the y-axis (``y_range``: from 0, or 0..1 for
    a fraction named by ``metric``) and about six on the x-axis; values labelled for people (93.2%, 0.25)."""
    chart = LineChart(title=title)
    if not series:
        return chart
    xs = [x for x, _ in series]
    ys = [y for _, y in series]
    x_min, x_max = min(xs), max(xs)
    y_min, y_max = y_range(ys, metric)
    plot_w = WIDTH - PAD_LEFT - PAD_RIGHT
    plot_h = HEIGHT - PAD_TOP - PAD_BOTTOM

    def sx(x: float) -> float:
        return PAD_LEFT + (plot_w / 2 if x_max == x_min else (x - x_min) / (x_max - x_min) * plot_w)

    def sy(y: float) -> float:
        return PAD_TOP + (1 - (y - y_min) / (y_max - y_min)) * plot_h

    chart.points = [
        {"x": round(sx(x), 1), "y": round(sy(y), 1), "label": f"{x_label}{x}", "value": number(y, metric)}
        for x, y in series
    ]
    chart.path = "M" + " L".join(f"{p['x']},{p['y']}" for p in chart.points)
    steps = _divisions(y_max - y_min)
    ticks = [y_min + (y_max - y_min) * i / steps for i in range(steps + 1)]
    fraction = is_fraction(metric) and (y_min, y_max) == (0.0, 1.0)
    chart.y_ticks = [
        {"y": round(sy(tick), 1), "label": f"{tick * 100:g}%" if fraction else f"{tick:g}"} for tick in ticks
    ]
    step = max(1, len(xs) // 6)
    shown = xs[::step] if xs[-1] in xs[::step] else [*xs[::step], xs[-1]]
    chart.x_ticks = [{"x": round(sx(x), 1), "label": f"{x_label}{x}"} for x in shown]
    return chart


@dataclass
class BarChart(_Frame):
    """``width`` and ``right`` may be narrower than the frame's for a few bars (``hourly_bar_chart``); the
    template then caps the picture at ``max_px``, the frame's scale, so it stays as tall as the others."""

    title: str
    bars: list[dict] = field(default_factory=list)  # {x, y, h, y_bad, h_bad, width, label, total, bad}
    y_max: int = 0
    x_ticks: list[dict] = field(default_factory=list)
    total: int = 0

    @property
    def empty(self) -> bool:
        return self.total == 0

    @property
    def max_px(self) -> int | None:
        """The widest a narrowed chart is drawn (CSS px): at the 260 px tallest any chart is; None when full."""
        return None if self.width == WIDTH else round(self.width * 260 / HEIGHT)


def hourly_bar_chart(title: str, buckets: list[dict]) -> BarChart:
    """Stacked bars per hour: accepted/other below, rejected on top (``buckets`` from
    ``selectors.deltas_per_hour``, usually cut to the hours with data by ``selectors.data_span``); at least
    eight bar widths across, so two busy hours are two slim bars at the left, not two slabs."""
    chart = BarChart(title=title)
    if not buckets:
        return chart
    chart.total = sum(b["total"] for b in buckets)
    chart.y_max = math.ceil(nice_ceiling(max(1, max(b["total"] for b in buckets))))  # from 0 to a round top
    plot_w = WIDTH - PAD_LEFT - PAD_RIGHT
    plot_h = HEIGHT - PAD_TOP - PAD_BOTTOM
    slot = plot_w / max(len(buckets), 8)  # a few busy hours are a few bars, not bars as wide as the card
    if len(buckets) < 8:  # and the picture is only as wide as they are: no card-wide stretch of nothing
        chart.width = round(PAD_LEFT + PAD_RIGHT + slot * max(len(buckets), 2), 1)
        chart.right = chart.width - PAD_RIGHT
    every = max(1, math.ceil(len(buckets) / 6))  # about six hour labels, whatever the span
    for index, bucket in enumerate(buckets):
        h_total = bucket["total"] / chart.y_max * plot_h
        h_bad = bucket["rejected"] / chart.y_max * plot_h
        x = PAD_LEFT + index * slot + slot * 0.1
        chart.bars.append(
            {
                "x": round(x, 1),
                "width": round(slot * 0.8, 1),
                "y": round(PAD_TOP + plot_h - h_total, 1),
                "h": round(h_total, 1),
                "y_bad": round(PAD_TOP + plot_h - h_bad, 1),
                "h_bad": round(h_bad, 1),
                "label": bucket["hour"].strftime("%H:00"),
                "total": bucket["total"],
                "bad": bucket["rejected"],
            }
        )
        if index % every == 0 and len(buckets) - index >= every / 2 or index == len(buckets) - 1:
            chart.x_ticks.append({"x": round(x + slot * 0.4, 1), "label": bucket["hour"].strftime("%H:00")})
    return chart
