"""Changing the cohorts an adapter serves from its page (admins, as over the API: ``PUT .../cohorts/``)."""

from __future__ import annotations

from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from accounts.permissions import role_required
from accounts.roles import Role
from frontend.forms import AdapterCohortsForm
from frontend.views.common import run_service
from training.models import Adapter
from training.registry.services import adapter_set_cohorts


@require_POST
@role_required(Role.ADMIN)
def adapter_cohorts(request, pk: int):
    """Replace the adapter's cohorts with the ones ticked; a bad choice or a refusal changes nothing and says why."""
    adapter = get_object_or_404(Adapter, pk=pk)
    form = AdapterCohortsForm(request.POST)
    if not form.is_valid():
        messages.error(request, " ".join(str(error) for error in form.errors.get("cohorts", [])))
        return redirect("frontend:adapter-detail", pk)
    chosen = list(form.cleaned_data["cohorts"])

    def served(_adapter) -> str:
        names = ", ".join(cohort.name for cohort in chosen) or "no cohort"
        return f"{adapter.name} now serves {names}."

    run_service(request, lambda: adapter_set_cohorts(adapter=adapter, actor=request.user, cohorts=chosen), served)
    return redirect("frontend:adapter-detail", pk)
