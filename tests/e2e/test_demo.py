"""The demo a new user sees: the run command trains a base at the factory, seeds a setup and runs a fleet of 12
simulated devices with the real agent code, whose users differ (their own label mix, sensor, or label names).
A minute in, the newcomer turns automatic release off, runs a staged rollout of their own and turns it on again:
no delta is refused as stale meanwhile, the rollout is not aborted, and versions are released after it.

Checked through the API the dashboard reads, as the first minutes of a new user went wrong before: every device
enrolls (none left dead after a failed enrollment) and trains; rounds go on completing after each device has
seen all of its first data (the samples keep coming); the shared version starts useful (trained at the factory)
and stays above a stated level; devices report their personal model beside the shared one (measured on samples
neither trained on), those whose users differ (the us-wearables cohort: sensor and label names) gain by it, and
a device that measured its own model worse serves the shared version; the devices' users correct and confirm
answers and the devices report it; the misbehaving device is caught; and the server logs no 5xx at all.
"""

from __future__ import annotations

import re
import time
from datetime import datetime

import pytest

from demo.fleet_demo import plan
from edge_agent.personal import CHANCE, sign_test
from edge_agent.protocol import PERSONALIZATION_DEFAULTS
from tests.e2e.support import drop_stack, free_port, stack_env, start_launcher, stop_launcher
from tests.e2e.test_agent_lifecycle import _Api, _say
from tests.e2e.test_federated_round import _admin_token

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
DEVICES = 12
WATCH_SECONDS = 240  # a minute past the three minutes after which the old demo ran dry
# The fleet's learning is judged over rounds, not seconds: a slower host makes fewer rounds in WATCH_SECONDS
# (9 or 10 on a host where the suite took 44 minutes, against 16 where it took 23), so the watch goes on until
# MIN_ROUNDS have completed, up to WATCH_LIMIT seconds.
MIN_ROUNDS = 16
WATCH_LIMIT = 480
SHARED_FLOOR = 0.70  # version 1 scores about 0.80; the fleet's versions stay above this
# A minute in, as a newcomer following the code's advice: automatic release off and a staged rollout of their own
# for STAGED_SECONDS, then automatic release on again; the fleet must keep learning through it.
STAGED_AT = 60
STAGED_SECONDS = 70
SERVER_ERROR = re.compile(r"Internal Server Error|\" 5\d\d |ERROR django\.request|OperationalError|Traceback")


def _set_auto_release(api: _Api, adapter_id: int, on: bool) -> None:
    status, adapter = api.call("GET", f"/adapters/{adapter_id}/")
    assert status == 200, adapter
    body = {"aggregation": {**adapter["aggregation"], "auto_release": on}}
    status, answer = api.call("PUT", f"/adapters/{adapter_id}/aggregation/", body)
    assert status == 200 and answer["aggregation"]["auto_release"] is on, answer


def _staged_rollout(api: _Api) -> dict:
    """What the code advises a newcomer who wants a staged rollout: automatic release off, then a rollout of the
    newest version that passed the release gate to one cohort in two phases, started by an operator. Automatic
    release goes on again later (the caller)."""
    adapter = _seeded_adapter(api)
    _set_auto_release(api, adapter["id"], False)
    versions = _pages(api, "/adapter-versions/?adapter__name=digits-lora&page_size=500")
    good = max((v for v in versions if v["gate"].get("verdict") != "failed"), key=lambda v: v["number"])
    body = {"version": good["id"], "cohort": "eu-phones",
            "phases": [{"percent": 50, "min_soak_seconds": 20}, {"percent": 100}]}  # fmt: skip
    status, rollout = api.call("POST", "/rollouts/", body)
    assert status == 201, rollout
    status, started = api.call("POST", f"/rollouts/{rollout['id']}/start/", {})
    assert status == 200 and started["state"] == "running", started
    _say(f"staged rollout {rollout['id']} of v{good['number']} started")
    return {"adapter_id": adapter["id"], "rollout": rollout["id"], "version": good["number"]}


def _seeded_adapter(api: _Api, timeout: float = 240.0) -> dict:
    """The demo's adapter, once the demo fleet has seeded it (after the server is ready: on a loaded host, well
    after the minute the test waits for)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [a for a in _pages(api, "/adapters/?search=digits-lora") if a["name"] == "digits-lora"]
        if found or time.monotonic() > deadline:
            assert found, f"the demo seeded no digits-lora adapter in {timeout:.0f}s after the server was ready"
            return found[0]
        time.sleep(2)


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
    lines = ["device | user | cohort | version | held | trained | shared | personal | gain | serving | only right"]
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
            f"{report['serving']} | {report.get('shared_only_right')}:{report.get('personal_only_right')}"
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
        time.sleep(max(0.0, STAGED_AT - (time.monotonic() - started)))
        staged = _staged_rollout(api)  # the newcomer's staged rollout, automatic release off meanwhile
        time.sleep(max(0.0, STAGED_AT + STAGED_SECONDS - (time.monotonic() - started)))
        _set_auto_release(api, staged["adapter_id"], True)
        _say(f"automatic release on again at {time.monotonic() - started:.0f}s")
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

        adapter = _seeded_adapter(api)
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
        # Where a device's held slice says the shared version is better beyond chance (the agent's rule,
        # ``edge_agent.personal.choose``), it serves the shared version; a lower figure on a slice that cannot tell
        # the two apart keeps its own model.
        margin = PERSONALIZATION_DEFAULTS["margin"]
        for report in latest.values():
            if not report or report.get("shared_only_right") is None:
                continue
            beyond = sign_test(report["shared_only_right"], report["personal_only_right"]) <= CHANCE
            if report["val_samples"] >= 10 and beyond and report["gain_points"] <= -100 * margin:
                assert report["serving"] == "shared", table

        # Each device's user speaks to some of its answers (demo/fleet_demo.py, ``_user``): the counts reach the
        # server and the corrected and confirmed answers are samples on the devices. (A version's own counts are
        # small here: the demo releases a version every half minute or so, and heartbeats come every 30 s.)
        spoken = {d["name"]: d["feedback"] for d in devices if d.get("feedback")}
        _say(f"users' feedback: { {name: (f['current'], f['previous']) for name, f in sorted(spoken.items())} }")
        assert len(spoken) >= DEVICES - 2, sorted(spoken)
        assert all(f["feedback_samples"] > 0 for f in spoken.values()), spoken

        status, rejected = api.call("GET", "/deltas/?state=rejected&page_size=500")
        assert status == 200 and rejected["count"] >= 1  # the misbehaving device is caught
        codes = {d["rejection_code"] for d in rejected["results"]}
        assert "norm_too_large" in codes and "stale_base_version" not in codes, codes
        # the operator's staged rollout ran its course: never aborted by an automatic release
        status, rollout = api.call("GET", f"/rollouts/{staged['rollout']}/")
        assert status == 200 and rollout["state"] in ("running", "completed"), rollout
        released = [v for v in versions if v["state"] == "released"]
        assert all(v["gate"].get("verdict") != "failed" for v in released), released
        assert released[-1]["number"] > staged["version"], "nothing was released after the staged rollout"
        errors = [line for line in output.lines if SERVER_ERROR.search(line)]
        assert not errors, "\n".join(errors[:20])
    finally:
        if launcher is not None:
            stop_launcher(launcher)
        drop_stack(env)
