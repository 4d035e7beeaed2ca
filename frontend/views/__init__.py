"""Dashboard pages, by area. Thin: authorize, call a service or a selector (``frontend.selectors``), render."""

from frontend.views.accounts import (  # noqa: F401
    LoginView,
    api_token_revoke_view,
    api_tokens,
    logout_view,
    system,
    user_role,
    users,
)
from frontend.views.adapter_cohorts import adapter_cohorts  # noqa: F401
from frontend.views.devices import (  # noqa: F401
    cohorts,
    device_action,
    device_bulk,
    device_detail,
    devices,
    enrollment_token_revoke_view,
    enrollment_tokens,
)
from frontend.views.overview import overview  # noqa: F401
from frontend.views.training import (  # noqa: F401
    adapter_detail,
    adapter_release_settings,
    adapters,
    models,
    rollout_action,
    rollout_create_view,
    rollout_detail,
    rollouts,
    round_action,
    round_detail,
    rounds,
)
