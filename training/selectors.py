"""Reads worth naming."""

from __future__ import annotations

from training.models import Adapter, AdapterVersion, Assignment, BaseModel


def device_may_download(device, sha256: str) -> bool:
    """A device may fetch the versions it has been assigned (not revoked ones) and the base weights of the
    adapters serving its cohort; nothing else: not another device's assignments, not another cohort's base."""
    assigned = Assignment.objects.filter(device=device, version__blob_sha256=sha256).exclude(
        version__state=AdapterVersion.State.REVOKED
    )
    if assigned.exists():
        return True
    adapters = Adapter.objects.filter(cohorts=device.cohort_id)
    return BaseModel.objects.filter(adapters__in=adapters, weights_sha256=sha256).exists()
