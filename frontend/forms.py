import json

from django import forms
from django.contrib.auth.password_validation import validate_password
from django.utils import timezone

from accounts.models import User
from accounts.roles import Role
from devices.models import Cohort
from training.models import Adapter, AdapterVersion, BaseModel, Rollout
from training.registry.personalization_settings import METHODS, PERSONALIZATION_DEFAULTS, personalization_settings
from training.registry.services import MAX_ARTIFACT_BYTES


class ApiTokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What the token is for, e.g. 'grafana' or 'ci'.")
    expires_at = forms.DateTimeField(
        required=False, widget=forms.DateTimeInput(attrs={"type": "datetime-local"}), help_text="Optional."
    )

    def clean_expires_at(self):
        value = self.cleaned_data["expires_at"]
        if value is not None and value <= timezone.now():
            raise forms.ValidationError("The expiry must be in the future.")
        return value


class UserCreateForm(forms.Form):
    username = forms.RegexField(r"^[\w.@+-]{1,150}$", max_length=150)
    email = forms.EmailField(required=False)
    role = forms.ChoiceField(choices=Role.choices)
    password = forms.CharField(widget=forms.PasswordInput, min_length=10)

    def clean_username(self):
        username = self.cleaned_data["username"]
        if User.objects.filter(username=username).exists():
            raise forms.ValidationError("A user with this username exists.")
        return username

    def clean(self):
        data = super().clean()
        if data.get("password") and data.get("username"):
            validate_password(data["password"], User(username=data["username"], email=data.get("email", "")))
        return data


# --- models -------------------------------------------------------------------------------------------------


class OwnModelForm(forms.Form):
    """A team's own model: a ``.pt2`` saved with ``torch.export.save`` and its card, or a Hugging Face text
    classifier's folder zipped (README.md, "Your own model, without code"); the service checks it before anything is
    stored."""

    KINDS = [
        ("exported-program", "PyTorch program (.pt2) and its card"),
        ("hf-text-classifier", "Hugging Face text classifier (its folder, zipped)"),
    ]
    name = forms.SlugField(max_length=64, help_text="Letters, digits, - and _, e.g. wrist-cnn.")
    kind = forms.ChoiceField(choices=KINDS, initial="exported-program")
    program = forms.FileField(
        label="Model file",
        help_text="A .pt2 saved with torch.export.save (the batch dimension dynamic), or a .zip of a folder "
        "save_pretrained wrote (config.json, model.safetensors, the tokenizer).",
    )
    card = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 4, "spellcheck": "false"}),
        help_text='For a .pt2: {"inputs": [{"name": "window", "dtype": "float32", "shape": ["batch", 3, 32]}], '
        '"task": "classification", "classes": 4}. For a Hugging Face folder: optional {"max_length": 64}.',
    )

    def clean_name(self):
        name = self.cleaned_data["name"]
        if BaseModel.objects.filter(name=name).exists():
            raise forms.ValidationError("A base model with this name exists.")
        return name

    def clean_program(self):
        program = self.cleaned_data["program"]
        if program.size > MAX_ARTIFACT_BYTES:
            raise forms.ValidationError(f"The file is {program.size:,} bytes; the limit is {MAX_ARTIFACT_BYTES:,}.")
        return program

    def clean(self):
        data = super().clean()
        text = (data.get("card") or "").strip()
        if not text and data.get("kind") == "exported-program":
            self.add_error("card", "A .pt2 needs its card: what the model takes and predicts.")
            return data
        try:
            card = json.loads(text) if text else {}
        except ValueError as error:
            self.add_error("card", f"The card is not JSON: {error}.")
            return data
        if not isinstance(card, dict):
            self.add_error("card", "The card must be a JSON object.")
        data["card"] = card
        return data


# --- fleet --------------------------------------------------------------------------------------------------


class CohortForm(forms.Form):
    name = forms.SlugField(max_length=64, help_text="Letters, digits, - and _, e.g. eu-phones.")
    description = forms.CharField(required=False, max_length=500)

    def clean_name(self):
        name = self.cleaned_data["name"]
        if Cohort.objects.filter(name=name).exists():
            raise forms.ValidationError("A cohort with this name exists.")
        return name


class EnrollmentTokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="Where it is used, e.g. 'factory line 2'.")
    cohort = forms.ModelChoiceField(queryset=Cohort.objects.order_by("name"), empty_label=None)
    expires_in_hours = forms.IntegerField(min_value=1, max_value=24 * 365, initial=24, label="Expires in (hours)")
    uses = forms.IntegerField(min_value=1, max_value=1_000_000, required=False, help_text="Empty: unlimited.")
    requires_approval = forms.BooleanField(
        required=False,
        initial=True,
        label_suffix="",  # the label follows its box (app.css): no colon
        help_text="Devices stay pending until an admin approves them.",
    )


class RoundOpenForm(forms.Form):
    adapter = forms.ModelChoiceField(queryset=Adapter.objects.order_by("name"), empty_label=None)
    buffer_size = forms.IntegerField(
        min_value=1, max_value=100_000, required=False, help_text="Empty: adapter default."
    )
    min_deltas = forms.IntegerField(min_value=1, max_value=100_000, required=False)
    timeout_seconds = forms.IntegerField(min_value=1, max_value=30 * 24 * 3600, required=False)


def _parse_phases(text: str) -> list[dict]:
    phases = []
    for index, part in enumerate(p for p in text.replace("\n", ",").split(",") if p.strip()):
        percent, _, soak = part.strip().partition(":")
        try:
            phases.append({"percent": float(percent), "min_soak_seconds": int(soak) if soak.strip() else 0})
        except ValueError:
            raise forms.ValidationError(f"phase {index + 1} ({part.strip()!r}) is not percent:seconds") from None
    if not phases:
        raise forms.ValidationError("Give at least one phase.")
    return phases


def _parse_guards(text: str) -> list[dict]:
    guards = []
    for number, line in enumerate((line.strip() for line in text.splitlines()), start=1):
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (3, 4) or parts[1] not in ("min", "max"):
            raise forms.ValidationError(f"guard line {number} ({line!r}) is not 'metric min|max value [reports]'")
        try:
            guard = {"metric": parts[0], parts[1]: float(parts[2])}
            if len(parts) == 4:
                guard["min_reports"] = int(parts[3])
        except ValueError:
            raise forms.ValidationError(f"guard line {number} ({line!r}) needs numbers") from None
        guards.append(guard)
    return guards


def version_choice_label(version) -> str:
    """ "digits-lora v7 (candidate, eval_accuracy 0.611, failed the release gate)": what an operator chooses by."""
    parts = [version.state]
    accuracy = (version.metrics or {}).get("eval_accuracy")
    if isinstance(accuracy, int | float):
        parts.append(f"eval_accuracy {accuracy:.3f}")
    verdict = (version.gate or {}).get("verdict")
    if verdict == "failed":
        parts.append("failed the release gate")
    elif verdict == "overridden":
        parts.append("release gate overridden")
    return f"{version.adapter.name} v{version.number} ({', '.join(parts)})"


class RolloutForm(forms.Form):
    version = forms.ModelChoiceField(
        queryset=AdapterVersion.objects.exclude(state=AdapterVersion.State.REVOKED).select_related("adapter"),
        empty_label=None,
    )
    cohort = forms.ModelChoiceField(queryset=Cohort.objects.order_by("name"), empty_label=None)
    phases = forms.CharField(
        initial="10:3600, 50:3600, 100:0",
        max_length=500,
        help_text="percent:minimum soak seconds, comma separated, percents rising to at most 100.",
    )
    guards = forms.CharField(
        required=False,
        max_length=2000,
        widget=forms.Textarea(attrs={"rows": 3, "placeholder": "eval_accuracy min 0.8 5"}),
        help_text="One per line: metric min|max value [minimum reports].",
    )
    on_breach = forms.ChoiceField(choices=Rollout.OnBreach.choices, initial=Rollout.OnBreach.PAUSE)
    max_failure_rate = forms.FloatField(min_value=0, max_value=1, initial=0.2)
    override_gate = forms.BooleanField(
        required=False,
        label="Override the release gate",
        help_text="Only for a version that failed the gate (it evaluated worse than the best released one).",
    )
    override_reason = forms.CharField(
        required=False, max_length=300, help_text="Why it should reach devices anyway (recorded)."
    )

    def __init__(self, *args, versions=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["version"].label_from_instance = version_choice_label
        if versions is not None:
            self.fields["version"].choices = [(v.pk, version_choice_label(v)) for v in versions]
            # Offered first: the newest version of the first adapter that did not fail the release gate.
            good = next((v for v in versions if (v.gate or {}).get("verdict") != "failed"), None)
            if good is not None and not self.is_bound:
                self.initial.setdefault("version", good.pk)

    def clean_phases(self):
        return _parse_phases(self.cleaned_data["phases"])

    def clean_guards(self):
        return _parse_guards(self.cleaned_data.get("guards") or "")


class ReleaseSettingsForm(forms.Form):
    """Automatic release and the release gate's margin (``training.federation.release_gate``), part of the
    adapter's aggregation settings; the margin in accuracy points here, a fraction in the API."""

    auto_release = forms.BooleanField(
        required=False,
        label="Release each round's version automatically",
        help_text="When it passes the release gate: rolled out to every cohort at once. An operator's own rollout "
        "in progress in a cohort is left alone there.",
    )
    margin_points = forms.FloatField(
        min_value=0,
        max_value=100,
        label="Release margin (accuracy points)",
        help_text="A version evaluated worse than the best released one by more than this stays a candidate.",
    )


class AdapterCohortsForm(forms.Form):
    """The cohorts an adapter serves, one checkbox each (``training.registry.services.adapter_set_cohorts`` checks the
    rest: a cohort a rollout is running in stays)."""

    cohorts = forms.ModelMultipleChoiceField(
        queryset=Cohort.objects.order_by("name"),
        required=False,
        widget=forms.CheckboxSelectMultiple,
        error_messages={
            "invalid_choice": "There is no cohort %(value)s (deleted meanwhile?): nothing was changed.",
            "invalid_pk_value": "“%(pk)s” is not a cohort: nothing was changed.",
        },
    )


class PersonalizationForm(forms.Form):
    """An adapter's personalization setting (training.registry.personalization_settings checks it as a whole). What an
    operator leaves at its default is stored as "the default", so a later change of default reaches it."""

    method = forms.ChoiceField(choices=[(method, method) for method in METHODS])
    epochs = forms.IntegerField(min_value=1, max_value=100)
    lr = forms.FloatField(min_value=0, label="Learning rate")
    margin = forms.FloatField(
        min_value=0, max_value=1, help_text="Accuracy the own model must gain before the device serves it."
    )
    min_val_samples = forms.IntegerField(
        min_value=0, max_value=10000, label="Minimum validation samples", help_text="Before a device judges."
    )
    private_modules = forms.CharField(
        required=False, max_length=2000, help_text="Comma separated; kept on the device by the private_modules method."
    )
    unlabeled = forms.ChoiceField(
        choices=[("pseudo_label", "pseudo_label: learn what the model is sure of"), ("none", "none: labelled only")],
        label="Unlabeled samples",
        help_text="What the own model learns from the samples nobody labelled.",
    )
    confidence = forms.FloatField(
        min_value=0.01, max_value=1, help_text="How sure (0 to 1) the model must be of an unlabeled sample's label."
    )
    release_classes = forms.BooleanField(
        required=False,
        label="Release contradicted classes",
        label_suffix="",  # the label follows its box (app.css): no colon
        help_text="Ditto: the classes a device's own labels rename are its own (trained free, never uploaded).",
    )

    def __init__(self, *args, adapter: Adapter, **kwargs):
        current = personalization_settings(adapter)
        initial = {**current, "private_modules": ", ".join(current["private_modules"])}
        super().__init__(*args, initial=initial, **kwargs)
        # "lambda" is a Python keyword: the field is added under its name rather than declared.
        self.fields["lambda"] = forms.FloatField(min_value=0, label="Lambda", help_text="Ditto's proximal weight.")
        self.order_fields(
            [
                "method",
                "lambda",
                "release_classes",
                "epochs",
                "lr",
                "margin",
                "min_val_samples",
                "unlabeled",
                "confidence",
                "private_modules",
            ]
        )

    def clean_private_modules(self):
        return [name.strip() for name in self.cleaned_data["private_modules"].split(",") if name.strip()]

    def setting(self) -> dict:
        """What to store: the values that differ from the defaults."""
        return {name: value for name, value in self.cleaned_data.items() if value != PERSONALIZATION_DEFAULTS[name]}
