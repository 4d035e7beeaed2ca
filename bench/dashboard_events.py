"""The audit trails of the dashboard benchmark's data (``bench/dashboard_data.py``): the devices' events (the
busy device gets the most) and the training events of the adapters, versions, rounds and rollouts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dashboard_fleet import _batched

if TYPE_CHECKING:
    from dashboard import Sizes


def create_device_events(sz: Sizes, rng, now, admin, devices, busy) -> None:
    """Each device's events: enrolled, the step to its status, then online and offline over the last 2 days."""
    from datetime import timedelta

    from devices.models import DeviceEvent, DeviceStatus

    hour = timedelta(hours=1)

    kinds_after = {
        DeviceStatus.ACTIVE: "approved",
        DeviceStatus.PENDING: "updated",
        DeviceStatus.QUARANTINED: "quarantined",
        DeviceStatus.RETIRED: "retired",
    }
    events = []
    for device in devices:
        extra = (sz.deltas // 1000) if device is busy else 0
        for j in range(sz.events_per_device + extra):
            if j == 0:
                kind, actor, at = "enrolled", None, device.enrolled_at
            elif j == 1:
                kind, actor, at = kinds_after[device.status], admin, device.enrolled_at + hour
            else:
                kind, actor = ("online" if j % 2 else "offline"), None
                at = now - timedelta(seconds=rng.uniform(0, 2 * 86400))
            events.append(
                DeviceEvent(
                    device=device,
                    kind=kind,
                    actor=actor,
                    actor_label=actor.username if actor else ("device" if kind == "enrolled" else "system"),
                    detail={"token": "fet_0001"} if kind == "enrolled" else {},
                    created_at=at,
                )
            )
    _batched(DeviceEvent, events)


def create_training_events(admin, adapters, versions, rounds, rollouts) -> None:
    """The training events (the audit trail) of the adapters, their versions, the rounds and the rollouts."""
    from datetime import timedelta

    from training.models import TrainingEvent

    hour = timedelta(hours=1)

    tevents = []
    for adapter in adapters:
        tevents.append(
            TrainingEvent(
                kind="adapter.created",
                actor=admin,
                actor_label=admin.username,
                adapter=adapter,
                detail={"rank": 8},
                created_at=adapter.created_at,
            )
        )
        for v in versions[adapter.pk]:
            tevents.append(
                TrainingEvent(
                    kind="version.created",
                    actor=None if v.source == "round" else admin,
                    actor_label="system" if v.source == "round" else admin.username,
                    adapter=adapter,
                    version=v,
                    detail={"source": v.source},
                    created_at=v.created_at,
                )
            )
    for r in rounds:
        tevents.append(
            TrainingEvent(
                kind="round.opened",
                actor=admin,
                actor_label=admin.username,
                adapter_id=r.adapter_id,
                detail={"round": r.pk},
                created_at=r.created_at,
            )
        )
        if r.closed_at:
            tevents.append(
                TrainingEvent(
                    kind="round.closed",
                    actor=None,
                    actor_label="system",
                    adapter_id=r.adapter_id,
                    detail={"round": r.pk, "reason": "buffer_full"},
                    created_at=r.closed_at,
                )
            )
    for r in rollouts:
        kinds = ["rollout.created"]
        if r.started_at:
            kinds += ["rollout.started"] + ["rollout.phase"] * r.current_phase
        if r.state in ("completed", "rolled_back", "paused"):
            kinds.append(f"rollout.{r.state}")
        for i, kind in enumerate(kinds):
            tevents.append(
                TrainingEvent(
                    kind=kind,
                    actor=admin if i < 2 else None,
                    actor_label=admin.username if i < 2 else "system",
                    adapter=r.version.adapter,
                    version=r.version,
                    detail={"rollout": r.pk},
                    created_at=r.created_at + i * hour,
                )
            )
    _batched(TrainingEvent, tevents)
