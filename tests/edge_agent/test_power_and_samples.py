"""When to train (power, samples, time window), and the on-disk sample store and replay buffer."""

from datetime import datetime, time

import numpy as np

from edge_agent.power import PowerState, SimulatedPower, SysfsPower, TrainingPolicy
from edge_agent.samples import ReplayBuffer, SampleStore, SimulatedStream, device_split, local_split

NIGHT = (time(22, 0), time(6, 0))


def test_policy_refuses_with_a_reason_for_each_rule():
    policy = TrainingPolicy(min_new_samples=32, min_battery_percent=50, window=NIGHT)
    night, day = datetime(2025, 1, 1, 23, 30), datetime(2025, 1, 1, 14, 5)
    plugged, low, high = PowerState(20, True), PowerState(35, False), PowerState(80, False)

    ok, reason = policy.decide(new_samples=10, power=plugged, now=night)
    assert not ok and reason == "too few new samples: 10 of the 32 needed"
    ok, reason = policy.decide(new_samples=40, power=low, now=night)
    assert not ok and reason == "on battery at 35%, below the 50% threshold: waiting for a charger"
    ok, reason = policy.decide(new_samples=40, power=PowerState(None, False), now=night)
    assert not ok and "unknown level" in reason
    ok, reason = policy.decide(new_samples=40, power=plugged, now=day)
    assert not ok and reason == "outside the training window 22:00-06:00 (now 14:05)"

    assert policy.decide(new_samples=40, power=plugged, now=night) == (True, "40 new samples, battery 20%, charging")
    assert policy.decide(new_samples=40, power=high, now=datetime(2025, 1, 2, 5, 59))[0]  # window wraps midnight
    assert policy.decide(new_samples=32, power=None, now=night) == (True, "32 new samples, no battery (mains power)")
    assert TrainingPolicy(min_new_samples=1).decide(new_samples=1, power=high)[0]  # no window: any time
    busy = TrainingPolicy(min_new_samples=1, require_idle=True)
    refused = (False, "the device is in use: waiting until it is idle")
    assert busy.decide(new_samples=5, power=high, idle=False) == refused
    assert busy.decide(new_samples=5, power=high, idle=True)[0]


def test_sysfs_power_reads_a_battery_and_is_none_without_one(tmp_path):
    assert SysfsPower(tmp_path / "missing").read() is None
    root = tmp_path / "power_supply"
    (root / "AC").mkdir(parents=True)
    (root / "AC" / "type").write_text("Mains\n")
    (root / "AC" / "online").write_text("0\n")
    assert SysfsPower(root).read() is None  # mains only
    battery = root / "BAT0"
    battery.mkdir()
    (battery / "type").write_text("Battery\n")
    (battery / "capacity").write_text("42\n")
    (battery / "status").write_text("Discharging\n")
    assert SysfsPower(root).read() == PowerState(42.0, False, "sysfs:BAT0")
    (battery / "status").write_text("Charging\n")
    assert SysfsPower(root).read().charging
    (battery / "status").write_text("Not charging\n")
    (root / "AC" / "online").write_text("1\n")
    assert SysfsPower(root).read().charging  # plugged in, even if the battery holds its charge


def test_simulated_power_drains_and_charges_reproducibly():
    now = [0.0]
    readings = []
    for _ in range(2):
        now[0] = 0.0
        power = SimulatedPower(level=60, seed=3, clock=lambda: now[0])
        trace = []
        for _ in range(48):
            now[0] += 1800
            trace.append(power.read())
        readings.append(trace)
    assert readings[0] == readings[1]
    levels = [r.battery_percent for r in readings[0]]
    assert {r.charging for r in readings[0]} == {True, False} and min(levels) < 60 < max(levels)
    assert all(0 <= level <= 100 for level in levels)


def stream_data(n=100):
    return {"x": np.arange(n * 4, dtype=np.float32).reshape(n, 4), "y": np.arange(n) % 10}


def test_sample_store_appends_survives_restart_and_counts_new_samples(tmp_path):
    data = stream_data()
    store = SampleStore(tmp_path / "samples")
    source = SimulatedStream(data, np.arange(50), per_poll=16, seed=1)
    assert store.collect(source, max_polls=2) == 32
    assert len(store) == 32 and store.new_count() == 32
    store.mark_trained()
    assert store.new_count() == 0

    restarted = SampleStore(tmp_path / "samples")  # after a reboot: a new stream resumes where the store ends
    assert restarted.collect(SimulatedStream(data, np.arange(50), per_poll=16, seed=1)) == 18
    assert len(restarted) == 50 and restarted.new_count() == 18 and restarted.trained_count == 32
    everything = restarted.load()
    assert sorted(everything["y"].tolist()) == sorted(data["y"][:50].tolist())  # every sample once
    assert np.array_equal(restarted.load(30, 40)["x"], everything["x"][30:40])
    (tmp_path / "samples" / ".shard-00000009-4.npz.123.tmp").write_bytes(b"torn")  # a write cut short
    assert len(SampleStore(tmp_path / "samples")) == 50

    train, val = local_split(everything, val_fraction=0.2)
    assert len(val["y"]) == 10 and len(train["y"]) == 40
    assert np.array_equal(local_split(restarted.load(0, 25), val_fraction=0.2)[1]["x"], val["x"][:5])  # stable

    train, val, held = device_split(everything)  # the agent's slices: of every ten, the 5th validates, the 10th held
    assert (len(train["y"]), len(val["y"]), len(held["y"])) == (40, 5, 5)
    assert np.array_equal(held["x"], everything["x"][9::10]) and np.array_equal(val["x"], everything["x"][4::10])
    assert np.array_equal(device_split(restarted.load(0, 30))[2]["x"], held["x"][:3])  # stable as the store grows


def test_replay_buffer_is_a_persisted_reservoir(tmp_path):
    path = tmp_path / "replay.npz"
    buffer = ReplayBuffer(path, capacity=50, seed=0)
    buffer.add({"x": np.zeros((30, 2)), "y": np.arange(30)})
    assert len(buffer) == 30
    buffer.add({"x": np.ones((970, 2)), "y": np.arange(30, 1000)})
    assert len(buffer) == 50 and buffer.seen == 1000
    buffer.save()
    again = ReplayBuffer(path, capacity=999)
    assert again.capacity == 50 and again.seen == 1000
    assert np.array_equal(again.data["y"], buffer.data["y"])
    batch = again.sample(8, generator=np.random.default_rng(0))
    assert batch["x"].shape == (8, 2) and set(batch["y"].tolist()) <= set(buffer.data["y"].tolist())

    counts = np.zeros(10)  # uniform over everything seen: each tenth of the stream holds about a tenth
    for seed in range(40):
        reservoir = ReplayBuffer(tmp_path / f"r{seed}.npz", capacity=50, seed=seed)
        for start in range(0, 1000, 100):
            reservoir.add({"y": np.arange(start, start + 100)})
        counts += np.bincount(reservoir.data["y"] // 100, minlength=10)
    assert counts.min() > 0.6 * counts.mean() and counts.max() < 1.4 * counts.mean()
