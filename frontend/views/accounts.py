"""Sign-in, API tokens, users and the system status page."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import logout
from django.contrib.auth import views as auth_views
from django.core.cache import cache
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from accounts.models import ApiToken, User
from accounts.permissions import role_required
from accounts.roles import Role, has_role
from accounts.services import api_token_create, api_token_revoke, user_create, user_update
from core.health import readiness
from frontend.forms import ApiTokenForm, UserCreateForm


class LoginView(auth_views.LoginView):
    """Sign-in, with failed attempts limited per client address and per user name (``LOGIN_FAILURE_LIMIT``
    in ``LOGIN_FAILURE_WINDOW_SECONDS``), so a password cannot be guessed at speed."""

    template_name = "frontend/login.html"
    redirect_authenticated_user = True

    def _keys(self) -> list[str]:
        address = self.request.META.get("REMOTE_ADDR", "unknown")
        username = str(self.request.POST.get("username", ""))[:150].lower()
        return [f"login-failures:addr:{address}", f"login-failures:user:{username}"]

    def post(self, request, *args, **kwargs):
        if any(cache.get(key, 0) >= settings.LOGIN_FAILURE_LIMIT for key in self._keys()):
            minutes = max(1, settings.LOGIN_FAILURE_WINDOW_SECONDS // 60)
            context = self.get_context_data(form=self.get_form_class()(request))  # unbound: never authenticated
            context["locked_out"] = f"Too many failed sign-ins. Wait {minutes} minutes and try again."
            response = self.render_to_response(context)
            response.status_code = 429
            return response
        return super().post(request, *args, **kwargs)

    def form_invalid(self, form):
        for key in self._keys():
            cache.add(key, 0, timeout=settings.LOGIN_FAILURE_WINDOW_SECONDS)
            cache.incr(key)
        return super().form_invalid(form)


@require_POST
def logout_view(request):
    logout(request)
    return redirect("frontend:login")


@role_required(Role.VIEWER)
def system(request):
    """Dependencies' health (it pings the Celery workers, so it lives apart from the fleet overview)."""
    return render(
        request,
        "frontend/system.html",
        {"status": readiness(), "accounts": User.objects.active_counts_by_role()},
    )


@role_required(Role.VIEWER)
def api_tokens(request):
    tokens = ApiToken.objects.select_related("user")
    if not has_role(request.user, Role.ADMIN):
        tokens = tokens.filter(user=request.user)
    form = ApiTokenForm(request.POST or None)
    issued = None
    if request.method == "POST" and form.is_valid():
        issued = api_token_create(
            user=request.user, name=form.cleaned_data["name"], expires_at=form.cleaned_data["expires_at"]
        )
        form = ApiTokenForm()
    return render(request, "frontend/api_tokens.html", {"tokens": tokens[:200], "form": form, "issued": issued})


@require_POST
@role_required(Role.VIEWER)
def api_token_revoke_view(request, pk: int):
    tokens = ApiToken.objects.all() if has_role(request.user, Role.ADMIN) else request.user.api_tokens.all()
    token = get_object_or_404(tokens, pk=pk)
    api_token_revoke(token=token)
    messages.success(request, f"Token {token} revoked.")
    return redirect("frontend:api-tokens")


@role_required(Role.ADMIN)
def users(request):
    form = UserCreateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        user = user_create(**form.cleaned_data)
        messages.success(request, f"Created {user.role} {user.username}.")
        return redirect("frontend:users")
    return render(request, "frontend/users.html", {"users": User.objects.order_by("username"), "form": form})


@require_POST
@role_required(Role.ADMIN)
def user_role(request, pk: int):
    user = get_object_or_404(User, pk=pk)
    role = request.POST.get("role")
    if role not in Role.values:
        messages.error(request, "Unknown role.")
    elif user == request.user:
        messages.error(request, "You cannot change your own role; ask another admin.")
    else:
        user_update(user=user, role=role)
        messages.success(request, f"{user.username} is now {role}.")
    return redirect("frontend:users")
