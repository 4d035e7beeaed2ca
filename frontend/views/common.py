"""What the dashboard views share: running a service with its refusal shown as a message, going back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.shortcuts import redirect
from django.utils.http import url_has_allowed_host_and_scheme

from core.errors import DomainError


def run_service(request, call: Callable[[], Any], success: str | Callable[[Any], str]) -> Any:
    """Call a service; on success flash ``success``, on a domain refusal flash its message. Returns the
    service's result, or None when it refused (nothing changed: services refuse before they write)."""
    try:
        result = call()
    except DomainError as refusal:
        messages.error(request, refusal.message)
        return None
    messages.success(request, success(result) if callable(success) else success)
    return result


def redirect_back(request, fallback: str, *args):
    """Back to the page the form came from (``next``), if it is on this site; else to ``fallback``."""
    target = request.POST.get("next") or ""
    if target and url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}):
        return redirect(target)
    return redirect(fallback, *args)
