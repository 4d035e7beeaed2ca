"""What a device reports about itself: hardware at enrollment, power and memory in heartbeats (Linux)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

POWER_SUPPLY = Path("/sys/class/power_supply")


def hardware_profile() -> dict:
    return {
        "ram_mb": _meminfo("MemTotal"),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "accelerator": "none",
        "os": f"{platform.system()} {platform.release()}",
    }


def free_memory_mb() -> int | None:
    return _meminfo("MemAvailable")


def _meminfo(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    except OSError:
        return None
    return None


def battery() -> tuple[float | None, bool | None]:
    """(percent, charging) from the first battery under /sys/class/power_supply; (None, None) without one."""
    try:
        supplies = sorted(POWER_SUPPLY.iterdir())
    except OSError:
        return None, None
    for supply in supplies:
        try:
            if (supply / "type").read_text().strip() != "Battery":
                continue
            percent = float((supply / "capacity").read_text().strip())
            status = (supply / "status").read_text().strip()
        except (OSError, ValueError):
            continue
        return percent, status in ("Charging", "Full")
    return None, None
