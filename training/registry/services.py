"""Everything that writes base models, adapters and adapter versions.

Artifacts are checked (``training.registry.artifacts``) before they are stored, stored by hash before a row points
at them, and never rewritten. Every operator action leaves a ``TrainingEvent``.
"""

from __future__ import annotations

import io
import json
import zipfile

import torch
from django.db import transaction
from django.db.models import Max
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from core.errors import Conflict, Invalid, TooLarge
from edge_agent.families import default_shape, get_family, loads_file
from edge_agent.lora import initial_tensors, peft_config, tensor_spec, weight_target
from training.models import Adapter, AdapterVersion, BaseModel, Rollout, TrainingEvent
from training.registry.artifacts import ArtifactRejected, load_checked
from training.registry.blobs import blob_put_bytes, blob_read
from training.registry.personalization_settings import validate_personalization

MAX_ARTIFACT_BYTES = 512 * 1024 * 1024


def _record(kind: str, *, actor, adapter=None, version=None, **detail) -> None:
    TrainingEvent.objects.create(
        kind=kind,
        actor=actor,
        actor_label=actor.username if actor is not None else "system",
        adapter=adapter,
        version=version,
        detail=detail,
    )


def _rejected(exc: ArtifactRejected) -> Invalid:
    return Invalid(f"artifact_{exc.code}", str(exc))


def _family(name: str):
    try:
        return get_family(name)
    except LookupError as exc:
        raise Invalid("unknown_family", str(exc)) from None


def build_base(base_model: BaseModel) -> torch.nn.Module:
    """The base model with its stored weights loaded (strictly: every tensor, no extras), or, for a family whose
    stored file is the model (an exported program), loaded from it."""
    family = get_family(base_model.family)
    if loads_file(family):
        return family.load(base_model.family_config, blob_read(base_model.weights_sha256)).eval()
    module = family.build(base_model.family_config)
    module.load_state_dict(load_safetensors(blob_read(base_model.weights_sha256)), strict=True)
    return module.eval()


def candidate_modules(module: torch.nn.Module) -> list[dict]:
    """The modules of a base an adapter can target, in order: ``name``, ``kind`` (``linear``, ``conv2d`` or
    ``weight``: an exported program's module, adapted on its weight's 2-D view), the weight's ``shape`` and its
    ``parameters``. Modules to save may be any module; these are the usual choice."""
    found = []
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.Linear):
            kind = "linear"
        elif isinstance(child, torch.nn.Conv2d) and child.groups == 1:
            kind = "conv2d"
        elif weight_target(child) is not None:
            kind = "weight"
        else:
            continue
        weight = child.weight
        found.append({"name": name, "kind": kind, "shape": list(weight.shape), "parameters": weight.numel()})
    return found


def _file_base(family, config: dict, weights: bytes | None):
    """``(config, module)`` of an uploaded model of a family whose file is the model: the config (a card) in its
    normal form and the model loaded from ``weights`` after its checks; ``Invalid`` naming what is wrong."""
    if weights is None:
        raise Invalid("weights_required", f"a {family.name} base model is its uploaded file: send it as 'weights'")
    try:
        config = family.config_for(weights, config) if hasattr(family, "config_for") else family.check_config(config)
        return config, family.load(config, weights)
    except ValueError as exc:
        raise Invalid(f"artifact_{getattr(exc, 'code', 'invalid')}", str(exc)) from None


@transaction.atomic
def base_model_create(
    *, name: str, family: str, family_config: dict | None = None, weights: bytes | None = None, actor=None
) -> BaseModel:
    """Register a base model. Without ``weights`` the family's own initialisation (from the config's seed)
    is stored; with them, they must hold exactly the family's tensors. A family whose file is the model (an
    exported program) needs its file as ``weights`` and its card as ``family_config``; both are checked by
    loading the model and running it on the card's inputs."""
    config = family_config or {}
    found = _family(family)
    if weights is not None and len(weights) > MAX_ARTIFACT_BYTES:
        raise TooLarge("artifact_too_large", f"weights above {MAX_ARTIFACT_BYTES} bytes")
    if loads_file(found):
        config, module = _file_base(found, config, weights)
    else:
        module = found.build(config)
        expected = {key: {"shape": list(t.shape), "dtype": "F32"} for key, t in module.state_dict().items()}
        if weights is None:
            weights = save_safetensors({key: t.contiguous() for key, t in module.state_dict().items()})
        try:
            load_checked(weights, expected)
        except ArtifactRejected as exc:
            raise _rejected(exc) from None
    blob = blob_put_bytes(weights)
    base = BaseModel.objects.create(
        name=name,
        family=family,
        family_config=config,
        weights_sha256=blob.sha256,
        weights_size=blob.size,
        parameter_count=sum(t.numel() for t in module.state_dict().values()),
        created_by=actor,
    )
    _record("base_model.created", actor=actor, base_model=name, sha256=blob.sha256)
    return base


@transaction.atomic
def adapter_create(
    *,
    name: str,
    base_model: BaseModel,
    rank: int | None = None,
    alpha: float | None = None,
    dropout: float = 0.0,
    target_modules: list[str] | None = None,
    modules_to_save: list[str] | None = None,
    cohorts=(),
    aggregation: dict | None = None,
    personalization: dict | None = None,
    actor=None,
) -> Adapter:
    family = _family(base_model.family)
    default_rank, default_alpha = default_shape(family)
    rank = default_rank if rank is None else rank
    alpha = default_alpha if alpha is None else alpha
    base = build_base(base_model)
    default_targets, default_to_save = (
        family.defaults(base)
        if hasattr(family, "defaults")
        else (family.default_targets, family.default_modules_to_save)
    )
    targets = list(target_modules or default_targets)
    to_save = list(default_to_save if modules_to_save is None else modules_to_save)
    personalization = _personalization_checked(personalization or {}, modules=[*targets, *to_save])
    try:
        spec = tensor_spec(base, rank=rank, target_modules=targets, modules_to_save=to_save)
    except ValueError as exc:
        names = [c["name"] for c in candidate_modules(base)]
        shown = ", ".join(names[:40]) + (f" and {len(names) - 40} more" if len(names) > 40 else "")
        raise Invalid("invalid_adapter", f"{exc}. The base's candidate modules: {shown}") from None
    adapter = Adapter.objects.create(
        name=name,
        base_model=base_model,
        rank=rank,
        alpha=alpha,
        dropout=dropout,
        target_modules=targets,
        modules_to_save=to_save,
        tensor_spec={key: value.as_json() for key, value in spec.items()},
        aggregation=aggregation or {"strategy": "fedavg"},
        personalization=personalization,
        created_by=actor,
    )
    adapter.cohorts.set(cohorts)
    _record("adapter.created", actor=actor, adapter=adapter, rank=rank, targets=targets)
    return adapter


def _evaluate(adapter: Adapter, tensors: dict) -> dict:
    from training.registry.evaluation import evaluate_tensors

    return evaluate_tensors(adapter, tensors)


def _next_number(adapter: Adapter) -> int:
    Adapter.objects.select_for_update(no_key=True).filter(pk=adapter.pk).first()  # serialise numbering per adapter
    return (adapter.versions.aggregate(top=Max("number"))["top"] or 0) + 1


@transaction.atomic
def version_create_seeded(*, adapter: Adapter, seed: int, actor=None, note: str = "") -> AdapterVersion:
    """A fresh adapter (the adapted model equals the base), bit-for-bit reproducible from ``seed``."""
    base = build_base(adapter.base_model)
    shapes = {key: tuple(value["shape"]) for key, value in adapter.tensor_spec.items()}
    tensors = initial_tensors(
        base, shapes, seed=seed, target_modules=adapter.target_modules, modules_to_save=adapter.modules_to_save
    )
    blob = blob_put_bytes(save_safetensors(dict(sorted(tensors.items()))))
    version = AdapterVersion.objects.create(
        adapter=adapter,
        number=_next_number(adapter),
        blob_sha256=blob.sha256,
        size=blob.size,
        metrics=_evaluate(adapter, tensors),
        source=AdapterVersion.Source.SEED,
        seed=seed,
        note=note,
        created_by=actor,
    )
    _record("version.created", actor=actor, adapter=adapter, version=version, source="seed", seed=seed)
    return version


@transaction.atomic
def version_import(
    *, adapter: Adapter, data: bytes, config: dict | None = None, actor=None, note: str = ""
) -> AdapterVersion:
    """Import a PEFT adapter file; it must match the adapter's spec exactly and hold finite values."""
    if len(data) > MAX_ARTIFACT_BYTES:
        raise TooLarge("artifact_too_large", f"the file is above {MAX_ARTIFACT_BYTES} bytes")
    if config is not None:
        _check_peft_config(adapter, config)
    try:
        tensors = load_checked(data, adapter.tensor_spec)
    except ArtifactRejected as exc:
        raise _rejected(exc) from None
    blob = blob_put_bytes(data)
    parent = adapter.versions.order_by("-number").first()
    version = AdapterVersion.objects.create(
        adapter=adapter,
        number=_next_number(adapter),
        parent=parent,
        blob_sha256=blob.sha256,
        size=blob.size,
        metrics=_evaluate(adapter, tensors),
        source=AdapterVersion.Source.IMPORT,
        note=note,
        created_by=actor,
    )
    _record("version.created", actor=actor, adapter=adapter, version=version, source="import", sha256=blob.sha256)
    return version


def _check_peft_config(adapter: Adapter, config: dict) -> None:
    if not isinstance(config, dict):
        raise Invalid("invalid_config", "adapter_config.json must be a JSON object")
    problems = []
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        problems.append(f"peft_type is {config.get('peft_type')!r}, not LORA")
    if config.get("r") != adapter.rank:
        problems.append(f"r is {config.get('r')!r}, the adapter's rank is {adapter.rank}")
    targets = config.get("target_modules")
    if targets is not None and sorted(targets if isinstance(targets, list) else [targets]) != sorted(
        adapter.target_modules
    ):
        problems.append(f"target_modules {targets!r} differ from {adapter.target_modules}")
    if problems:
        raise Invalid("invalid_config", "adapter_config.json does not match the adapter: " + "; ".join(problems))


_TRANSITIONS = {
    "release": ({AdapterVersion.State.CANDIDATE}, AdapterVersion.State.RELEASED),
    "revoke": ({AdapterVersion.State.CANDIDATE, AdapterVersion.State.RELEASED}, AdapterVersion.State.REVOKED),
}


@transaction.atomic
def version_transition(*, version: AdapterVersion, action: str, actor, reason: str = "") -> AdapterVersion:
    allowed, target = _TRANSITIONS[action]
    current = AdapterVersion.objects.select_for_update(no_key=True).get(pk=version.pk)
    if current.state not in allowed:
        raise Conflict("invalid_transition", f"Cannot {action} a version that is {current.state}.")
    AdapterVersion.objects.filter(pk=version.pk).update(state=target)
    version.refresh_from_db()
    _record(f"version.{action}d", actor=actor, adapter=version.adapter, version=version, reason=reason)
    return version


def version_export_peft(version: AdapterVersion) -> bytes:
    """A zip of a PEFT adapter directory: ``adapter_model.safetensors`` and ``adapter_config.json``."""
    adapter = version.adapter
    config = peft_config(
        rank=adapter.rank,
        alpha=adapter.alpha,
        dropout=adapter.dropout,
        target_modules=adapter.target_modules,
        modules_to_save=adapter.modules_to_save,
    )
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("adapter_model.safetensors", blob_read(version.blob_sha256))
        archive.writestr("adapter_config.json", json.dumps(config, indent=2))
    return buffer.getvalue()


@transaction.atomic
def adapter_set_aggregation(*, adapter: Adapter, actor, aggregation: dict | None = None, dp: dict | None = None):
    """Change an adapter's aggregation strategy or DP settings; rounds already open keep their snapshot."""
    changes = {}
    if aggregation is not None:
        changes["aggregation"] = aggregation
    if dp is not None:
        changes["dp"] = dp
    if changes:
        Adapter.objects.filter(pk=adapter.pk).update(**changes)
        _record("adapter.aggregation_changed", actor=actor, adapter=adapter, **changes)
    adapter.refresh_from_db()
    return adapter


@transaction.atomic
def adapter_set_cohorts(*, adapter: Adapter, actor, cohorts) -> Adapter:
    """Replace the cohorts an adapter serves (its devices train it, its rollouts go there). A cohort that a
    running or paused rollout of the adapter goes to cannot be dropped (409): abort or finish it first.
    Records ``adapter.cohorts_changed`` with what was added and removed; nothing when nothing changes."""
    adapter = Adapter.objects.select_for_update(no_key=True).get(pk=adapter.pk)
    before = {cohort.pk: cohort.name for cohort in adapter.cohorts.all()}
    after = {cohort.pk: cohort.name for cohort in cohorts}
    dropped = set(before) - set(after)
    busy = (
        Rollout.objects.filter(
            version__adapter=adapter, cohort__in=dropped, state__in=(Rollout.State.RUNNING, Rollout.State.PAUSED)
        )
        .select_related("cohort")
        .order_by("pk")
        .first()
    )
    if busy is not None:
        raise Conflict(
            "cohort_in_use",
            f"rollout {busy.pk} of {adapter.name} is {busy.state} in cohort {busy.cohort.name}; "
            "abort it or let it finish before the adapter stops serving that cohort",
        )
    if set(before) != set(after):
        adapter.cohorts.set(list(after))
        _record(
            "adapter.cohorts_changed",
            actor=actor,
            adapter=adapter,
            cohorts=sorted(after.values()),
            added=sorted(after[pk] for pk in set(after) - set(before)),
            removed=sorted(before[pk] for pk in dropped),
        )
    return adapter


def _personalization_checked(values, *, modules: list[str]) -> dict:
    """The setting to store, or a 400 shaped as a field error of ``personalization`` (as the API's own)."""
    try:
        return validate_personalization(values, modules=modules)
    except ValueError as exc:
        raise Invalid("invalid", "The request has invalid fields.", details={"personalization": [str(exc)]}) from None


@transaction.atomic
def adapter_set_personalization(*, adapter: Adapter, actor, personalization: dict) -> Adapter:
    """Replace an adapter's personalization setting (what is left out takes the defaults). Manifests signed
    from now on carry it; devices already running a version get it with their next assignment."""
    adapter = Adapter.objects.select_for_update(no_key=True).get(pk=adapter.pk)
    stored = _personalization_checked(personalization, modules=[*adapter.target_modules, *adapter.modules_to_save])
    if stored != adapter.personalization:
        previous = adapter.personalization
        Adapter.objects.filter(pk=adapter.pk).update(personalization=stored)
        _record(
            "adapter.personalization_changed", actor=actor, adapter=adapter, personalization=stored, previous=previous
        )
    adapter.refresh_from_db()
    return adapter
