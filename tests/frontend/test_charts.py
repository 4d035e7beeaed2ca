"""The server-side SVG charts and the version lineage layout, without a database."""

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from frontend.charts import HEIGHT, PAD_BOTTOM, PAD_TOP, WIDTH, hourly_bar_chart, line_chart
from frontend.selectors import data_span, metric_series, version_lineage

BOTTOM, TOP = HEIGHT - PAD_BOTTOM, PAD_TOP


def _height(chart, index: int) -> float:
    """Where a point sits between the axis' bottom (0) and top (1)."""
    return round((BOTTOM - chart.points[index]["y"]) / (BOTTOM - TOP), 2)


def test_an_accuracy_is_drawn_on_a_0_to_100_percent_axis_not_from_its_lowest_value():
    chart = line_chart("Accuracy", [(1, 0.5), (2, 0.7), (3, 0.9)], metric="eval_accuracy")
    assert [_height(chart, i) for i in range(3)] == [0.5, 0.7, 0.9]
    assert [t["label"] for t in chart.y_ticks] == ["0%", "25%", "50%", "75%", "100%"]
    assert [p["value"] for p in chart.points] == ["50.0%", "70.0%", "90.0%"]
    assert chart.path.startswith("M") and chart.path.count("L") == 2
    assert [t["label"] for t in chart.x_ticks] == ["v1", "v2", "v3"]
    # A change of a tenth of a point stays a tenth of a point high, not the whole chart.
    noisy = line_chart("Accuracy", [(1, 0.931), (2, 0.932)], metric="eval_accuracy")
    assert abs(noisy.points[0]["y"] - noisy.points[1]["y"]) < 1


def test_a_loss_or_count_axis_starts_at_0_and_ends_at_a_round_top():
    chart = line_chart("Loss", [(1, 2.3), (2, 2.1), (3, 2.2)], metric="eval_loss")
    assert [t["label"] for t in chart.y_ticks] == ["0", "0.5", "1", "1.5", "2", "2.5"]
    assert [_height(chart, i) for i in range(3)] == [0.92, 0.84, 0.88]
    assert [p["value"] for p in chart.points] == ["2.3", "2.1", "2.2"]
    assert [t["label"] for t in line_chart("n", [(1, 37.0)]).y_ticks] == ["0", "10", "20", "30", "40", "50"]
    # An accuracy outside [0, 1] (a percent, say) is not forced onto 0..1.
    assert line_chart("a", [(1, 93.0)], metric="eval_accuracy").y_ticks[-1]["label"] == "100"


def test_a_series_with_negative_values_gets_a_round_range_around_0():
    chart = line_chart("drift", [(1, -0.3), (2, 0.2)])
    assert [t["label"] for t in chart.y_ticks] == ["-0.5", "-0.25", "0", "0.25", "0.5"]


def test_a_single_point_or_a_flat_series_still_draws_and_an_empty_one_says_so():
    assert len(line_chart("loss", [(4, 1.0)]).points) == 1
    flat = line_chart("loss", [(1, 0.0), (2, 0.0)])
    assert flat.points[0]["y"] == flat.points[1]["y"] == BOTTOM
    assert line_chart("loss", []).empty


def test_hourly_bars_stack_rejected_deltas_on_top_of_the_rest():
    hour = datetime(2026, 1, 1, 12, tzinfo=UTC)
    chart = hourly_bar_chart(
        "d",
        [{"hour": hour, "total": 10, "rejected": 4}, {"hour": hour + timedelta(hours=1), "total": 0, "rejected": 0}],
    )
    first = chart.bars[0]
    assert chart.total == 10 and chart.y_max == 10
    assert hourly_bar_chart("d", [{"hour": hour, "total": 7, "rejected": 0}]).y_max == 10  # 0 to a round top
    assert first["h_bad"] == round(first["h"] * 0.4, 1) and chart.bars[1]["h"] == 0
    assert hourly_bar_chart("d", [{"hour": hour, "total": 0, "rejected": 0}]).empty


def _version(pk, number, parent=None, metrics=None):
    return SimpleNamespace(pk=pk, number=number, parent_id=parent, metrics=metrics or {})


def test_the_hourly_chart_spans_only_the_hours_with_deltas_and_a_few_bars_make_a_narrow_picture():

    start = datetime(2025, 11, 29, 0, tzinfo=UTC)
    day = [{"hour": start + timedelta(hours=h), "total": 0, "rejected": 0} for h in range(24)]
    day[20]["total"], day[22]["total"], day[22]["rejected"] = 4, 9, 7
    span = data_span(day)
    assert [b["hour"].hour for b in span] == [20, 21, 22] and data_span(day[:20]) == []
    narrow = hourly_bar_chart("d", span)
    assert len(narrow.bars) == 3 and narrow.width < WIDTH / 2 and narrow.max_px == round(narrow.width * 1.3)
    assert [t["label"] for t in narrow.x_ticks] == ["20:00", "21:00", "22:00"]
    full = hourly_bar_chart("d", [{**b, "total": 1} for b in day])
    assert full.width == WIDTH and full.max_px is None and len(full.x_ticks) <= 7


def test_lineage_keeps_a_chain_flat_and_indents_only_forks():
    versions = [_version(1, 1), _version(2, 2, 1), _version(3, 3, 2), _version(4, 4, 2), _version(5, 5, 4)]
    rows = {row.version.number: (row.depth, row.branch) for row in version_lineage(versions)}
    assert rows == {1: (0, False), 2: (0, False), 3: (0, False), 4: (1, True), 5: (1, False)}
    assert [row.version.number for row in version_lineage(versions)] == [5, 4, 3, 2, 1]


def test_metric_series_skip_versions_without_the_metric_or_with_nan():
    versions = [
        _version(1, 1, metrics={"eval_accuracy": 0.5}),
        _version(2, 2),
        _version(3, 3, metrics={"eval_accuracy": float("nan"), "eval_loss": 1.0}),
    ]
    assert metric_series(versions) == {"eval_accuracy": [(1, 0.5)], "eval_loss": [(3, 1.0)]}
