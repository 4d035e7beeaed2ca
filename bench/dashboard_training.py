"""The training half of the dashboard benchmark's data (``bench/dashboard_data.py``): the rounds over the last
48 h, their deltas (some rejected, with the rejection codes of ``REJECTION_CODES``), and the rollouts with their
assignments."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dashboard_fleet import _batched, _sha

if TYPE_CHECKING:
    from dashboard import Sizes

REJECTION_CODES = [
    ("norm_too_large", 40, "update norm 2.1e3 is above the bound 1000"),
    ("stale_base_version", 25, "base version is more than 5 behind"),
    ("bad_signature", 15, "envelope signature does not verify"),
    ("spec_mismatch", 10, "tensor lora_A of layer 3 has shape [8, 256], expected [8, 384]"),
    ("not_finite", 5, "NaN in lora_B of layer 1"),
    ("hash_mismatch", 5, "stored bytes do not match the envelope's sha256"),
]


def create_rounds(now, admin, adapters, versions, rounds_per_adapter) -> tuple:
    """The rounds, over the last 48 h per adapter: the completed ones made the newest versions; the last one
    of each adapter is collecting. Returns them and the first adapter's collecting round."""
    from datetime import timedelta

    from training.models import AdapterVersion, Round

    hour = timedelta(hours=1)

    rounds = []
    round_results = []  # (round index, version)
    for adapter in adapters:
        r = rounds_per_adapter[adapter.pk]
        chain = versions[adapter.pk]
        n_completed = min(len(chain) - 1, max(0, r - 3))
        window = 48 * hour / r
        for j in range(r):
            created = now - 48 * hour + j * window
            last = j == r - 1
            if last:
                state = Round.State.COLLECTING
            elif j < n_completed:
                state = Round.State.COMPLETED
            elif j == r - 2:
                state = Round.State.AGGREGATING
            else:
                state = Round.State.FAILED
            if state == Round.State.COMPLETED:
                result = chain[len(chain) - n_completed + j]
                base_version = chain[len(chain) - n_completed + j - 1]
            else:
                result, base_version = None, chain[-1]
            closed = None if last else created + window * 0.9
            rounds.append(
                Round(
                    adapter=adapter,
                    base_version=base_version,
                    strategy="fedavg",
                    params={},
                    buffer_size=500,
                    min_deltas=10,
                    deadline=created + 6 * hour,
                    state=state,
                    close_reason="" if last else "buffer_full",
                    failure="worker lost" if state == Round.State.FAILED else "",
                    attempts=0 if last else 1,
                    stats={"deltas": 480, "norm_mean": 0.42} if state == Round.State.COMPLETED else {},
                    opened_by=admin,
                    created_at=created,
                    closed_at=closed,
                    completed_at=closed + 2 * timedelta(minutes=1) if state == Round.State.COMPLETED else None,
                )
            )
            if result is not None:
                round_results.append((len(rounds) - 1, result))
    rounds = Round.objects.bulk_create(rounds)
    for index, version in round_results:
        version.round = rounds[index]
    AdapterVersion.objects.bulk_update([v for _, v in round_results], ["round"], batch_size=1000)
    collecting = next(r for r in rounds if r.adapter_id == adapters[0].pk and r.state == Round.State.COLLECTING)
    return rounds, collecting


def create_deltas(sz: Sizes, rng, now, rounds, busy, active_of_adapter) -> None:
    """The deltas, spread over the rounds (and so over 48 h)."""
    from datetime import timedelta

    from training.models import Delta, Round

    codes = [code for code, weight, _ in REJECTION_CODES for _ in range(weight)]
    details = {code: detail for code, _, detail in REJECTION_CODES}
    counter = 0
    batch = []
    for g, round_ in enumerate(rounds):
        count = sz.deltas // len(rounds) + (1 if g < sz.deltas % len(rounds) else 0)
        start = round_.created_at
        end = round_.closed_at or now
        pool = active_of_adapter[round_.adapter_id]
        first = counter + 1
        for _ in range(count):
            counter += 1
            device = busy if counter % 200 == 0 else rng.choice(pool)
            at = start + (end - start) * rng.random()
            draw = rng.random()
            if draw < 0.08 or counter == first + 1:  # every round has a rejected delta, even a tiny one
                state, code = Delta.State.REJECTED, rng.choice(codes)
            elif round_.state == Round.State.COMPLETED:
                state, code = Delta.State.AGGREGATED, ""
            elif round_.state == Round.State.COLLECTING and draw > 0.96:
                state, code = Delta.State.RECEIVED, ""
            else:
                state, code = Delta.State.ACCEPTED, ""
            sha = _sha("delta", counter)
            batch.append(
                Delta(
                    device=device,
                    adapter_id=round_.adapter_id,
                    adapter_name=round_.adapter.name,
                    base_version_number=round_.base_version.number,
                    base_version=round_.base_version,
                    round=round_,
                    sha256=sha,
                    blob_sha256="" if code == "too_large" else sha,
                    size=4_200_000,
                    num_samples=rng.choice([32, 64, 128]),
                    counter=counter,
                    counter_claimed=code not in ("bad_signature", "hash_mismatch"),
                    envelope={"sha256": sha, "counter": counter, "adapter": round_.adapter.name},
                    signature=_sha("sig", counter)[:86],
                    metrics={"train_loss": round(rng.uniform(0.2, 1.2), 3)},
                    channel=Delta.Channel.WEBSOCKET if rng.random() < 0.9 else Delta.Channel.REST,
                    state=state,
                    rejection_code=code,
                    rejection_detail=details.get(code, ""),
                    staleness=rng.randint(0, 3),
                    norm=round(rng.uniform(0.1, 2.0), 3),
                    encoding="f32",
                    received_at=at,
                    verified_at=None if state == Delta.State.RECEIVED else at + timedelta(seconds=1),
                )
            )
            if len(batch) >= 5000:
                Delta.objects.bulk_create(batch)
                batch = []
    if batch:
        Delta.objects.bulk_create(batch)


def create_rollouts(sz: Sizes, now, admin, cohorts, adapter_of_cohort, released) -> list:
    """The rollouts, one every 1.5 days; the newest is running on the first cohort."""
    from datetime import timedelta

    from training.models import Rollout

    hour, day = timedelta(hours=1), timedelta(days=1)

    phases = [
        {"percent": 10, "min_soak_seconds": 3600},
        {"percent": 50, "min_soak_seconds": 3600},
        {"percent": 100, "min_soak_seconds": 0},
    ]
    guards = [{"metric": "eval_accuracy", "min": 0.6, "min_reports": 10}]
    rollouts = []
    n_ro = sz.rollouts
    for j in range(n_ro):
        newest = j == n_ro - 1
        cohort = cohorts[0] if newest else cohorts[j % len(cohorts)]
        adapter = adapter_of_cohort[cohort.pk]
        good = released(adapter)
        version = good[min(len(good) - 1, int((j + 1) / n_ro * (len(good) - 1)))]
        if newest:
            state, phase = Rollout.State.RUNNING, 1
        elif j == n_ro - 2:
            state, phase = Rollout.State.PAUSED, 1
        elif j == n_ro - 3:
            state, phase = Rollout.State.DRAFT, 0
        elif j == n_ro - 4:
            state, phase = Rollout.State.ROLLED_BACK, 1
        else:
            state, phase = Rollout.State.COMPLETED, 2
        created = now - (n_ro - j) * 1.5 * day
        rollouts.append(
            Rollout(
                version=version,
                cohort=cohort,
                phases=phases,
                guards=guards,
                state=state,
                current_phase=phase,
                phase_started_at=None if state == Rollout.State.DRAFT else created + phase * 2 * hour,
                state_reason="guard breached: eval_accuracy 0.55 vs min 0.6" if state == "rolled_back" else "",
                created_at=created,
                created_by=admin,
                started_at=None if state == Rollout.State.DRAFT else created + timedelta(minutes=5),
                finished_at=created + day if state in ("completed", "rolled_back") else None,
            )
        )
    rollouts = Rollout.objects.bulk_create(rollouts)
    return rollouts


def create_assignments(sz: Sizes, rng, cohorts, active, rollouts, running) -> None:
    """The rollouts' assignments to active devices (the running rollout gets a quarter of them), and each
    device's ``assignment_seq``."""
    from datetime import timedelta

    from django.db import connection

    from training.models import Assignment, Rollout

    active_in = {c.pk: [d for d in active if d.cohort_id == c.pk] for c in cohorts}
    sendable = [r for r in rollouts if r.state != Rollout.State.DRAFT]
    share = {running.pk: min(len(active_in[running.cohort_id]), sz.assignments // 4 or 1)}
    others = [r for r in sendable if r.pk != running.pk]
    for r in others:
        share[r.pk] = min(len(active_in[r.cohort_id]), (sz.assignments - share[running.pk]) // max(1, len(others)))
    if not others:
        share[running.pk] = min(len(active_in[running.cohort_id]), sz.assignments)
    seq_of: dict = {}
    states_by_rollout = {
        Rollout.State.COMPLETED: ["installed"] * 90 + ["failed"] * 3 + ["superseded"] * 7,
        Rollout.State.RUNNING: ["pending"] * 30 + ["delivered"] * 20 + ["installed"] * 45 + ["failed"] * 5,
        Rollout.State.PAUSED: ["pending"] * 20 + ["delivered"] * 10 + ["installed"] * 55 + ["failed"] * 15,
        Rollout.State.ROLLED_BACK: ["superseded"] * 80 + ["failed"] * 20,
    }
    assignments = []
    for rollout in sendable:  # oldest first, so seq grows with time per device
        chosen = rng.sample(active_in[rollout.cohort_id], share[rollout.pk])
        for device in chosen:
            seq_of[device.pk] = seq_of.get(device.pk, 0) + 1
            state = rng.choice(states_by_rollout[rollout.state])
            at = rollout.started_at + timedelta(minutes=rng.uniform(0, 600))
            assignments.append(
                Assignment(
                    device=device,
                    rollout=rollout,
                    phase=rng.randint(0, rollout.current_phase),
                    version=rollout.version,
                    previous_version=device.running_version,
                    seq=seq_of[device.pk],
                    state=state,
                    reason="install failed: out of memory" if state == "failed" else "",
                    metrics={"eval_accuracy": round(rng.uniform(0.6, 0.92), 3)} if state == "installed" else {},
                    created_at=at,
                    delivered_at=at + timedelta(seconds=5) if state != "pending" else None,
                    reported_at=at + timedelta(minutes=3) if state in ("installed", "failed") else None,
                )
            )
    _batched(Assignment, assignments)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE devices_device d SET assignment_seq = s.m FROM "
            "(SELECT device_id, max(seq) AS m FROM training_assignment GROUP BY device_id) s WHERE d.id = s.device_id"
        )
