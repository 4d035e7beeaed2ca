"""The release gate: no version reaches devices when it is worse than what they run (README.md, "The release gate").

A version is judged on the server's evaluation set (``metrics.eval_accuracy``, else ``eval_loss``) against the
best released version of its adapter: the version devices would get instead of it, or one that was judged as
good and is still live. It fails when it is worse by more than the adapter's ``release_margin`` (a fraction:
0.01 is one point of accuracy, or a loss 1% higher). Judging against the best released version rather than the
newest keeps a run of versions each a little worse from walking the fleet down one margin at a time.

The verdict is stored on the version (``AdapterVersion.gate``) whenever it is judged: when its round makes it,
and again when anyone releases it or starts a rollout of it, since the best released version may have changed
meanwhile. A version that failed stays a candidate: automatic release skips it, and an operator releases it or
rolls it out only with an explicit override, which is recorded with who and why. A version with no evaluation
(its family has no evaluation set) is ``unjudged``: the gate does not hold it back; a rollout's guards on what
devices report are what judges it then.
"""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from core.errors import Conflict, Invalid
from training.federation.aggregation_settings import aggregation_settings
from training.models import AdapterVersion
from training.registry.services import _record, version_transition

PASSED, FAILED, UNJUDGED, OVERRIDDEN = "passed", "failed", "unjudged", "overridden"
# Higher is better for accuracy, lower for loss; the first a version has is the one it is judged on.
METRICS = (("eval_accuracy", 1), ("eval_loss", -1))


def _metric(version: AdapterVersion) -> tuple[str, float] | None:
    for name, _ in METRICS:
        value = (version.metrics or {}).get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value == value:
            return name, float(value)
    return None


def reference_version(version: AdapterVersion) -> AdapterVersion | None:
    """The best released, live version of ``version``'s adapter on ``version``'s own metric (the newest of
    equals), other than ``version`` itself; None when none is released or none has that metric."""
    judged = _metric(version)
    if judged is None:
        return None
    name, _ = judged
    sign = dict(METRICS)[name]
    released = (
        AdapterVersion.objects.filter(adapter_id=version.adapter_id, state=AdapterVersion.State.RELEASED)
        .exclude(pk=version.pk)
        .order_by("-number")
    )
    best = None
    for other in released.only("pk", "number", "metrics"):
        value = (other.metrics or {}).get(name)
        if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
            continue
        if best is None or sign * value > sign * best[1]:
            best = (other, float(value))
    return best[0] if best else None


def judge(version: AdapterVersion, *, margin: float | None = None) -> dict:
    """The gate's verdict on ``version`` now (not stored): ``{"verdict", "reason", "metric", "value",
    "reference", "reference_value", "margin", "judged_at"}``."""
    if margin is None:
        margin = float(aggregation_settings(version.adapter)["release_margin"])
    verdict = {"margin": margin, "judged_at": timezone.now().isoformat()}
    judged = _metric(version)
    if judged is None:
        return {**verdict, "verdict": UNJUDGED, "reason": "no evaluation on the server's evaluation set"}
    name, value = judged
    verdict.update(metric=name, value=value)
    reference = reference_version(version)
    if reference is None:
        return {**verdict, "verdict": PASSED, "reason": f"no released version with {name} to compare with"}
    ref_value = float(reference.metrics[name])
    verdict.update(reference=reference.number, reference_value=ref_value)
    if name == "eval_loss":
        worse = value > ref_value * (1 + margin)
        gap = f"{name} {value:.4g} is above v{reference.number}'s {ref_value:.4g} by more than {margin:.0%}"
        fine = f"{name} {value:.4g} against v{reference.number}'s {ref_value:.4g} (margin {margin:.0%})"
    else:
        worse = value < ref_value - margin
        points = (ref_value - value) * 100
        gap = (
            f"{name} {value:.3f} is {points:.1f} points below v{reference.number}'s {ref_value:.3f}, "
            f"the best released version (the margin is {margin * 100:.1f} points)"
        )
        fine = f"{name} {value:.3f} against v{reference.number}'s {ref_value:.3f} (margin {margin * 100:.1f} points)"
    if worse:
        return {**verdict, "verdict": FAILED, "reason": gap}
    return {**verdict, "verdict": PASSED, "reason": fine}


def gate_record(version: AdapterVersion) -> dict:
    """Judge ``version`` and store the verdict on it; an override stays an override."""
    if (version.gate or {}).get("verdict") == OVERRIDDEN:
        return version.gate
    verdict = judge(version)
    AdapterVersion.objects.filter(pk=version.pk).update(gate=verdict)
    version.gate = verdict
    return verdict


def failed(version: AdapterVersion) -> bool:
    return (version.gate or {}).get("verdict") == FAILED


class ReleaseGateFailed(Conflict):
    """A version the gate judged worse than the best released one; only an override releases it."""


def gate_check(version: AdapterVersion, *, override: bool, actor, reason: str, doing: str) -> dict:
    """Judge ``version`` before it reaches devices (``doing``: "release" or "roll out"). A failed verdict
    raises ``ReleaseGateFailed`` unless ``override``; an override of a failed verdict needs a reason and is
    recorded (``version.gate_overridden``) with who and why, and the version keeps it as its verdict."""
    verdict = gate_record(version)
    if verdict["verdict"] != FAILED:
        return verdict
    if not override:
        raise ReleaseGateFailed(
            "release_gate_failed",
            f"{version} failed the release gate: {verdict['reason']}. It stays a candidate; to {doing} it anyway, "
            "send override: true with a reason",
            details={"gate": verdict},
        )
    if not (reason or "").strip():
        raise Invalid("override_reason_required", f"overriding the release gate of {version} needs a reason")
    overridden = {**verdict, "verdict": OVERRIDDEN, "overridden_by": getattr(actor, "username", "system"),
                  "override_reason": reason[:300], "failed_reason": verdict["reason"]}  # fmt: skip
    AdapterVersion.objects.filter(pk=version.pk).update(gate=overridden)
    version.gate = overridden
    _record("version.gate_overridden", actor=actor, adapter=version.adapter, version=version,
            reason=reason[:300], gate=verdict["reason"], doing=doing)  # fmt: skip
    return overridden


@transaction.atomic
def version_release(*, version: AdapterVersion, actor, reason: str = "", override: bool = False) -> AdapterVersion:
    """An operator releases a candidate: through the gate (``gate_check``), then the registry's transition."""
    locked = AdapterVersion.objects.select_for_update(no_key=True).select_related("adapter").get(pk=version.pk)
    if locked.state == AdapterVersion.State.CANDIDATE:
        gate_check(locked, override=override, actor=actor, reason=reason, doing="release")
    return version_transition(version=locked, action="release", actor=actor, reason=reason)
