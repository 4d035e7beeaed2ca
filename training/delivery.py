"""What a device receives for an assignment: the signed manifest and where to fetch the bytes."""

from __future__ import annotations

from django.urls import reverse

from training.manifests import manifest_sign
from training.models import Assignment


def assignment_message(assignment: Assignment) -> dict:
    version = assignment.version
    return {
        "assignment_id": assignment.pk,
        "envelope": manifest_sign(device_id=str(assignment.device_id), version=version, assignment_seq=assignment.seq),
        "download_path": reverse("device-blob", kwargs={"sha256": version.blob_sha256}),
        "base_model": {
            "sha256": version.adapter.base_model.weights_sha256,
            "size": version.adapter.base_model.weights_size,
            "download_path": reverse("device-blob", kwargs={"sha256": version.adapter.base_model.weights_sha256}),
        },
    }


def current_assignment(device_id) -> Assignment | None:
    return (
        Assignment.objects.select_related("version__adapter__base_model")
        .filter(device_id=device_id, state__in=(Assignment.State.PENDING, Assignment.State.DELIVERED))
        .order_by("-seq")
        .first()
    )
