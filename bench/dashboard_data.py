"""The fleet the dashboard benchmark (``bench/dashboard.py``) renders its pages on: one seeded generator fills a
fresh database at a given size (``Sizes``) with ``bulk_create``, then ``VACUUM ANALYZE``; runs in the
benchmark's child process, after ``django.setup()``."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dashboard import Sizes


def _sha(*parts) -> str:
    return hashlib.sha256("-".join(str(p) for p in parts).encode()).hexdigest()


def _batched(model, rows, batch: int = 5000) -> list:
    created = []
    for start in range(0, len(rows), batch):
        created.extend(model.objects.bulk_create(rows[start : start + batch]))
    return created


COHORT_NAMES = ["eu-phones", "us-phones", "kiosks", "lab-boards", "apac-tablets", "fleet-cars"]
REJECTION_CODES = [
    ("norm_too_large", 40, "update norm 2.1e3 is above the bound 1000"),
    ("stale_base_version", 25, "base version is more than 5 behind"),
    ("bad_signature", 15, "envelope signature does not verify"),
    ("spec_mismatch", 10, "tensor lora_A of layer 3 has shape [8, 256], expected [8, 384]"),
    ("not_finite", 5, "NaN in lora_B of layer 1"),
    ("hash_mismatch", 5, "stored bytes do not match the envelope's sha256"),
]


def populate(sz: Sizes) -> dict:  # noqa: C901, PLR0912, PLR0915 (one linear script)
    """Fill the database with a fleet of the given size (deterministic: one seeded generator)."""
    import random
    from datetime import timedelta

    from django.db import connection
    from django.utils import timezone

    from accounts.models import User
    from devices.models import Cohort, Device, DeviceEvent, DeviceStatus, EnrollmentToken
    from training.models import (
        Adapter,
        AdapterVersion,
        Assignment,
        BaseModel,
        Delta,
        Rollout,
        Round,
        TrainingEvent,
    )

    rng = random.Random(20240601)
    now = timezone.now()
    hour, day = timedelta(hours=1), timedelta(days=1)

    admin = User.objects.create_user("bench-admin", email="admin@example.com", role="admin")
    User.objects.create_user("bench-operator", role="operator")
    User.objects.create_user("bench-viewer", role="viewer")

    names = [COHORT_NAMES[i] if i < len(COHORT_NAMES) else f"cohort-{i}" for i in range(sz.cohorts)]
    cohorts = Cohort.objects.bulk_create(
        Cohort(name=name, description=f"{name} fleet", created_at=now - 90 * day) for name in names
    )
    tokens = EnrollmentToken.objects.bulk_create(
        EnrollmentToken(
            cohort=cohorts[i % len(cohorts)],
            name=f"{cohorts[i % len(cohorts)].name} line {i}",
            prefix=f"fet_{i:04d}",
            token_hash=_sha("token", i),
            uses_left=None if i % 3 else 100,
            expires_at=now + 30 * day if i % 4 else now - day,
            requires_approval=bool(i % 2),
            created_by=admin,
            created_at=now - (60 - i) * day,
            revoked_at=now - day if i % 5 == 4 else None,
        )
        for i in range(sz.tokens)
    )
    tokens_of = {c.pk: [t for t in tokens if t.cohort_id == c.pk] for c in cohorts}

    base = BaseModel.objects.create(
        name="minilm-l6",
        family="bert",
        weights_sha256=_sha("base"),
        weights_size=90_900_000,
        parameter_count=22_700_000,
        created_by=admin,
        created_at=now - 90 * day,
    )
    spec = {"base_model.model.encoder.layer.0.attention.self.query.lora_A.weight": {"shape": [8, 384], "dtype": "F32"}}
    adapters = [
        Adapter.objects.create(
            name=name,
            base_model=base,
            rank=8,
            alpha=16,
            target_modules=["query", "value"],
            tensor_spec=spec,
            aggregation={"strategy": "fedavg", "params": {}},
            created_by=admin,
            created_at=now - 80 * day,
        )
        for name in ("assistant-lora", "keyboard-lora")
    ]
    # The last cohort trains the second adapter; the others the first.
    adapter_of_cohort = {
        c.pk: adapters[1] if i == len(cohorts) - 1 and len(cohorts) > 1 else adapters[0] for i, c in enumerate(cohorts)
    }
    for adapter in adapters:
        adapter.cohorts.set([c for c in cohorts if adapter_of_cohort[c.pk] == adapter] or cohorts[:1])

    # --- versions: a lineage per adapter, with a branch every 40 versions --------------------------------------
    n_first = max(2, round(sz.versions * 0.75))
    per_adapter = {adapters[0].pk: n_first, adapters[1].pk: max(2, sz.versions - n_first)}
    n_rounds_first = max(1, round(sz.rounds * 0.75))
    rounds_per_adapter = {adapters[0].pk: n_rounds_first, adapters[1].pk: max(1, sz.rounds - n_rounds_first)}
    versions: dict[int, list] = {}
    for adapter in adapters:
        n = per_adapter[adapter.pk]
        # The newest versions were made by the completed rounds (all rounds but the last 2 in progress/failed).
        by_rounds = min(n - 1, max(0, rounds_per_adapter[adapter.pk] - 3))
        rows = []
        for k in range(1, n + 1):
            if k == 1:
                source = AdapterVersion.Source.SEED
            elif k > n - by_rounds:
                source = AdapterVersion.Source.ROUND
            else:
                source = AdapterVersion.Source.IMPORT
            state = AdapterVersion.State.RELEASED
            if k % 25 == 0:
                state = AdapterVersion.State.REVOKED
            elif k > n - 2 and k > 2:
                state = AdapterVersion.State.CANDIDATE
            rows.append(
                AdapterVersion(
                    adapter=adapter,
                    number=k,
                    blob_sha256=_sha("version", adapter.pk, k),
                    size=120_000 + k,
                    source=source,
                    seed=k if source == AdapterVersion.Source.SEED else None,
                    note="" if k % 10 else f"checkpoint {k}",
                    metrics={
                        "eval_accuracy": round(0.55 + 0.4 * k / n + rng.uniform(-0.02, 0.02), 4),
                        "eval_loss": round(1.6 - 1.1 * k / n + rng.uniform(-0.03, 0.03), 4),
                        "eval_samples": 512,
                    },
                    state=state,
                    created_at=now - 60 * day + (k / n) * 59 * day,
                    created_by=admin,
                )
            )
        created = _batched(AdapterVersion, rows)
        for k, version in enumerate(created, start=1):
            if k > 1:
                version.parent = created[k - 4] if k % 40 == 0 and k > 3 else created[k - 2]
        AdapterVersion.objects.bulk_update(created[1:], ["parent"], batch_size=1000)
        versions[adapter.pk] = created

    released_of = {
        a.pk: [v for v in versions[a.pk] if v.state == AdapterVersion.State.RELEASED] or versions[a.pk]
        for a in adapters
    }

    def released(adapter) -> list:
        return released_of[adapter.pk]

    # --- devices and their events ------------------------------------------------------------------------------
    statuses = [DeviceStatus.ACTIVE] * 85 + [DeviceStatus.PENDING] * 5 + [DeviceStatus.QUARANTINED] * 4
    statuses += [DeviceStatus.RETIRED] * 6
    devices = []
    for i in range(sz.devices):
        cohort = cohorts[i % len(cohorts)]
        adapter = adapter_of_cohort[cohort.pk]
        good = released(adapter)
        status = DeviceStatus.ACTIVE if i == 0 else rng.choice(statuses)
        online = i == 0 or (status == DeviceStatus.ACTIVE and rng.random() < 0.6)
        draw = rng.random()
        if status == DeviceStatus.PENDING or draw < 0.08:
            running = None
        elif draw < 0.75:
            running = good[-1]
        else:
            running = good[max(0, len(good) - 1 - rng.randint(1, 5))]
        token = rng.choice(tokens_of[cohort.pk]) if tokens_of[cohort.pk] else None
        labels = {"site": "lab" if i == 0 else rng.choice(["lab", "field", "store"])}
        if rng.random() < 0.5:
            labels["tier"] = rng.choice(["gold", "silver"])
        enrolled = now - timedelta(days=rng.uniform(1, 60))
        devices.append(
            Device(
                name=f"{cohort.name}-{i:05d}",
                cohort=cohort,
                status=status,
                public_key=_sha("key", i)[:43],
                hardware={"ram_mb": rng.choice([2048, 4096, 8192]), "cpu": "arm64", "os": "android-14"},
                labels=labels,
                agent_version=rng.choice(["0.4.1", "0.4.2", "0.5.0"]),
                enrolled_at=enrolled,
                enrolled_with=token,
                last_seen_at=None
                if status == DeviceStatus.PENDING
                else now - timedelta(seconds=rng.uniform(0, 60) if online else rng.uniform(60, 7 * 86400)),
                online=online,
                battery_percent=round(rng.uniform(5, 100), 1),
                charging=rng.random() < 0.4,
                free_memory_mb=rng.randint(200, 3000),
                local_metrics={"eval_accuracy": round(rng.uniform(0.6, 0.9), 3)} if running else {},
                running_version=running,
                desired_version=good[-1] if status == DeviceStatus.ACTIVE else running,
            )
        )
    devices = _batched(Device, devices)
    busy = devices[0]  # the device-detail page shows this one: it gets the most deltas and events
    active = [d for d in devices if d.status == DeviceStatus.ACTIVE]
    active_of_adapter = {
        a.pk: [d for d in active if adapter_of_cohort[d.cohort_id] == a] or active or devices for a in adapters
    }

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
    del events

    # --- rounds, over the last 48 h per adapter ----------------------------------------------------------------
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

    # --- deltas: spread over the rounds (and so over 48 h) -----------------------------------------------------
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

    # --- rollouts and assignments ------------------------------------------------------------------------------
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
    running = rollouts[-1]
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

    # --- training events (the audit trail) ---------------------------------------------------------------------
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

    return {
        "admin": admin,
        "device": busy.pk,
        "cohort": cohorts[0].name,
        "version": released(adapters[0])[-1].pk,
        "adapter": adapters[0].pk,
        "round": collecting.pk,
        "rollout": running.pk,
    }


def vacuum_analyze() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")


def table_counts() -> dict[str, int]:
    from devices.models import Cohort, Device, DeviceEvent, EnrollmentToken
    from training.models import AdapterVersion, Assignment, Delta, Rollout, Round, TrainingEvent

    models = {
        "cohorts": Cohort,
        "devices": Device,
        "device events": DeviceEvent,
        "tokens": EnrollmentToken,
        "versions": AdapterVersion,
        "rounds": Round,
        "deltas": Delta,
        "rollouts": Rollout,
        "assignments": Assignment,
        "training events": TrainingEvent,
    }
    return {name: model.objects.count() for name, model in models.items()}
