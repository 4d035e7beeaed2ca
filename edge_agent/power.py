"""Power and the decision to train: pluggable power sources and a policy that says yes or no, and why.

A power source's ``read()`` gives a ``PowerState`` or None when the device reports no battery (a gateway on
mains power, a container). ``SysfsPower`` reads Linux's ``/sys/class/power_supply``; ``SimulatedPower`` is a
battery that drains and charges over (injectable) time, for demos and tests.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from datetime import time as clock_time
from pathlib import Path
from typing import Protocol

CHARGING_STATES = {"charging", "full"}


@dataclass(frozen=True)
class PowerState:
    battery_percent: float | None
    charging: bool
    source: str = ""

    def describe(self) -> str:
        level = "unknown level" if self.battery_percent is None else f"{self.battery_percent:.0f}%"
        return f"battery {level}, {'charging' if self.charging else 'on battery'}"


class PowerSource(Protocol):
    def read(self) -> PowerState | None: ...


class SysfsPower:
    """The first battery under ``root`` (``capacity`` and ``status`` files); mains-only or absent: None,
    unless a mains supply reports ``online`` = 1 with a battery (then the battery counts as charging)."""

    def __init__(self, root: Path | str = "/sys/class/power_supply"):
        self.root = Path(root)

    @staticmethod
    def _text(path: Path) -> str | None:
        try:
            return path.read_text().strip()
        except OSError:
            return None

    def read(self) -> PowerState | None:
        if not self.root.is_dir():
            return None
        mains_online = False
        battery: PowerState | None = None
        for supply in sorted(self.root.iterdir()):
            kind = (self._text(supply / "type") or "").lower()
            if kind in {"mains", "usb"} and self._text(supply / "online") == "1":
                mains_online = True
            capacity = self._text(supply / "capacity")
            if battery is None and (kind == "battery" or capacity is not None) and kind not in {"mains", "usb"}:
                try:
                    percent = float(capacity) if capacity is not None else None
                except ValueError:
                    percent = None
                status = (self._text(supply / "status") or "").lower()
                battery = PowerState(percent, status in CHARGING_STATES, f"sysfs:{supply.name}")
        if battery is not None and mains_online and not battery.charging:
            battery = PowerState(battery.battery_percent, True, battery.source)
        return battery


class SimulatedPower:
    """A battery at ``level`` percent that loses ``drain_per_hour`` on battery and gains ``charge_per_hour``
    while plugged in; it is plugged in and unplugged at random (on average every ``mean_period_hours``),
    reproducibly from ``seed``. ``clock`` returns seconds (``time.monotonic`` by default)."""

    def __init__(
        self,
        *,
        level: float = 80.0,
        charging: bool = False,
        drain_per_hour: float = 10.0,
        charge_per_hour: float = 40.0,
        mean_period_hours: float = 3.0,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.level, self.charging = float(level), bool(charging)
        self.drain_per_hour, self.charge_per_hour = drain_per_hour, charge_per_hour
        self.mean_period_hours = mean_period_hours
        self.random = random.Random(seed)  # noqa: S311 - a simulation, not security
        self.clock = clock
        self.last = clock()
        self.next_switch = self.last + self._period()

    def _period(self) -> float:
        return self.random.expovariate(1 / self.mean_period_hours) * 3600

    def _advance(self, until: float) -> None:
        while self.last < until:
            step_end = min(until, self.next_switch)
            hours = (step_end - self.last) / 3600
            rate = self.charge_per_hour if self.charging else -self.drain_per_hour
            self.level = min(100.0, max(0.0, self.level + rate * hours))
            self.last = step_end
            if step_end >= self.next_switch:
                self.charging = not self.charging
                self.next_switch = step_end + self._period()

    def read(self) -> PowerState:
        self._advance(self.clock())
        return PowerState(round(self.level, 1), self.charging, "simulated")


@dataclass
class TrainingPolicy:
    """When to train: at least ``min_new_samples`` new samples; charging, or the battery at or above
    ``min_battery_percent``; with ``require_idle``, the device not in use (when the caller can tell); and,
    when set, the local time inside ``window`` (``(start, end)``, may wrap past midnight, e.g. 22:00 to 06:00)."""

    min_new_samples: int = 32
    min_battery_percent: float = 50.0
    window: tuple[clock_time, clock_time] | None = None
    require_idle: bool = False

    def _in_window(self, now: datetime) -> bool:
        start, end = self.window
        moment = now.time()
        if start <= end:
            return start <= moment < end
        return moment >= start or moment < end

    def waiting_for(self, *, power: PowerState | None, now: datetime | None = None, idle: bool | None = None) -> str:
        """What the device waits for before it may train, whatever its samples (power, use, the window): a
        sentence, or "" when nothing holds it back."""
        if power is not None and not power.charging:
            if power.battery_percent is None:
                return "on battery at an unknown level: waiting for a charger"
            if power.battery_percent < self.min_battery_percent:
                return (
                    f"on battery at {power.battery_percent:.0f}%, below the {self.min_battery_percent:.0f}% "
                    "threshold: waiting for a charger"
                )
        if self.require_idle and idle is False:
            return "the device is in use: waiting until it is idle"
        if self.window is not None:
            now = now or datetime.now()
            if not self._in_window(now):
                start, end = self.window
                return (
                    f"outside the training window {start.strftime('%H:%M')}-{end.strftime('%H:%M')} "
                    f"(now {now.strftime('%H:%M')})"
                )
        return ""

    def samples_status(self, *, stored: int, new: int) -> dict:
        """Where the device stands against the sample rule, for ``edge-agent status`` and ``Agent.status()``: the
        samples it holds, how many of them no shared pass trained on yet (``new``), how many new ones the next shared
        pass waits for (``min_new_samples``) and how many more that is (``new_needed``), with a sentence saying so. An
        application that hands the agent a few samples at a time learns here why no pass trains yet."""
        needed = max(0, self.min_new_samples - new)
        if needed:
            note = (
                f"the next training pass (the shared one, whose change is uploaded) waits for {needed} more new "
                f"samples ({new} of the {self.min_new_samples} min_new_samples); `edge-agent configure "
                "--min-new-samples N` changes that, `edge-agent train-once --force` trains now"
            )
        else:
            note = (
                f"{new} new samples, enough for a training pass (min_new_samples {self.min_new_samples}): the power "
                "rules and the next training check decide when"
            )
        return {
            "stored": stored,
            "new": new,
            "min_new_samples": self.min_new_samples,
            "new_needed": needed,
            "note": note,
        }

    def decide(
        self, *, new_samples: int, power: PowerState | None, now: datetime | None = None, idle: bool | None = None
    ) -> tuple[bool, str]:
        """``(train?, reason)``, the reason a sentence for logs and the dashboard (``idle`` None: unknown)."""
        if new_samples < self.min_new_samples:
            return False, f"too few new samples: {new_samples} of the {self.min_new_samples} needed"
        waiting = self.waiting_for(power=power, now=now, idle=idle)
        if waiting:
            return False, waiting
        power_text = "no battery (mains power)" if power is None else power.describe()
        return True, f"{new_samples} new samples, {power_text}"
