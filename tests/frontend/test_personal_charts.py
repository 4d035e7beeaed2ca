"""The personalization charts' geometry: two lines on one whole-percent scale over time, and the gain histogram
with its clamped outer bins and its losing bins marked."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from devices.selectors import gain_bins
from frontend.charts import HEIGHT, PAD_BOTTOM, PAD_LEFT, PAD_TOP, WIDTH
from frontend.personal_charts import accuracy_chart, gain_histogram


@dataclass
class Report:
    measured_at: datetime
    shared_accuracy: float
    personal_accuracy: float
    version_number: int = 1


def _at(minutes: int) -> datetime:
    return datetime(2025, 11, 25, 3, 0, tzinfo=UTC).replace(minute=minutes)


def test_the_accuracy_chart_draws_both_series_on_one_whole_percent_scale():
    reports = [Report(_at(0), 0.81, 0.84), Report(_at(30), 0.82, 0.93, 2), Report(_at(59), 0.83, 0.95, 3)]
    chart = accuracy_chart("Own model", reports)
    assert [s.kind for s in chart.series] == ["shared", "personal"]
    labels = [tick["label"] for tick in chart.y_ticks]
    assert labels == ["80%", "85%", "90%", "95%", "100%"]  # 81..95 fits four steps of 5
    bottom, top = chart.y_ticks[0]["y"], chart.y_ticks[-1]["y"]
    assert bottom == HEIGHT - PAD_BOTTOM and top == PAD_TOP
    shared, personal = chart.series
    assert [p["x"] for p in shared.points] == [p["x"] for p in personal.points]
    assert shared.points[0]["x"] == PAD_LEFT and personal.points[-1]["value"] == "95.0%"
    assert all(p["y"] < q["y"] for p, q in zip(personal.points, shared.points, strict=True))  # own above shared
    assert personal.points[1]["label"] == "2025-11-25 03:30 UTC, v2"
    assert [t["anchor"] for t in chart.x_ticks] == ["start", "middle", "middle", "middle", "end"]
    assert chart.x_ticks[0]["label"] == "03:00"  # within a day: the time only (the caption says the date)
    assert [t["minor"] for t in chart.x_ticks] == [False, True, False, True, False]  # a phone shows three


def test_the_time_axis_never_repeats_a_label_and_its_precision_follows_the_span():
    close = [Report(datetime(2025, 11, 29, 0, 13, second, tzinfo=UTC), 0.8, 0.9) for second in (1, 20, 50)]
    labels = [tick["label"] for tick in accuracy_chart("Own model", close).x_ticks]
    assert labels == ["00:13:01", "00:13:13", "00:13:25", "00:13:37", "00:13:50"]
    same = [Report(datetime(2025, 11, 29, 0, 13, 0, micro, tzinfo=UTC), 0.8, 0.9) for micro in (1, 900)]
    labels = [tick["label"] for tick in accuracy_chart("Own model", same).x_ticks]
    assert labels == ["00:13:00"]  # five ticks within a second: one label, not five equal ones
    days = [Report(datetime(2025, 11, day, 9, tzinfo=UTC), 0.8, 0.9) for day in (1, 20)]
    labels = [tick["label"] for tick in accuracy_chart("Own model", days).x_ticks]
    assert len(set(labels)) == len(labels) == 5 and labels[0] == "2025-11-01"


def test_one_measurement_is_one_point_in_the_middle_and_no_measurement_is_empty():
    chart = accuracy_chart("Own model", [Report(_at(5), 1.0, 1.0)])
    assert chart.series[0].points[0]["x"] == chart.series[1].points[0]["x"] > PAD_LEFT
    assert chart.y_ticks[-1]["label"] == "100%" and len(chart.x_ticks) == 1
    assert accuracy_chart("Own model", []).empty


def test_the_gain_histogram_marks_losing_bins_and_labels_the_clamped_ends():
    histogram = [{"low": low, "high": high, "devices": 0} for low, high in gain_bins()]
    assert gain_histogram("Gain", histogram).empty
    histogram[0]["devices"], histogram[4]["devices"], histogram[-1]["devices"] = 1, 4, 2
    chart = gain_histogram("Gain", histogram)
    assert chart.total == 7 and chart.y_max == 4 and len(chart.bars) == 14
    assert chart.bars[0]["label"] == "below -15 points" and chart.bars[0]["bad"]
    assert chart.bars[4]["label"] == "0 to +5 points" and not chart.bars[4]["bad"]
    assert chart.bars[-1]["label"] == "+45 points and above"
    assert chart.bars[4]["h"] == HEIGHT - PAD_TOP - PAD_BOTTOM and chart.bars[4]["x"] + chart.bars[4]["width"] < WIDTH
    assert [tick["label"] for tick in chart.x_ticks] == ["-20", "-10", "0", "+10", "+20", "+30", "+40"]
