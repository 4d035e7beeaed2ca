"""The fleet half of the dashboard benchmark's data (``bench/dashboard_data.py``): the users, cohorts and
enrollment tokens, the base model and its two adapters, each adapter's lineage of versions, and the devices,
with the helpers every part of the fill writes through (``_sha``, ``_batched``)."""

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


def create_catalog(sz: Sizes, now) -> tuple:
    """The users, cohorts and enrollment tokens, the base model and its adapters (which cohort trains which)."""
    from datetime import timedelta

    from accounts.models import User
    from devices.models import Cohort, EnrollmentToken
    from training.models import Adapter, BaseModel

    day = timedelta(days=1)

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
    return admin, cohorts, tokens_of, adapters, adapter_of_cohort


def create_versions(sz: Sizes, rng, now, admin, adapters) -> tuple:
    """A lineage of versions per adapter, with a branch every 40 versions; also how many rounds each adapter
    gets (the newest versions are theirs) and each adapter's released versions."""
    from datetime import timedelta

    from training.models import AdapterVersion

    day = timedelta(days=1)

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
    return versions, rounds_per_adapter, released_of


def create_devices(sz: Sizes, rng, now, cohorts, tokens_of, adapters, adapter_of_cohort, released) -> tuple:
    """The devices, most of them active and running a released version; also the busy one (the device-detail
    page's), the active ones and the active ones per adapter."""
    from datetime import timedelta

    from devices.models import Device, DeviceStatus

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
    return devices, busy, active, active_of_adapter
