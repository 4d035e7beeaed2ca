"""Devices (list, detail, approval and quarantine), cohorts and enrollment tokens.

Roles follow the devices API: admins approve, reject and retire devices and manage cohorts and tokens;
operators may also quarantine and reactivate (an incident response); viewers read.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from accounts.permissions import role_required
from accounts.roles import Role, has_role
from core.errors import DomainError
from devices.feedback import MIN_ANSWERS, device_feedback
from devices.filters import DeviceFilterSet
from devices.models import Cohort, Device, DeviceStatus, EnrollmentToken
from devices.services import cohort_create, device_transition, enrollment_token_create, enrollment_token_revoke
from frontend import selectors
from frontend.forms import CohortForm, EnrollmentTokenForm
from frontend.views.common import redirect_back, run_service
from frontend.views.personalization import device_personalization_context

# The lowest role that may take each device action: the same as the devices API.
DEVICE_ACTION_ROLES = {
    "approve": Role.ADMIN,
    "reject": Role.ADMIN,
    "retire": Role.ADMIN,
    "quarantine": Role.OPERATOR,
    "reactivate": Role.OPERATOR,
}
BULK_ACTIONS = ("approve", "quarantine")
BULK_LIMIT = 200


def device_actions_for(user, device: Device) -> list[str]:
    """The actions this user may take on this device in its current status (what the page offers)."""
    from_status = {
        "approve": {DeviceStatus.PENDING},
        "reject": {DeviceStatus.PENDING},
        "quarantine": {DeviceStatus.ACTIVE},
        "reactivate": {DeviceStatus.QUARANTINED},
        "retire": {DeviceStatus.PENDING, DeviceStatus.ACTIVE, DeviceStatus.QUARANTINED},
    }
    return [
        action
        for action, role in DEVICE_ACTION_ROLES.items()
        if device.status in from_status[action] and has_role(user, role)
    ]


def _require(user, action: str) -> None:
    role = DEVICE_ACTION_ROLES.get(action)
    if role is None:
        raise Http404("unknown action")
    if not has_role(user, role):
        raise PermissionDenied(f"Only the {role.label.lower()} role may {action} devices.")


@role_required(Role.VIEWER)
def devices(request):
    # The API's device filters (devices.filters), read from the query string: a bad value is a form error, not a 500.
    filters = DeviceFilterSet(request.GET or None, queryset=selectors.device_list(), from_form=True)
    if filters.is_bound and not filters.is_valid():
        page = None
    else:
        page = selectors.paginate(filters.qs, request.GET.get("page"), selectors.DEVICES_PER_PAGE)
    bulk = [a for a in BULK_ACTIONS if has_role(request.user, DEVICE_ACTION_ROLES[a])]
    form = filters.form
    return render(
        request,
        "frontend/devices.html",
        {
            "form": form,
            "page": page,
            "filtered": filters.is_bound and any(form.data.get(k) for k in form.fields),
            "cohorts": Cohort.objects.order_by("name").values_list("name", flat=True),
            "versions": selectors.version_choices(),
            "bulk_actions": bulk,
        },
        status=400 if page is None else 200,
    )


def _uuids(values: list[str]) -> list[uuid.UUID]:
    parsed = []
    for value in values:
        try:
            parsed.append(uuid.UUID(value))
        except ValueError:
            continue
    return parsed


@require_POST
@role_required(Role.OPERATOR)
def device_bulk(request):
    action = request.POST.get("action", "")
    if action not in BULK_ACTIONS:
        messages.error(request, "Choose approve or quarantine.")
        return redirect_back(request, "frontend:devices")
    _require(request.user, action)
    ids = request.POST.getlist("device")[: BULK_LIMIT + 1]
    if not ids:
        messages.error(request, "Select at least one device.")
        return redirect_back(request, "frontend:devices")
    if len(ids) > BULK_LIMIT:
        messages.error(request, f"At most {BULK_LIMIT} devices at once.")
        return redirect_back(request, "frontend:devices")
    chosen = list(Device.objects.filter(pk__in=_uuids(ids)).order_by("name"))
    done, refused = [], []
    for device in chosen:
        try:
            device_transition(device=device, action=action, actor=request.user)
            done.append(device.name)
        except DomainError as refusal:  # e.g. approving one that is active: say which and why, do the rest
            refused.append(f"{device.name}: {refusal.message}")
    past = {"approve": "Approved", "quarantine": "Quarantined"}[action]
    if done:
        names = ", ".join(done[:10]) + ("…" if len(done) > 10 else "")
        messages.success(request, f"{past} {len(done)} device{'s' if len(done) != 1 else ''}: {names}")
    if refused:
        messages.error(request, "Not changed: " + "; ".join(refused[:10]) + ("…" if len(refused) > 10 else ""))
    if not chosen:
        messages.error(request, "None of the selected devices exist.")
    return redirect_back(request, "frontend:devices")


@role_required(Role.VIEWER)
def device_detail(request, pk):
    every = request.GET.get("assignments") == "all"
    limit = selectors.fleet.ASSIGNMENTS_LIMIT if every else selectors.fleet.ASSIGNMENTS_SHOWN
    detail = selectors.device_detail(pk, assignments=limit)
    if detail is None:
        raise Http404("No such device.")
    return render(
        request,
        "frontend/device_detail.html",
        {
            "d": detail,
            "device": detail.device,
            "actions": device_actions_for(request.user, detail.device),
            "protocol_1_until": settings.PROTOCOL_1_ACCEPTED_UNTIL,
            "all_assignments": every,
            **device_personalization_context(detail.device.pk),
            "feedback": device_feedback(detail.device),
            "min_answers": MIN_ANSWERS,
        },
    )


@require_POST
@role_required(Role.OPERATOR)
def device_action(request, pk):
    action = request.POST.get("action", "")
    _require(request.user, action)
    device = get_object_or_404(Device, pk=pk)
    reason = request.POST.get("reason", "")[:300]
    run_service(
        request,
        lambda: device_transition(device=device, action=action, actor=request.user, reason=reason),
        lambda d: f"{d.name} is now {d.status}.",
    )
    return redirect("frontend:device-detail", pk)


@role_required(Role.VIEWER)
def cohorts(request):
    form = CohortForm(request.POST or None)
    if request.method == "POST":
        if not has_role(request.user, Role.ADMIN):
            raise PermissionDenied("Only admins create cohorts.")
        if form.is_valid():
            cohort = cohort_create(name=form.cleaned_data["name"], description=form.cleaned_data["description"])
            messages.success(request, f"Created cohort {cohort.name}.")
            return redirect("frontend:cohorts")
    return render(
        request,
        "frontend/cohorts.html",
        {"cohorts": selectors.cohort_list(), "form": form},
        status=400 if form.is_bound and form.errors else 200,
    )


@role_required(Role.VIEWER)
def enrollment_tokens(request):
    form = EnrollmentTokenForm(request.POST or None)
    issued = None
    if request.method == "POST":
        if not has_role(request.user, Role.ADMIN):
            raise PermissionDenied("Only admins create enrollment tokens.")
        if form.is_valid():
            data = form.cleaned_data
            issued = enrollment_token_create(
                cohort=data["cohort"],
                name=data["name"],
                expires_at=timezone.now() + timedelta(hours=data["expires_in_hours"]),
                uses=data["uses"],
                requires_approval=data["requires_approval"],
                created_by=request.user,
            )
            form = EnrollmentTokenForm()
    response = render(
        request,
        "frontend/enrollment_tokens.html",
        {
            "tokens": selectors.enrollment_token_list(),
            "form": form,
            "issued": issued,
            "has_cohorts": Cohort.objects.exists(),
            "now": timezone.now(),
        },
        status=400 if form.is_bound and form.errors else 200,
    )
    if issued is not None:
        response["Cache-Control"] = "no-store"  # the secret is shown once: never from a cache either
    return response


@require_POST
@role_required(Role.ADMIN)
def enrollment_token_revoke_view(request, pk: int):
    token = get_object_or_404(EnrollmentToken, pk=pk)
    if token.revoked_at is not None:
        messages.info(request, f"{token} was already revoked.")
    else:
        enrollment_token_revoke(token=token)
        messages.success(request, f"Revoked {token}: no device can enroll with it any more.")
    return redirect_back(request, "frontend:enrollment-tokens")
