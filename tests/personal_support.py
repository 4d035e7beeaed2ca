"""What the personalization tests share: a heartbeat's ``personal`` object and a measurement stored through the
real service (tests/devices/test_personalization_*.py, tests/frontend/test_personalization_*.py)."""

from __future__ import annotations

from devices.personalization import personal_report_record

NOW = 1764040000.0  # 2025-11-25 03:06:40 UTC


def figures(**changes) -> dict:
    """A good ``personal`` object (the contract's example), with ``changes``."""
    return {
        "adapter": "digits-lora",
        "version": 3,
        "method": "ditto",
        "serving": "personal",
        "shared_accuracy": 0.81,
        "personal_accuracy": 0.93,
        "val_samples": 40,
        "trained_samples": 160,
        "updated_at": NOW,
        **changes,
    }


def measure(device, *, at: float, shared: float, personal: float, **changes):
    """Store one measurement of ``device`` as a heartbeat would (``devices.personalization``)."""
    values = figures(updated_at=at, shared_accuracy=shared, personal_accuracy=personal, **changes)
    return personal_report_record(device_id=device.pk, personal=values)
