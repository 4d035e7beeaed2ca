"""The personalization parts of the dashboard's pages: whether devices' own models help (per device, per adapter
and for the fleet) and the adapter's setting, which operators change with a form on the adapter page."""

from __future__ import annotations

import json

from django.contrib import messages
from django.core.exceptions import PermissionDenied

from accounts.roles import Role, has_role
from core.errors import DomainError
from frontend import selectors
from frontend.forms import PersonalizationForm
from frontend.personal_charts import accuracy_chart, gain_histogram
from training.models import Adapter
from training.registry.personalization_settings import SETTINGS_BY_METHOD, personalization_settings
from training.registry.services import adapter_set_personalization


def personalization_form(request, adapter: Adapter) -> PersonalizationForm:
    return PersonalizationForm(request.POST if request.method == "POST" else None, adapter=adapter)


def personalization_save(request, adapter: Adapter, form: PersonalizationForm) -> bool:
    """Store the form's setting (operators only); False, with the reason on the form, when it is refused."""
    if not has_role(request.user, Role.OPERATOR):
        raise PermissionDenied("Only operators change how devices personalize.")
    if not form.is_valid():
        return False
    try:
        adapter_set_personalization(adapter=adapter, actor=request.user, personalization=form.setting())
    except DomainError as refusal:
        form.add_error(None, (refusal.details.get("personalization") or [refusal.message])[0])
        return False
    messages.success(
        request,
        f"{adapter.name} now personalizes with {form.cleaned_data['method']}: devices get the setting with the "
        "next version they are assigned.",
    )
    return True


def adapter_personalization_context(request, adapter: Adapter, form: PersonalizationForm) -> dict:
    figures = selectors.adapter_personalization(adapter.pk)
    setting = personalization_settings(adapter)
    return {
        "personal": figures,
        "personal_setting": setting,
        "personal_uses": SETTINGS_BY_METHOD[setting["method"]],
        "personal_uses_by_method": json.dumps(SETTINGS_BY_METHOD),  # the form greys out what a method leaves unused
        "gain_chart": gain_histogram("Devices by gain of their own model, in points", figures["fleet"]["histogram"]),
        "personalization_form": form if has_role(request.user, Role.OPERATOR) else None,
    }


def device_personalization_context(device_id) -> dict:
    personal = selectors.device_personalization(device_id)
    return {
        "personal": personal,
        "accuracy_chart": accuracy_chart("Own model against the shared version, accuracy", personal.reports),
    }
