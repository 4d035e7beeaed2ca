from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class BaseModel(models.Model):
    """The frozen model every device in a fleet carries.

    ``family`` says how to build it (``edge_agent.families``); the weights are a safetensors blob,
    content-addressed by ``weights_sha256``. Devices refuse manifests for another base (by that hash).
    """

    name = models.SlugField(max_length=64, unique=True)
    family = models.CharField(max_length=200)
    family_config = models.JSONField(default=dict, blank=True)
    weights_sha256 = models.CharField(max_length=64)
    weights_size = models.BigIntegerField()
    parameter_count = models.BigIntegerField()
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Adapter(models.Model):
    """A LoRA configuration on a base model; its versions are the artifacts devices run.

    ``tensor_spec`` ({PEFT key: {shape, dtype}}) is derived from the base model and the configuration when
    the adapter is created, and every version (seeded, imported or aggregated) must match it exactly.
    """

    name = models.SlugField(max_length=64, unique=True)
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="adapters")
    cohorts = models.ManyToManyField("devices.Cohort", related_name="adapters", blank=True)
    rank = models.PositiveSmallIntegerField()
    alpha = models.FloatField()
    dropout = models.FloatField(default=0.0)
    target_modules = models.JSONField()
    modules_to_save = models.JSONField(default=list, blank=True)
    tensor_spec = models.JSONField()
    aggregation = models.JSONField(default=dict, blank=True, help_text="strategy name and parameters")
    dp = models.JSONField(default=dict, blank=True, help_text="server-side DP settings and budget")
    # Server-side DP spent so far: [[noise_multiplier, sample_rate, steps], ...] as the Opacus RDP accountant
    # reads it, and the epsilon it gives (at dp["delta"]). Written only by a completed DP round.
    dp_history = models.JSONField(default=list, blank=True)
    dp_epsilon = models.FloatField(default=0.0)
    # How each device makes its own model (training.registry.personalization_settings): only what an operator set.
    personalization = models.JSONField(default=dict, blank=True, help_text="personal model method and training")
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class AdapterVersion(models.Model):
    """One immutable adapter artifact (safetensors with PEFT key names), numbered per adapter.

    The bytes live in blob storage under their sha256, never in this row. Once written, ``blob_sha256``,
    ``size``, ``number`` and ``parent`` never change; only ``state`` (candidate → released → revoked), the
    evaluation ``metrics`` and the release ``gate``'s verdict do.
    """

    class Source(models.TextChoices):
        SEED = "seed", "Fresh initialisation"
        IMPORT = "import", "Imported"
        ROUND = "round", "Aggregated in a round"

    class State(models.TextChoices):
        CANDIDATE = "candidate"
        RELEASED = "released"
        REVOKED = "revoked"

    adapter = models.ForeignKey(Adapter, on_delete=models.PROTECT, related_name="versions")
    number = models.PositiveIntegerField()
    parent = models.ForeignKey("self", on_delete=models.PROTECT, null=True, blank=True, related_name="children")
    blob_sha256 = models.CharField(max_length=64)
    size = models.BigIntegerField()
    source = models.CharField(max_length=16, choices=Source.choices)
    seed = models.BigIntegerField(null=True, blank=True)
    note = models.CharField(max_length=200, blank=True)
    metrics = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.CANDIDATE)
    # The release gate's last verdict (training.federation.release_gate): {verdict, reason, metric, value,
    # reference, reference_value, margin, judged_at}; empty until it is judged.
    gate = models.JSONField(default=dict, blank=True, help_text="the release gate's last verdict on this version")
    server_state = models.JSONField(
        default=dict,
        blank=True,
        help_text="the adapter's server optimizer moments after the round that made this version: "
        '{"optimizer", "steps", "blob"} (training.federation.strategies.server_optimizers)',
    )
    # The round that made this version; unique, so a round re-run after a crash can never make a second one.
    round = models.OneToOneField(
        "training.Round", on_delete=models.PROTECT, null=True, blank=True, related_name="result_version"
    )
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")

    class Meta:
        ordering = ["adapter", "-number"]
        constraints = [models.UniqueConstraint(fields=["adapter", "number"], name="unique_version_number")]

    def __str__(self) -> str:
        return f"{self.adapter.name} v{self.number}"


class TrainingEvent(models.Model):
    """An operator action on base models, adapters and versions: who did what, when (the audit trail)."""

    kind = models.CharField(max_length=40)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")
    actor_label = models.CharField(max_length=64)
    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, null=True, blank=True, related_name="events")
    version = models.ForeignKey(AdapterVersion, on_delete=models.CASCADE, null=True, blank=True, related_name="+")
    detail = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.kind} by {self.actor_label}"


class Rollout(models.Model):
    """An adapter version going out to a cohort in phases.

    Each phase covers a percent of the cohort (devices chosen by a stable hash of rollout and device, so a
    larger percent only ever adds devices) and lasts at least its soak time. Guards are thresholds on the
    metrics devices report after installing; a breach pauses or rolls back, as ``on_breach`` says.
    States: draft → running ⇄ paused → completed | aborted | rolled_back. Completed means every phase is done
    and each device it assigned installed, failed or is gone (``training.rollouts.progress``).
    """

    class State(models.TextChoices):
        DRAFT = "draft"
        RUNNING = "running"
        PAUSED = "paused"
        COMPLETED = "completed"
        ABORTED = "aborted"
        ROLLED_BACK = "rolled_back"

    class OnBreach(models.TextChoices):
        PAUSE = "pause"
        ROLLBACK = "rollback"

    version = models.ForeignKey(AdapterVersion, on_delete=models.PROTECT, related_name="rollouts")
    cohort = models.ForeignKey("devices.Cohort", on_delete=models.PROTECT, related_name="rollouts")
    phases = models.JSONField(help_text="[{percent, min_soak_seconds}], percents increasing, the last ≤ 100")
    guards = models.JSONField(default=list, blank=True, help_text="[{metric, min | max, min_reports}]")
    max_failure_rate = models.FloatField(default=0.2)
    on_breach = models.CharField(max_length=16, choices=OnBreach.choices, default=OnBreach.PAUSE)
    state = models.CharField(max_length=16, choices=State.choices, default=State.DRAFT)
    current_phase = models.PositiveSmallIntegerField(default=0)
    phase_started_at = models.DateTimeField(null=True, blank=True)
    state_reason = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    device_counts = models.JSONField(
        default=dict,
        blank=True,
        help_text="installed, failed, pending, gone (and gone by rule) as of the last tick that found devices "
        "pending, and as they stood when it finished (training.rollouts.progress)",
    )

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"rollout {self.pk}: {self.version} to {self.cohort}"


class Assignment(models.Model):
    """What one device should run, as of one moment: a signed manifest's worth of intent.

    ``seq`` is the device's assignment sequence (monotonic per device, ``UNIQUE(device, seq)``): the agent
    refuses a manifest that is not newer than the last it accepted. A rollback is a new assignment with
    a newer ``seq`` pointing at the older version. A newer assignment supersedes the older pending ones.
    """

    class State(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        INSTALLED = "installed"
        FAILED = "failed"
        SUPERSEDED = "superseded"

    device = models.ForeignKey("devices.Device", on_delete=models.CASCADE, related_name="assignments")
    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, null=True, blank=True, related_name="assignments")
    phase = models.PositiveSmallIntegerField(default=0)
    version = models.ForeignKey(AdapterVersion, on_delete=models.PROTECT, related_name="assignments")
    previous_version = models.ForeignKey(
        AdapterVersion, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    seq = models.PositiveBigIntegerField()
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    reason = models.CharField(max_length=300, blank=True)
    metrics = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)
    reported_at = models.DateTimeField(null=True, blank=True)
    # When the device acknowledged (ack ok=true) the command ``assignment-<id>``: no longer re-sent at its hello.
    acked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-seq"]
        constraints = [models.UniqueConstraint(fields=["device", "seq"], name="unique_assignment_seq_per_device")]
        indexes = [models.Index(fields=["rollout", "state"]), models.Index(fields=["device", "state"])]

    def __str__(self) -> str:
        return f"assignment {self.seq} of {self.device_id}: {self.version}"


class Round(models.Model):
    """One aggregation for one adapter: accepted deltas collect here until the buffer holds ``buffer_size``
    (or the deadline passes with at least ``min_deltas``), then a Celery task turns them into exactly one new
    AdapterVersion built on ``base_version`` (``AdapterVersion.round`` is unique).

    At most one round per adapter is collecting at a time. States: collecting → aggregating → completed |
    failed; a failed round can be run again. ``strategy`` and ``params`` are a snapshot of the adapter's
    aggregation settings when the round opened, so changing the adapter never changes a running round.
    """

    class State(models.TextChoices):
        COLLECTING = "collecting"
        AGGREGATING = "aggregating"
        COMPLETED = "completed"
        FAILED = "failed"

    adapter = models.ForeignKey(Adapter, on_delete=models.PROTECT, related_name="rounds")
    base_version = models.ForeignKey(AdapterVersion, on_delete=models.PROTECT, related_name="rounds_from")
    strategy = models.CharField(max_length=32)
    params = models.JSONField(default=dict, blank=True)
    buffer_size = models.PositiveIntegerField()
    min_deltas = models.PositiveIntegerField(default=1)
    deadline = models.DateTimeField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.COLLECTING)
    close_reason = models.CharField(max_length=32, blank=True)
    failure = models.TextField(blank=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    stats = models.JSONField(default=dict, blank=True)
    epsilon = models.FloatField(null=True, blank=True, help_text="the adapter's DP epsilon after this round")
    opened_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    closed_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    # How long the round took, for operators (its API and pages). The clock starts at its close or, for a failed
    # round an operator ran again, at that last re-run: the time it sat failed, waiting for someone, is not the
    # time aggregation takes. Rounds from before these were kept have them null (unknown), as has a round
    # released before it had its aggregation time, so ``aggregation_seconds <= release_seconds`` always.
    reran_at = models.DateTimeField(
        null=True, blank=True, help_text="when an operator last ran this failed round again; its times count from here"
    )
    aggregated_at = models.DateTimeField(
        null=True, blank=True, help_text="when its result version was stored (in the same transaction)"
    )
    released_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="when the first rollout of its result version started (devices assigned), by auto-release or an "
        "operator",
    )

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["adapter"], condition=models.Q(state="collecting"), name="one_collecting_round_per_adapter"
            )
        ]
        indexes = [models.Index(fields=["state", "deadline"])]

    def __str__(self) -> str:
        return f"round {self.pk} of {self.adapter.name} on v{self.base_version.number}"

    @property
    def timed_from(self):
        """Where the round's times count from: its last re-run, else its close."""
        return self.reran_at or self.closed_at

    def _seconds_to(self, moment) -> float | None:
        # Never negative: the moments may come from the clocks of different hosts (web, workers).
        start = self.timed_from
        return None if moment is None or start is None else max(0.0, (moment - start).total_seconds())

    @property
    def aggregation_seconds(self) -> float | None:
        """Seconds from close (or last re-run) to the result version stored; None until then, or unknown."""
        return self._seconds_to(self.aggregated_at)

    @property
    def release_seconds(self) -> float | None:
        """Seconds from close (or last re-run) to the first rollout of its result version starting."""
        return self._seconds_to(self.released_at)


class Delta(models.Model):
    """One upload from one device: the change it made to the adapter, relative to ``base_version``.

    ``sha256`` is what the device's signed envelope claims; ``blob_sha256`` is the hash of the bytes the server
    actually holds (blank when nothing was stored: an oversized or corrupted upload, or a rejected delta whose
    bytes were deleted). A device uploads a given file
    once (``UNIQUE(device, sha256)``: a repeated upload is acknowledged, never counted twice; a transfer
    that arrived corrupted does not count as the upload), and a counter
    once among deltas whose signature verified (``UNIQUE(device, counter) WHERE counter_claimed``, so a forged
    upload can never burn a real device's counter). States: received → accepted | rejected → aggregated;
    a rejected delta's row is kept for forensics with its ``rejection_code`` and never aggregated; its bytes are
    deleted (``training.federation.verification.rejected_bytes_delete``).
    """

    class State(models.TextChoices):
        RECEIVED = "received"
        ACCEPTED = "accepted"
        REJECTED = "rejected"
        AGGREGATED = "aggregated"

    class Channel(models.TextChoices):
        WEBSOCKET = "ws"
        REST = "rest"

    device = models.ForeignKey("devices.Device", on_delete=models.CASCADE, related_name="deltas")
    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, null=True, blank=True, related_name="deltas")
    adapter_name = models.CharField(max_length=64)
    base_version_number = models.PositiveIntegerField()
    base_version = models.ForeignKey(
        AdapterVersion, on_delete=models.PROTECT, null=True, blank=True, related_name="deltas_on"
    )
    round = models.ForeignKey(Round, on_delete=models.SET_NULL, null=True, blank=True, related_name="deltas")
    sha256 = models.CharField(max_length=64)
    blob_sha256 = models.CharField(max_length=64, blank=True)
    size = models.BigIntegerField()
    num_samples = models.PositiveIntegerField()
    counter = models.BigIntegerField()
    counter_claimed = models.BooleanField(default=False)
    envelope = models.JSONField()
    signature = models.CharField(max_length=128)
    metrics = models.JSONField(default=dict, blank=True)
    channel = models.CharField(max_length=8, choices=Channel.choices)
    state = models.CharField(max_length=16, choices=State.choices, default=State.RECEIVED)
    rejection_code = models.CharField(max_length=32, blank=True)
    rejection_detail = models.CharField(max_length=500, blank=True)
    staleness = models.IntegerField(null=True, blank=True)
    norm = models.FloatField(null=True, blank=True)
    encoding = models.CharField(max_length=8, blank=True)
    received_at = models.DateTimeField(default=timezone.now, db_index=True)
    verified_at = models.DateTimeField(null=True, blank=True)
    # Verification runs begun on it, each counted (and committed) before its checks: one that never finishes (a
    # worker killed or crashing on it, a check raising) leaves the count up, and past
    # DELTA_VERIFY_MAX_ATTEMPTS the delta is rejected `verification_failed` instead of tried again for ever.
    verify_attempts = models.PositiveSmallIntegerField(
        default=0, help_text="verification runs begun on this delta; more than one means a run did not finish"
    )
    # When the device acknowledged its ``delta_result`` (command ``delta-<id>``); until then the result is sent
    # again after each hello (DELTA_RESULT_RESEND_DAYS).
    result_acked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-received_at", "-id"]
        constraints = [
            # A transfer that arrived corrupted (hash_mismatch) does not take the slot: the device may resend.
            models.UniqueConstraint(
                fields=["device", "sha256"],
                condition=~models.Q(rejection_code="hash_mismatch"),
                name="unique_delta_file_per_device",
            ),
            models.UniqueConstraint(
                fields=["device", "counter"],
                condition=models.Q(counter_claimed=True),
                name="unique_claimed_counter_per_device",
            ),
        ]
        indexes = [
            models.Index(fields=["round", "state"]),
            models.Index(fields=["adapter", "state"]),
            models.Index(fields=["state", "received_at"]),
            # The overview's deltas-per-hour chart (a day of deltas) as an index-only scan, not a table scan.
            models.Index(fields=["received_at"], include=["state", "id"], name="delta_received_state_idx"),
            # Whether a rejected delta's bytes are still held by another delta before they are deleted.
            models.Index(fields=["blob_sha256"], name="delta_blob_idx"),
        ]

    def __str__(self) -> str:
        return f"delta {self.pk} from {self.device_id} ({self.state})"
