"""The demo a new user sees: the run command trains a base at the factory, seeds a setup and runs a fleet of 12
simulated devices with the real agent code, whose users differ (their own label mix, sensor, or label names).

Checked through the API the dashboard reads, as the first minutes of a new user went wrong before: every device
enrolls (none left dead after a failed enrollment) and trains; rounds go on completing after each device has
seen all of its first data (the samples keep coming); the shared version starts useful (trained at the factory)
and stays above a stated level; devices report their personal model beside the shared one (measured on samples
neither trained on), those whose users differ (the us-wearables cohort: sensor and label names) gain by it, and
a device that measured its own model worse serves the shared version; the misbehaving device is caught; and the
server logs no 5xx at all.
"""

from __future__ import annotations

import re
import time
from datetime import datetime

import pytest

from demo.fleet_demo import plan
from tests.e2e.support import drop_stack, free_port, stack_env, start_launcher, stop_launcher
from tests.e2e.test_agent_lifecycle import _Api, _say
from tests.e2e.test_federated_round import _admin_token

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(660)]
DEVICES = 12
WATCH_SECONDS = 240  # a minute past the three minutes after which the old demo ran dry
# The fleet's learning is judged over rounds, not seconds: a slower host makes fewer rounds in WATCH_SECONDS
# (9 or 10 on a host where the suite took 44 minutes, against 16 where it took 23), so the watch goes on until
# MIN_ROUNDS have completed, up to WATCH_LIMIT seconds.
MIN_ROUNDS = 16
WATCH_LIMIT = 480
SHARED_FLOOR = 0.70  # version 1 scores about 0.80; the fleet's versions stay above this
SERVER_ERROR = re.compile(r"Internal Server Error|\" 5\d\d |ERROR django\.request|OperationalError|Traceback")


def _pages(api: _Api, path: str) -> list[dict]:
    status, body = api.call("GET", path)
    assert status == 200, body
    return body["results"]


def _latest_reports(api: _Api, devices: list[dict]) -> dict[str, dict | None]:
    """Each device's latest personalization report (None if it sent none), by device name."""
    latest = {}
    for device in devices:
        status, reports = api.call("GET", f"/devices/{device['id']}/personalization/")
        assert status == 200, reports
        latest[device["name"]] = reports["results"][0] if reports["results"] else None
    return latest


def _report_table(devices: list[dict], latest: dict[str, dict | None]) -> str:
    """One line per device: its user (the demo's scenario), cohort and latest report, to read a failure by."""
    lines = ["device | user | cohort | version | held | trained | shared | personal | gain | serving"]
    for device in sorted(devices, key=lambda d: d["name"]):
        report = latest.get(device["name"])
        user = (device.get("labels") or {}).get("user", "?")
        head = f"{device['name']} | {user} | {device.get('cohort')}"
        if report is None:
            lines.append(f"{head} | no report")
            continue
        lines.append(
            f"{head} | v{report['version']} | {report['val_samples']} | {report['trained_samples']} | "
            f"{report['shared_accuracy']:.3f} | {report['personal_accuracy']:.3f} | {report['gain_points']:+.1f} | "
            f"{report['serving']}"
        )
    return "\n".join(lines)


def test_the_demo_fleet_enrolls_every_device_keeps_learning_and_shows_personal_models_without_a_server_error(
    tmp_path,
):
    env = stack_env(tmp_path, ROLLOUT_TICK_SECONDS="2")
    port = free_port()
    launcher = output = None
    try:
        started = time.monotonic()
        launcher, output = start_launcher(env, port, demo_devices=DEVICES)
        _say(f"ready in {time.monotonic() - started:.0f}s")
        assert any(f"demo fleet: {DEVICES} simulated devices" in line for line in output.lines), output.tail()
        api = _Api(port, _admin_token(env))
        time.sleep(max(0.0, WATCH_SECONDS - (time.monotonic() - started)))
        while time.monotonic() - started < WATCH_LIMIT:
            status, body = api.call("GET", "/rounds/?state=completed&page_size=1")
            if status == 200 and body.get("count", 0) >= MIN_ROUNDS:
                break
            time.sleep(10)
        watched = time.monotonic() - started

        devices = _pages(api, "/devices/?page_size=50")
        assert len(devices) == DEVICES, [d["name"] for d in devices]
        assert all(d["status"] == "active" and d["last_seen_at"] for d in devices), devices
        assert not [line for line in output.lines if "enrollment failed" in line], output.tail()
        said = [line.split("[demo] ", 1)[1] for line in output.lines if "[demo] " in line]
        trained = {line.split(":", 1)[0] for line in said if ": trained on v" in line}
        assert trained >= {d.name for d in plan(DEVICES, tmp_path)}, f"never trained: {sorted(trained)}"

        rounds = _pages(api, "/rounds/?state=completed&page_size=200")
        listed = _pages(api, "/adapter-versions/?adapter__name=digits-lora&page_size=500")
        versions = sorted(listed, key=lambda v: v["number"])
        accuracies = [v["metrics"].get("eval_accuracy") for v in versions]
        _say(f"{len(rounds)} rounds in {watched:.0f}s; accuracy by version: {accuracies}")
        assert len(rounds) >= 6, output.tail(80)
        assert accuracies[0] >= 0.75, "version 1 is not a factory-trained base"
        assert min(accuracies[-3:]) >= SHARED_FLOOR and max(accuracies[1:]) >= accuracies[0], accuracies
        # Each device's first data (its shard) is all in after about a minute; rounds must go on well after.
        last_closed = max(datetime.fromisoformat(r["closed_at"]).timestamp() for r in rounds if r.get("closed_at"))
        assert time.time() - last_closed < 60, "no round completed in the last minute: the fleet stopped learning"

        adapter = next(a for a in _pages(api, "/adapters/?search=digits-lora") if a["name"] == "digits-lora")
        status, summary = api.call("GET", f"/adapters/{adapter['id']}/personalization/")
        assert status == 200, summary
        _say(f"personalization: {summary}")
        latest = _latest_reports(api, devices)
        table = _report_table(devices, latest)
        _say(f"each device's latest report:\n{table}")
        fleet = summary["fleet"]
        assert fleet["devices"] >= DEVICES - 2, table
        assert fleet["serving"]["personal"] >= 3, table  # the sensor and label-name users at least
        assert fleet["mean_gain_points"] > 5, table
        # Plain users (eu-phones: their own label mix only) may measure their own model worse on their held
        # samples, and then serve the shared version; the users who differ gain.
        differ = next(c for c in summary["cohorts"] if c["cohort"] == "us-wearables")
        assert differ["mean_gain_points"] > 10 and differ["devices_gaining"] >= differ["devices"] - 1, table
        for report in latest.values():
            if report and report["val_samples"] >= 10 and report["gain_points"] < 0:
                assert report["serving"] == "shared", table

        status, rejected = api.call("GET", "/deltas/?state=rejected")
        assert status == 200 and rejected["count"] >= 1  # the misbehaving device is caught
        assert "norm_too_large" in {d["rejection_code"] for d in rejected["results"]}
        errors = [line for line in output.lines if SERVER_ERROR.search(line)]
        assert not errors, "\n".join(errors[:20])
    finally:
        if launcher is not None:
            stop_launcher(launcher)
        drop_stack(env)
