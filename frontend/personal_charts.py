"""The personalization charts, laid out on the server as the others (``frontend.charts``: its frame, its classes):
a device's personal against shared accuracy over time (two lines on one scale) and the fleet's gain histogram
(``charts.BarChart``). The templates ``_accuracy_chart.html`` and ``_gain_histogram.html`` draw them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime

from frontend.charts import HEIGHT, PAD_BOTTOM, PAD_LEFT, PAD_RIGHT, PAD_TOP, WIDTH, BarChart, _Frame

PLOT_W = WIDTH - PAD_LEFT - PAD_RIGHT
PLOT_H = HEIGHT - PAD_TOP - PAD_BOTTOM


@dataclass
class Series:
    name: str
    kind: str  # "shared" | "personal": how the template colours it
    path: str
    points: list[dict]  # {x, y, label, value}


@dataclass
class PairChart(_Frame):
    title: str
    series: list[Series] = field(default_factory=list)
    y_ticks: list[dict] = field(default_factory=list)
    x_ticks: list[dict] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.series


def accuracy_chart(title: str, reports: list) -> PairChart:
    """Shared and personal accuracy (in percent) of ``reports`` (oldest first, each with ``measured_at``,
    ``shared_accuracy``, ``personal_accuracy`` and ``version_number``), against the time they were measured."""
    chart = PairChart(title=title)
    if not reports:
        return chart
    times = [report.measured_at.timestamp() for report in reports]
    values = [100 * v for report in reports for v in (report.shared_accuracy, report.personal_accuracy)]
    t_min, t_max = min(times), max(times)
    y_min, step = _percent_axis(min(values), max(values))
    y_max = y_min + 4 * step

    def sx(t: float) -> float:
        return round(PAD_LEFT + (PLOT_W / 2 if t_max == t_min else (t - t_min) / (t_max - t_min) * PLOT_W), 1)

    def sy(y: float) -> float:
        return round(PAD_TOP + (1 - (y - y_min) / (y_max - y_min)) * PLOT_H, 1)

    for name, kind, attribute in (
        ("shared version", "shared", "shared_accuracy"),
        ("own model", "personal", "personal_accuracy"),
    ):
        points = [
            {
                "x": sx(t),
                "y": sy(100 * getattr(report, attribute)),
                "label": f"{_when(report.measured_at)}, v{report.version_number}",
                "value": f"{100 * getattr(report, attribute):.1f}%",
            }
            for t, report in zip(times, reports, strict=True)
        ]
        chart.series.append(Series(name, kind, "M" + " L".join(f"{p['x']},{p['y']}" for p in points), points))
    chart.y_ticks = [{"y": sy(y_min + step * i), "label": f"{y_min + step * i}%"} for i in range(5)]
    ticks = [t_min] if t_max == t_min else [t_min + (t_max - t_min) * i / 4 for i in range(5)]
    fmt = _time_format(t_min, t_max)
    for t in ticks:
        label = datetime.fromtimestamp(t, UTC).strftime(fmt)
        if not chart.x_ticks or chart.x_ticks[-1]["label"] != label:  # never the same moment twice
            chart.x_ticks.append({"x": sx(t), "label": label, "anchor": "middle", "minor": False})
    for index, tick in enumerate(chart.x_ticks):  # on a phone only the first, the middle and the last
        tick["minor"] = len(chart.x_ticks) > 3 and index % 2 == 1
    if len(chart.x_ticks) > 1:  # the outer labels end at the plot's edges rather than past the picture's
        chart.x_ticks[0]["anchor"], chart.x_ticks[-1]["anchor"] = "start", "end"
    return chart


def _time_format(t_min: float, t_max: float) -> str:
    """Labels as short as the span allows and as fine as it needs: seconds within ten minutes, hours and
    minutes within a day, the date beyond (``11-29 00:13`` five times over is no axis)."""
    span = t_max - t_min
    first, last = (datetime.fromtimestamp(t, UTC).date() for t in (t_min, t_max))
    if span < 600:
        return "%H:%M:%S" if first == last else "%m-%d %H:%M:%S"
    if span < 86400:
        return "%H:%M" if first == last else "%m-%d %H:%M"
    return "%m-%d %H:%M" if span < 4 * 86400 else "%Y-%m-%d"


def _percent_axis(low: float, high: float) -> tuple[int, int]:
    """The bottom and the step of four whole-percent divisions that hold ``low`` to ``high``, within 0 to 100."""
    for step in (1, 2, 5, 10, 20, 25):
        bottom = math.floor(low / step) * step
        if bottom + 4 * step >= high:
            break
    return max(0, min(bottom, 100 - 4 * step)), step


def _when(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M UTC")


def gain_histogram(title: str, histogram: list[dict]) -> BarChart:
    """Devices per bin of gain (``devices.selectors.summarize``'s histogram): bars of a gain below 0 marked."""
    chart = BarChart(title=title)
    chart.total = sum(row["devices"] for row in histogram)
    if not chart.total:
        return chart
    chart.y_max = max(row["devices"] for row in histogram)
    slot = PLOT_W / len(histogram)
    last = len(histogram) - 1
    for index, row in enumerate(histogram):
        height = row["devices"] / chart.y_max * PLOT_H
        x = PAD_LEFT + index * slot + slot * 0.1
        if index == 0:
            label = f"below {_points(row['high'])} points"  # the first and last bins hold every gain past them
        elif index == last:
            label = f"{_points(row['low'])} points and above"
        else:
            label = f"{_points(row['low'])} to {_points(row['high'])} points"
        chart.bars.append(
            {
                "x": round(x, 1),
                "width": round(slot * 0.8, 1),
                "y": round(PAD_TOP + PLOT_H - height, 1),
                "h": round(height, 1),
                "label": label,
                "total": row["devices"],
                "bad": row["high"] <= 0,
            }
        )
        if index % 2 == 0:
            chart.x_ticks.append({"x": round(PAD_LEFT + index * slot, 1), "label": _points(row["low"])})
    return chart


def _points(value: int) -> str:
    return f"{value:+d}" if value else "0"
