from __future__ import annotations

import math
import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone


class Cohort(models.Model):
    """A named group of devices (by region, hardware or use case); rollouts and rounds target cohorts."""

    name = models.SlugField(max_length=64, unique=True)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class EnrollmentTokenQuerySet(models.QuerySet):
    def usable(self):
        return self.filter(revoked_at__isnull=True, expires_at__gt=timezone.now()).filter(
            Q(uses_left__isnull=True) | Q(uses_left__gt=0)
        )


class EnrollmentToken(models.Model):
    """A secret an operator hands to devices so they can join a cohort.

    Only its sha256 is stored; it is shown once. ``uses_left`` of None means unlimited until expiry.
    With ``requires_approval`` devices enrolled with it stay ``pending`` until an operator approves them;
    otherwise they are pre-authorized and ``active`` at once.
    """

    cohort = models.ForeignKey(Cohort, on_delete=models.PROTECT, related_name="enrollment_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16)
    token_hash = models.CharField(max_length=64, unique=True)
    uses_left = models.PositiveIntegerField(null=True, blank=True)
    expires_at = models.DateTimeField()
    requires_approval = models.BooleanField(default=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = EnrollmentTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"


class DeviceStatus(models.TextChoices):
    PENDING = "pending", "Pending approval"
    ACTIVE = "active", "Active"
    QUARANTINED = "quarantined", "Quarantined"
    RETIRED = "retired", "Retired"


class Device(models.Model):
    """One enrolled edge device, known by its Ed25519 public key.

    Only ``active`` devices may sync. ``online``, ``last_seen_at`` and the power fields are written in
    batches from the Redis presence set (``devices.presence``), never once per heartbeat, so they lag the
    live connection by up to the flush interval. Retired is terminal: the key can never sync again.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100)
    cohort = models.ForeignKey(Cohort, on_delete=models.PROTECT, related_name="devices")
    status = models.CharField(max_length=16, choices=DeviceStatus.choices, default=DeviceStatus.PENDING)
    public_key = models.CharField(max_length=64, unique=True, help_text="Ed25519 public key, base64url")
    hardware = models.JSONField(default=dict, blank=True, help_text="ram_mb, cpu, accelerator, os")
    labels = models.JSONField(default=dict, blank=True, help_text="free-form key/value strings")
    agent_version = models.CharField(max_length=32, blank=True)
    protocol = models.PositiveSmallIntegerField(
        default=1,
        help_text="the device protocol of its latest signed hello or token request: manifests are signed in its "
        "canonical form",
    )
    enrolled_at = models.DateTimeField(default=timezone.now)
    enrolled_with = models.ForeignKey(EnrollmentToken, on_delete=models.SET_NULL, null=True, related_name="devices")
    last_seen_at = models.DateTimeField(null=True, blank=True)
    online = models.BooleanField(default=False)
    battery_percent = models.FloatField(null=True, blank=True)
    charging = models.BooleanField(null=True, blank=True)
    free_memory_mb = models.IntegerField(null=True, blank=True)
    local_metrics = models.JSONField(default=dict, blank=True)
    # What it runs (as it last reported) and what it should run; assignment_seq is the last sequence
    # number issued to it (training.Assignment), so manifests are strictly increasing per device.
    running_version = models.ForeignKey(
        "training.AdapterVersion", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    desired_version = models.ForeignKey(
        "training.AdapterVersion", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    assignment_seq = models.PositiveBigIntegerField(default=0)
    # Upload begins the server refused (devices.uploads): how many, the last one's code and when. Nothing else
    # of a refused begin is stored.
    uploads_refused = models.PositiveIntegerField(default=0)
    upload_refused_at = models.DateTimeField(null=True, blank=True)
    upload_refused_code = models.CharField(max_length=32, blank=True)
    # What its users said of its answers, from its latest heartbeat's ``feedback`` (devices.feedback): answers
    # confirmed and corrected of the version installed then and of the one it ran before it (null: none reported,
    # or no version before). ``stored_samples`` and ``unlabeled_samples`` are as of the last change of the counts.
    feedback_adapter = models.CharField(max_length=64, blank=True)
    feedback_version = models.PositiveIntegerField(null=True, blank=True)
    feedback_confirmed = models.PositiveIntegerField(null=True, blank=True)
    feedback_corrected = models.PositiveIntegerField(null=True, blank=True)
    feedback_previous_version = models.PositiveIntegerField(null=True, blank=True)
    feedback_previous_confirmed = models.PositiveIntegerField(null=True, blank=True)
    feedback_previous_corrected = models.PositiveIntegerField(null=True, blank=True)
    feedback_samples = models.PositiveIntegerField(
        null=True, blank=True, help_text="labelled samples stored from its users' feedback"
    )
    stored_samples = models.PositiveIntegerField(null=True, blank=True, help_text="labelled samples it holds")
    unlabeled_samples = models.PositiveIntegerField(
        null=True, blank=True, help_text="unlabeled samples it holds (null: its agent does not report them)"
    )
    feedback_reported_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name", "id"]
        indexes = [
            models.Index(fields=["cohort", "status"]),
            models.Index(fields=["status", "online"]),
            models.Index(fields=["agent_version"]),
            # The device list's order (Meta.ordering): a page is an index walk, not a sort of the whole fleet.
            models.Index(fields=["name", "id"]),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"


class DeviceEvent(models.Model):
    """Something that happened to a device: enrollment, a status change (with who did it), online/offline."""

    class Kind(models.TextChoices):
        ENROLLED = "enrolled"
        APPROVED = "approved"
        REJECTED = "rejected"
        QUARANTINED = "quarantined"
        REACTIVATED = "reactivated"
        RETIRED = "retired"
        UPDATED = "updated"
        ONLINE = "online"
        OFFLINE = "offline"
        AUTH_FAILED = "auth_failed"

    device = models.ForeignKey(Device, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=24, choices=Kind.choices)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")
    actor_label = models.CharField(max_length=64, help_text="username, 'device' or 'system'")
    detail = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["device", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.kind} {self.device_id} by {self.actor_label}"


class ServerKeyRotation(models.Model):
    """One link of the server signing key's chain: ``statement`` (``edge_agent.manifest.ROTATION_FIELDS``)
    signed by the key it retires and by the key it introduces. Devices that pinned an older key follow the
    chain to the current one (``devices.server_key.key_rotations``); rows are never edited or deleted."""

    seq = models.PositiveIntegerField(unique=True)
    old_public_key = models.CharField(max_length=64, unique=True)
    new_public_key = models.CharField(max_length=64, unique=True)
    statement = models.JSONField()
    signature = models.CharField(max_length=128, help_text="by the retired key")
    new_signature = models.CharField(max_length=128, help_text="by the new key")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["seq"]

    def __str__(self) -> str:
        return f"rotation #{self.seq}: {self.old_public_key} -> {self.new_public_key}"

    def as_link(self) -> dict:
        return {"statement": self.statement, "signature": self.signature, "new_signature": self.new_signature}


def gain_interval_points(shared: float, personal: float, samples: int) -> float | None:
    """The half-width, in points, of a 95% interval on a gain measured on ``samples`` held samples (both models on
    the same samples; the two accuracies' variances added, each from an Agresti-Coull estimate so that 3 of 3
    right is not taken as certain). None without samples. Three held samples give about ±50 points."""
    if samples <= 0:
        return None
    variance = 0.0
    for accuracy in (shared, personal):
        adjusted = (accuracy * samples + 2) / (samples + 4)
        variance += adjusted * (1 - adjusted) / (samples + 4)
    return round(196 * math.sqrt(variance), 3)


class PersonalizationReport(models.Model):
    """One measurement of a device's own model against the shared version it runs, from its heartbeat.

    The device trains a personal model on its own data (never uploaded) and measures both on a held-out slice
    of its local data; ``measured_at`` is when it measured (the heartbeat's ``personal.updated_at``), so the
    heartbeats that repeat one measurement store one row (``UNIQUE(device, measured_at)``). ``latest`` marks
    each device's newest report per adapter: the fleet's figures are read from those rows alone. A device
    keeps at most ``PERSONALIZATION_HISTORY`` rows; older ones are deleted (``devices.personalization``).
    """

    class Serving(models.TextChoices):
        PERSONAL = "personal"
        SHARED = "shared"

    device = models.ForeignKey(Device, on_delete=models.CASCADE, related_name="personalization_reports")
    adapter = models.ForeignKey(
        "training.Adapter", on_delete=models.CASCADE, null=True, blank=True, related_name="personalization_reports"
    )
    adapter_name = models.CharField(max_length=64)
    version_number = models.PositiveIntegerField(help_text="the shared version installed and measured")
    method = models.CharField(max_length=16)
    serving = models.CharField(max_length=8, choices=Serving.choices, help_text="the model the device serves")
    shared_accuracy = models.FloatField()
    personal_accuracy = models.FloatField()
    val_samples = models.PositiveIntegerField()
    trained_samples = models.PositiveIntegerField()
    shared_only_right = models.PositiveIntegerField(
        null=True, blank=True, help_text="distinct held samples only the shared version gets right (older agents: null)"
    )
    personal_only_right = models.PositiveIntegerField(
        null=True, blank=True, help_text="distinct held samples only the personal model gets right (older agents: null)"
    )
    measured_at = models.DateTimeField()
    received_at = models.DateTimeField(default=timezone.now)
    latest = models.BooleanField(default=False)

    class Meta:
        ordering = ["-measured_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["device", "measured_at"], name="one_personal_report_per_measurement"),
            models.UniqueConstraint(
                fields=["device", "adapter_name"], condition=Q(latest=True), name="one_latest_personal_report"
            ),
        ]
        indexes = [
            models.Index(fields=["device", "-measured_at", "-id"], name="personal_report_history_idx"),
            models.Index(fields=["adapter"], condition=Q(latest=True), name="personal_report_latest_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.adapter_name} v{self.version_number} on {self.device_id}: {self.gain_points:+.1f} points"

    @property
    def gain_points(self) -> float:
        """What the personal model gains over the shared one, in accuracy points."""
        return round((self.personal_accuracy - self.shared_accuracy) * 100, 9)

    @property
    def interval_points(self) -> float | None:
        """Half-width of a 95% interval on ``gain_points`` (``gain_interval_points``)."""
        return gain_interval_points(self.shared_accuracy, self.personal_accuracy, self.val_samples)
