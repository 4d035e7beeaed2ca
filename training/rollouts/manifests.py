"""Signing adapter manifests with the server key (the format and the checks live in edge_agent.manifest)."""

from __future__ import annotations

import time

from devices.server_key import key_rotations, server_private_key
from edge_agent.manifest import PURPOSE
from edge_agent.protocol import PROTOCOL_VERSION, sign
from training.registry.personalization_settings import personalization_settings

MANIFEST_LIFETIME_SECONDS = 7 * 24 * 3600


def training_config(adapter) -> dict:
    """What a device needs to build the base and train this adapter, signed into every manifest."""
    from training.federation.aggregation_settings import aggregation_settings

    settings_ = aggregation_settings(adapter)
    return {
        "family": adapter.base_model.family,
        "family_config": adapter.base_model.family_config,
        "rank": adapter.rank,
        "alpha": adapter.alpha,
        "dropout": adapter.dropout,
        "target_modules": adapter.target_modules,
        "modules_to_save": adapter.modules_to_save,
        "ffa": bool(settings_["ffa"] or settings_["strategy"] == "ffa_lora"),
        # How the device makes its own model beside the shared one (every setting, defaults resolved).
        "personalization": personalization_settings(adapter),
        # The bound verification holds a delta's L2 norm to (norm_too_large): the device clips below it.
        "max_norm": None if settings_["max_norm"] is None else float(settings_["max_norm"]),
        # FedProx's proximal weight on the device's shared pass (0: plain training).
        "proximal_mu": float(settings_["proximal_mu"]),
    }


def manifest_sign(
    *,
    device_id: str,
    version,
    assignment_seq: int,
    lifetime: int = MANIFEST_LIFETIME_SECONDS,
    protocol: int = PROTOCOL_VERSION,
) -> dict:
    """The signed manifest envelope (``edge_agent.wire.ManifestEnvelope``), signed in the canonical form of the
    ``protocol`` the device speaks (``Device.protocol``): a protocol-1 agent checks Python's sorted JSON, which
    writes the training setting's floats differently from RFC 8785."""
    issued = time.time()
    manifest = {
        "purpose": PURPOSE,
        "device_id": str(device_id),
        "adapter": version.adapter.name,
        "version": version.number,
        "sha256": version.blob_sha256,
        "size": version.size,
        "base_model_sha256": version.adapter.base_model.weights_sha256,
        "assignment_seq": assignment_seq,
        "issued_at": round(issued, 3),
        "expires_at": round(issued + lifetime, 3),
        "training": training_config(version.adapter),
    }
    per_class = (version.metrics or {}).get("eval_class_accuracy")
    if per_class:  # the server's evaluation per class, which a device without a held slice weighs by its labels
        manifest["training"]["class_accuracy"] = per_class
    envelope = {"manifest": manifest, "signature": sign(server_private_key(), manifest, protocol=protocol)}
    rotations = key_rotations()
    if rotations:  # how a device that pinned an older server key comes to trust the one that signed this
        envelope["key_rotations"] = rotations
    return envelope
