"""Base models and adapters (lineage, metrics, export), rounds and rollouts.

Operators open, close and re-run rounds and create and steer rollouts, as the API allows; viewers read.
"""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from accounts.permissions import role_required
from accounts.roles import Role, has_role
from core.errors import DomainError
from devices.models import Cohort
from frontend import selectors
from frontend.charts import line_chart
from frontend.forms import OwnModelForm, ReleaseSettingsForm, RolloutForm, RoundOpenForm
from frontend.views.common import redirect_back, run_service
from frontend.views.personalization import (
    adapter_personalization_context,
    personalization_form,
    personalization_save,
)
from training.federation.aggregation_settings import validate_aggregation
from training.federation.rounds import round_close, round_open, round_rerun
from training.filters import RolloutFilterSet, RoundFilterSet
from training.models import Adapter, Rollout, Round
from training.registry.services import adapter_set_aggregation, base_model_create, build_base, candidate_modules
from training.rollouts.lifecycle import (
    rollout_abort,
    rollout_create,
    rollout_pause,
    rollout_resume,
    rollout_rollback,
    rollout_start,
)

METRIC_TITLES = {"eval_accuracy": "Evaluation accuracy", "eval_loss": "Evaluation loss"}
LINEAGE_SHOWN = 10  # versions in the adapter page's lineage until "show all" (``?versions=all``)


@role_required(Role.VIEWER)
def models(request):
    """Base models and adapters; admins upload their own model here (a ``.pt2`` and its card, or a Hugging Face
    text classifier's folder zipped): on success the page says which modules an adapter can target."""
    form = OwnModelForm(request.POST or None, request.FILES or None)
    if request.method == "POST":
        if not has_role(request.user, Role.ADMIN):
            raise PermissionDenied("Only admins register base models.")
        if form.is_valid():
            data = form.cleaned_data
            base = run_service(
                request,
                lambda: base_model_create(
                    name=data["name"],
                    family=data["kind"],
                    family_config=data["card"],
                    weights=data["program"].read(),
                    actor=request.user,
                ),  # fmt: skip
                lambda base: (
                    f"Registered {base.name} ({base.parameter_count:,} parameters). Modules an adapter can "
                    f"target: {', '.join(m['name'] for m in candidate_modules(build_base(base)))}."
                ),
            )
            if base is not None:
                return redirect("frontend:models")
    return render(
        request,
        "frontend/models.html",
        {"base_models": selectors.base_model_list(), "adapters": selectors.adapter_list(), "form": form},
        status=400 if form.is_bound and form.errors else 200,
    )


@role_required(Role.VIEWER)
def adapters(request):
    """``/adapters/``, the parent of an adapter's own page: the adapters are listed on the models page."""
    return redirect("frontend:models")


@role_required(Role.VIEWER)
def adapter_detail(request, pk: int):
    """The adapter: its state, then its settings (each form with them), its devices' own models, its history
    (the lineage's newest ``LINEAGE_SHOWN`` versions, all with ``?versions=all``); a POST (operators) changes its
    personalization setting."""
    detail = selectors.adapter_detail(pk)
    if detail is None:
        raise Http404("No such adapter.")
    form = personalization_form(request, detail.adapter)
    if request.method == "POST" and personalization_save(request, detail.adapter, form):
        return redirect("frontend:adapter-detail", pk)
    charts = [line_chart(METRIC_TITLES.get(name, name), points, metric=name) for name, points in detail.series.items()]
    (release,) = selectors.release_states(detail.adapter.pk)
    return render(
        request,
        "frontend/adapter_detail.html",
        {
            "d": detail,
            "adapter": detail.adapter,
            "charts": charts,
            "lineage": detail.lineage if request.GET.get("versions") == "all" else detail.lineage[:LINEAGE_SHOWN],
            "lineage_shown": LINEAGE_SHOWN,
            "can_export": has_role(request.user, Role.OPERATOR),
            "release": release,
            "release_form": ReleaseSettingsForm(
                initial={"auto_release": release.auto_release, "margin_points": round(release.margin * 100, 4)}
            )
            if has_role(request.user, Role.OPERATOR)
            else None,
            **adapter_personalization_context(request, detail.adapter, form),
        },
        status=400 if form.errors else 200,
    )


@require_POST
@role_required(Role.OPERATOR)
def adapter_release_settings(request, pk: int):
    """Operators turn automatic release on or off and set the release gate's margin."""
    adapter = get_object_or_404(Adapter, pk=pk)
    form = ReleaseSettingsForm(request.POST)
    if not form.is_valid():
        problems = "; ".join(f"{name}: {' '.join(errors)}" for name, errors in form.errors.items())
        messages.error(request, f"Nothing was changed: {problems}")
        return redirect("frontend:adapter-detail", pk)
    aggregation = {
        **(adapter.aggregation or {}),
        "auto_release": form.cleaned_data["auto_release"],
        "release_margin": round(form.cleaned_data["margin_points"] / 100, 6),
    }
    try:
        validate_aggregation(aggregation)
    except ValueError as refusal:
        messages.error(request, f"Nothing was changed: {refusal}")
        return redirect("frontend:adapter-detail", pk)
    adapter_set_aggregation(adapter=adapter, actor=request.user, aggregation=aggregation)
    messages.success(
        request,
        f"{adapter.name}: automatic release {'on' if aggregation['auto_release'] else 'off'}, release margin "
        f"{form.cleaned_data['margin_points']:g} points.",
    )
    return redirect("frontend:adapter-detail", pk)


# --- rounds ----------------------------------------------------------------------------------------------------


@role_required(Role.VIEWER)
def rounds(request):
    form = RoundOpenForm(request.POST or None)
    if request.method == "POST":
        if not has_role(request.user, Role.OPERATOR):
            raise PermissionDenied("Only operators open rounds.")
        if form.is_valid():
            fields = {k: v for k, v in form.cleaned_data.items() if k != "adapter" and v is not None}
            opened = run_service(
                request,
                lambda: round_open(adapter=form.cleaned_data["adapter"], actor=request.user, **fields),
                lambda r: f"Opened round {r.pk} for {r.adapter.name} on v{r.base_version.number}.",
            )
            if opened is not None:
                return redirect("frontend:round-detail", opened.pk)
            return redirect("frontend:rounds")
    # The API's round filters (training.filters): a bad value is reported, the list is not shown.
    filters = RoundFilterSet(request.GET or None, queryset=selectors.round_list(), from_form=True)
    page = None
    if not filters.is_bound or filters.is_valid():
        page = selectors.paginate(filters.qs, request.GET.get("page"), selectors.ROUNDS_PER_PAGE)
    return render(
        request,
        "frontend/rounds.html",
        {
            "page": page,
            "form": form,
            "filters": filters.form,
            "state": filters.form["state"].value() or "",
            "adapter": filters.form["adapter"].value() or "",
            "states": Round.State.values,
            "adapters": selectors.adapters_for_rounds(),
        },
        status=400 if (form.is_bound and form.errors) or page is None else 200,
    )


@role_required(Role.VIEWER)
def round_detail(request, pk: int):
    state = request.GET.get("state", "")
    state = state if state in ("received", "accepted", "rejected", "aggregated") else ""
    detail = selectors.round_detail(pk, state=state, page=request.GET.get("page"))
    if detail is None:
        raise Http404("No such round.")
    return render(request, "frontend/round_detail.html", {"d": detail, "round": detail.round, "state": state})


ROUND_ACTIONS = {
    "close": (round_close, "Closed round {pk}: it is aggregating now."),
    "rerun": (round_rerun, "Round {pk} is aggregating again."),
}


@require_POST
@role_required(Role.OPERATOR)
def round_action(request, pk: int, action: str):
    if action not in ROUND_ACTIONS:
        raise Http404("unknown action")
    round_ = get_object_or_404(Round, pk=pk)
    service, message = ROUND_ACTIONS[action]
    run_service(request, lambda: service(round_=round_, actor=request.user), message.format(pk=pk))
    return redirect("frontend:round-detail", pk)


# --- rollouts --------------------------------------------------------------------------------------------------


@role_required(Role.VIEWER)
def rollouts(request):
    # The API's rollout filters (training.filters): a bad value is reported, the list is not shown.
    filters = RolloutFilterSet(request.GET or None, queryset=selectors.rollout_list(), from_form=True)
    page = None
    if not filters.is_bound or filters.is_valid():
        page = selectors.paginate(filters.qs, request.GET.get("page"), selectors.ROLLOUTS_PER_PAGE)
        page.object_list = selectors.with_device_counts(page.object_list)
    return render(
        request,
        "frontend/rollouts.html",
        {
            "page": page,
            "filters": filters.form,
            "state": filters.form["state"].value() or "",
            "states": Rollout.State.values,
        },
        status=400 if page is None else 200,
    )


@role_required(Role.OPERATOR)
def rollout_create_view(request):
    versions = selectors.rollout_versions()
    form = RolloutForm(request.POST or None, versions=versions)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            rollout = rollout_create(
                version=data["version"],
                cohort=data["cohort"],
                phases=data["phases"],
                guards=data["guards"],
                on_breach=data["on_breach"],
                max_failure_rate=data["max_failure_rate"],
                actor=request.user,
                override_gate=data["override_gate"],
                override_reason=data["override_reason"],
            )
        except DomainError as refusal:
            form.add_error(None, refusal.message)
        else:
            return redirect("frontend:rollout-detail", rollout.pk)
    return render(
        request,
        "frontend/rollout_form.html",
        {"form": form, "has_versions": bool(versions), "has_cohorts": Cohort.objects.exists()},
        status=400 if form.is_bound and form.errors else 200,
    )


@role_required(Role.VIEWER)
def rollout_detail(request, pk: int):
    detail = selectors.rollout_detail(pk)
    if detail is None:
        raise Http404("No such rollout.")
    return render(
        request,
        "frontend/rollout_detail.html",
        {"d": detail, "rollout": detail.rollout, "actions": rollout_actions_for(request.user, detail.rollout)},
    )


ROLLOUT_ACTIONS = {
    "start": (rollout_start, False, {Rollout.State.DRAFT}),
    "pause": (rollout_pause, True, {Rollout.State.RUNNING}),
    "resume": (rollout_resume, False, {Rollout.State.PAUSED}),
    "abort": (rollout_abort, True, {Rollout.State.RUNNING, Rollout.State.PAUSED}),
    "rollback": (rollout_rollback, True, {Rollout.State.RUNNING, Rollout.State.PAUSED, Rollout.State.COMPLETED}),
}
ROLLOUT_PAST = {
    "start": "started",
    "pause": "paused",
    "resume": "resumed",
    "abort": "aborted",
    "rollback": "rolled back",
}


def rollout_actions_for(user, rollout: Rollout) -> list[str]:
    if not has_role(user, Role.OPERATOR):
        return []
    return [action for action, (_, _, states) in ROLLOUT_ACTIONS.items() if rollout.state in states]


@require_POST
@role_required(Role.OPERATOR)
def rollout_action(request, pk: int, action: str):
    if action not in ROLLOUT_ACTIONS:
        raise Http404("unknown action")
    rollout = get_object_or_404(Rollout, pk=pk)
    service, takes_reason, _ = ROLLOUT_ACTIONS[action]
    kwargs = {"reason": request.POST.get("reason", "")[:300]} if takes_reason else {}
    run_service(
        request,
        lambda: service(rollout=rollout, actor=request.user, **kwargs),
        f"Rollout {pk} {ROLLOUT_PAST[action]}.",
    )
    return redirect_back(request, "frontend:rollout-detail", pk)
