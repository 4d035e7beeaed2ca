"""Automatic release: continuous personalization (an adapter's ``auto_release``) rolls a round's new version out
to the cohorts the adapter serves, through the release gate, with a canary share first for a version the server
could not judge. The rollouts it makes are ordinary ones (``training.rollouts.lifecycle``), created by no one."""

from __future__ import annotations

from django.db import transaction

from training.federation.aggregation_settings import aggregation_settings
from training.federation.release_gate import FAILED, gate_record
from training.models import AdapterVersion, Rollout
from training.registry.services import _record as record_training
from training.registry.services import version_transition
from training.rollouts.lifecycle import _lock, _supersede, rollout_create, rollout_start


@transaction.atomic
def round_result_release(*, version: AdapterVersion) -> list[Rollout]:
    """Continuous personalization (the adapter's ``auto_release``): release a round's new version and roll it
    out to every cohort the adapter serves in one phase, if it passes the release gate
    (``training.federation.release_gate``; one that fails stays a candidate, and nothing is rolled out).

    It supersedes an earlier automatic rollout still in flight: one whose phases are done and only waits for
    devices completes (those devices get the newer version instead and count as gone, superseded); one still in
    its phases, or paused, is aborted. An operator's own rollout (staged, guarded) is never touched: in its cohort
    the new version waits, recorded as ``version.release_held`` and shown on that rollout's page, and the next
    round's version is rolled out there once the operator's rollout has ended."""
    version = AdapterVersion.objects.select_for_update(no_key=True).select_related("adapter").get(pk=version.pk)
    if version.state == AdapterVersion.State.REVOKED:
        return []
    if version.state == AdapterVersion.State.CANDIDATE:
        verdict = gate_record(version)
        if verdict["verdict"] == FAILED:
            record_training("version.gate_failed", actor=None, adapter=version.adapter, version=version,
                            reason=verdict["reason"])  # fmt: skip
            return []
        version = version_transition(version=version, action="release", actor=None, reason="auto_release")
    started = []
    for cohort in version.adapter.cohorts.all():
        busy = Rollout.objects.filter(
            cohort=cohort, version__adapter=version.adapter, state__in=[Rollout.State.RUNNING, Rollout.State.PAUSED]
        )
        operators = busy.filter(created_by__isnull=False).first()
        if operators is not None:
            record_training("version.release_held", actor=None, adapter=version.adapter, version=version,
                            rollout=operators.pk, cohort=cohort.name)  # fmt: skip
            continue
        for earlier in busy:
            if earlier.version.number >= version.number:
                break
            _supersede(_lock(earlier), f"superseded by v{version.number}")
        else:
            phases, guards = automatic_plan(version)
            rollout = rollout_create(
                version=version, cohort=cohort, phases=phases, guards=guards, on_breach="rollback", actor=None
            )
            started.append(rollout_start(rollout=rollout, actor=None))
    return started


CANARY_PERCENT = 20  # an automatic rollout of a version the server could not evaluate goes to this share first
CANARY_SOAK_SECONDS = 300
CANARY_REPORTS = 3  # installs whose held-slice reports the canary guard waits for


def automatic_plan(version: AdapterVersion) -> tuple[list[dict], list[dict]]:
    """An automatic rollout's phases and guards. A version the release gate judged on the server's evaluation set
    goes to every device at once. One it could not judge (its family has no evaluation set) goes to a canary share
    of each cohort first, guarded by what those devices measure on their own samples when they install it: the
    mean change of accuracy against the version it replaces (``val_accuracy_change``, each device's install
    report) must not fall below minus the release margin, or the rollout is rolled back and the version marked as
    failed (``training.rollouts.lifecycle.rollout_tick``)."""
    if (version.gate or {}).get("verdict") != "unjudged":
        return [{"percent": 100}], []
    margin = float(aggregation_settings(version.adapter)["release_margin"])
    guards = [{"metric": "val_accuracy_change", "min": -margin, "min_reports": CANARY_REPORTS}]
    return [{"percent": CANARY_PERCENT, "min_soak_seconds": CANARY_SOAK_SECONDS}, {"percent": 100}], guards
