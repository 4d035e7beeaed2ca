"""Fuzzing the delta upload: over 10,000 deterministically mutated uploads through the real REST endpoint
(``PUT /api/v1/device/deltas/<sha256>/``) and the real verification service (``delta_verify``, run in process).

Proven for every mutated upload: it is not accepted; the server does not fail (no 5xx, no unhandled exception);
and the device is told why, with a stable code and a sentence, either in the HTTP error body or as the delta's
stored rejection code and detail. The one answer that is not a rejection is by design: a resend of the accepted
control's own signed envelope is acknowledged as the control (the server has that file and reads no further),
which changes nothing. Proven for the fleet after each family of mutations: the only accepted delta
is the family's positive control (a good upload, accepted first, so the harness can be seen to accept and replays
have something to replay), only the control is counted in a round, and no envelope the device did not sign
itself has claimed one of its counters.

The mutations are those of an attacker or a broken device: bit flips in the envelope, the signature and the
file; another device's identity; replays; truncated and oversized bodies; header bombs; wrong dtypes and shapes;
NaN and Inf; a URL naming another file. A mutant the format still allows (a flip that changes nothing the
server reads, or a signed file that is still a valid delta) is drawn again, so every counted upload is one the
server must refuse. Seeds are fixed, so the mutations are the same every run; the devices' ids and keys are new
each run, so the flipped envelope and signature bytes (and a few outcomes among them) vary slightly. ``pytest -s``
prints the outcomes per kind and code.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter

import pytest
from rest_framework.test import APIClient

from edge_agent.delta import encode_delta, sign_delta
from edge_agent.protocol import public_key_from_b64, verify
from tests.training.delta_support import small_delta
from tests.training.upload_fuzz_families import FAMILIES
from tests.training.upload_fuzz_support import (
    CONTROL_COUNTER,
    QUOTAS,
    SEED,
    SMALL_LIMIT,
    SUMMARY,
    UNCLAIMED_CODES,
    Fleet,
    Harness,
    envelope_text,
    put,
)
from training.federation.aggregation_settings import aggregation_settings
from training.federation.verification import delta_verify
from training.models import Delta
from training.registry.services import version_create_seeded

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(adapter, cohort, enrolled, device_token):
    from devices.models import Device

    adapter.cohorts.add(cohort)
    version_create_seeded(adapter=adapter, seed=3)
    a, b, quarantined = enrolled("active", name="a"), enrolled("active", name="b"), enrolled("active", name="q")
    clients = {}
    for device in (a, b, quarantined):
        clients[device.id] = APIClient()
        clients[device.id].credentials(HTTP_AUTHORIZATION=f"Device {device_token(device)}")
    Device.objects.filter(pk=quarantined.device.pk).update(status="quarantined")
    good = encode_delta(small_delta(adapter))
    signed = sign_delta(
        a.key, good, device_id=a.id, adapter=adapter.name, base_version=1, num_samples=32, counter=CONTROL_COUNTER
    )
    response = put(clients[a.id], good, signed["envelope"]["sha256"], envelope_text(signed), signed["signature"])
    assert response.status_code == 201, response.content
    control = delta_verify(delta_id=response.json()["delta_id"])
    assert control.state == Delta.State.ACCEPTED and control.round_id is not None, control.rejection_detail
    return Fleet(adapter, a, b, quarantined, clients, good, control, aggregation_settings(adapter)["max_norm"])


# --- the tests ------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    """The fixtures create several users per test; the production hasher would cost seconds per family."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(scope="module", autouse=True)
def _summary():
    """Quiet the per-request 4xx warnings while fuzzing, and print the table of outcomes at the end."""
    request_log = logging.getLogger("django.request")
    level = request_log.level
    request_log.setLevel(logging.ERROR)
    yield
    request_log.setLevel(level)
    if SUMMARY:
        print("\n" + summary_table(SUMMARY))


def summary_table(summary: dict[str, dict[str, Counter]]) -> str:
    rows = [
        (kind, outcome, count)
        for family in summary.values()
        for kind, c in family.items()
        for outcome, count in c.items()
    ]
    rows.sort()
    by_code = Counter()
    for _, outcome, count in rows:
        code = outcome.rsplit(" ", 1)[-1]
        by_code["no_op (a replay acknowledged as the control)" if code == "no_op" else code] += count
    width = max(len(r[0]) for r in rows) + 2
    outcome_width = max(len(r[1]) for r in rows) + 2
    lines = [f"{'mutation kind':<{width}}{'outcome':<{outcome_width}}{'count':>7}"]
    lines += [f"{kind:<{width}}{outcome:<{outcome_width}}{count:>7}" for kind, outcome, count in rows]
    lines += ["", f"{'rejection code':<{width + outcome_width}}{'count':>7}"]
    lines += [f"{code:<{width + outcome_width}}{count:>7}" for code, count in sorted(by_code.items())]
    lines += [f"{'total mutated uploads':<{width + outcome_width}}{sum(r[2] for r in rows):>7}"]
    return "\n".join(lines)


def test_the_families_together_send_at_least_ten_thousand_mutated_uploads():
    assert set(QUOTAS) == set(FAMILIES)
    assert sum(QUOTAS.values()) >= 10_000


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_mutated_upload_is_rejected_with_a_code_and_message_and_changes_nothing(family, fleet, settings):
    if family == "oversized":
        settings.DELTA_MAX_BYTES = SMALL_LIMIT
    assert len(fleet.good) < settings.DELTA_MAX_BYTES
    harness = Harness(fleet, random.Random(f"{SEED}:{family}"))
    harness.sent.add(fleet.control.sha256)
    started = time.monotonic()
    FAMILIES[family](harness, QUOTAS[family])
    elapsed = time.monotonic() - started
    SUMMARY[family] = harness.tally
    total = sum(sum(c.values()) for c in harness.tally.values())
    print(
        f"\n{family}: {total} uploads in {elapsed:.1f}s ({harness.redraws} mutants redrawn as still valid or "
        f"unchanged, {harness.partials} refused uploads left open for a resume and closed with junk)"
    )

    assert not harness.failures, f"{len(harness.failures)} failures, first ones:\n" + "\n".join(harness.failures[:10])
    assert total == QUOTAS[family]

    # Nothing changed for a rejected upload: the control is the only accepted delta and the only one in a round,
    # and replays of it left it as it was (one row for its file, same bytes, same round).
    control = fleet.control
    accepted = Delta.objects.filter(state__in=(Delta.State.ACCEPTED, Delta.State.AGGREGATED))
    assert list(accepted.values_list("pk", flat=True)) == [control.pk]
    assert list(Delta.objects.filter(round__isnull=False).values_list("pk", flat=True)) == [control.pk]
    assert control.round.deltas.count() == 1
    assert list(Delta.objects.filter(sha256=control.sha256).values_list("pk", "blob_sha256", "round")) == [
        (control.pk, control.sha256, control.round_id)
    ]
    # A counter is claimed only by an envelope its device signed (never by a forgery, another device's
    # envelope, a replayed control or a corrupted transfer); the other devices have claimed none. A file the
    # device did sign and that fails a later check (contents, base version) uses up its own counter by design.
    for delta in Delta.objects.filter(counter_claimed=True).select_related("device"):
        key = public_key_from_b64(delta.device.public_key)
        assert verify(key, delta.envelope, delta.signature), f"delta {delta.pk} claimed counter {delta.counter}"
        assert delta.device_id == fleet.a.device.pk
    reused = Delta.objects.filter(device=fleet.a.device, counter=CONTROL_COUNTER, counter_claimed=True)
    assert list(reused.values_list("pk", flat=True)) == [control.pk]
    assert not Delta.objects.filter(counter_claimed=True, rejection_code__in=UNCLAIMED_CODES).exists()
