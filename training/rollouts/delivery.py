"""What a device receives for an assignment: the signed manifest and where to fetch the bytes."""

from __future__ import annotations

from django.urls import reverse

from training.models import Assignment
from training.rollouts.manifests import manifest_sign


def assignment_message(assignment: Assignment) -> dict:
    version = assignment.version
    return {
        "assignment_id": assignment.pk,
        "envelope": manifest_sign(
            device_id=str(assignment.device_id),
            version=version,
            assignment_seq=assignment.seq,
            protocol=assignment.device.protocol,
        ),
        "download_path": reverse("device-blob", kwargs={"sha256": version.blob_sha256}),
        "base_model": {
            "sha256": version.adapter.base_model.weights_sha256,
            "size": version.adapter.base_model.weights_size,
            "download_path": reverse("device-blob", kwargs={"sha256": version.adapter.base_model.weights_sha256}),
        },
    }


def current_assignment(device_id, *, unacknowledged: bool = False) -> Assignment | None:
    """The newest assignment the device has not installed (or failed) yet; with ``unacknowledged``, None when
    the device already acknowledged that one (the socket's hello sends it only until then; REST always answers).

    Asked on every agent hello, where most devices have nothing pending: the first query is a narrow one
    (an index-only look-up that Django compiles in a fraction of the joined query's time); the assignment
    with its version, adapter and base model is loaded only when there is one."""
    pending = (
        Assignment.objects.filter(device_id=device_id, state__in=(Assignment.State.PENDING, Assignment.State.DELIVERED))
        .order_by("-seq")
        .values_list("pk", "acked_at")
        .first()
    )
    if pending is None or (unacknowledged and pending[1] is not None):
        return None
    return Assignment.objects.select_related("version__adapter__base_model", "device").filter(pk=pending[0]).first()
