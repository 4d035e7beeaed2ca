"""The server-side SVG charts and the version lineage layout, without a database."""

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from frontend.charts import HEIGHT, PAD_BOTTOM, PAD_TOP, hourly_bar_chart, line_chart
from frontend.selectors import metric_series, version_lineage


def test_a_line_chart_maps_the_lowest_value_to_the_bottom_and_the_highest_to_the_top():
    chart = line_chart("accuracy", [(1, 0.5), (2, 0.7), (3, 0.9)])
    ys = [point["y"] for point in chart.points]
    assert ys[0] == HEIGHT - PAD_BOTTOM and ys[-1] == PAD_TOP and ys[0] > ys[1] > ys[2]
    assert chart.path.startswith("M") and chart.path.count("L") == 2
    assert [t["label"] for t in chart.x_ticks] == ["v1", "v2", "v3"]


def test_a_single_point_or_a_flat_series_still_draws_and_an_empty_one_says_so():
    assert len(line_chart("loss", [(4, 1.0)]).points) == 1
    flat = line_chart("loss", [(1, 0.0), (2, 0.0)])
    assert flat.points[0]["y"] == flat.points[1]["y"]
    assert line_chart("loss", []).empty


def test_hourly_bars_stack_rejected_deltas_on_top_of_the_rest():
    hour = datetime(2026, 1, 1, 12, tzinfo=UTC)
    chart = hourly_bar_chart(
        "d",
        [{"hour": hour, "total": 10, "rejected": 4}, {"hour": hour + timedelta(hours=1), "total": 0, "rejected": 0}],
    )
    first = chart.bars[0]
    assert chart.total == 10 and chart.y_max == 10
    assert first["h_bad"] == round(first["h"] * 0.4, 1) and chart.bars[1]["h"] == 0
    assert hourly_bar_chart("d", [{"hour": hour, "total": 0, "rejected": 0}]).empty


def _version(pk, number, parent=None, metrics=None):
    return SimpleNamespace(pk=pk, number=number, parent_id=parent, metrics=metrics or {})


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
