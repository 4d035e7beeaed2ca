"""The authorization matrices' snapshot of the database: every row of the project's models (``db_state``), to
prove that a refused call changed nothing, and what differs between two snapshots (``db_changes``); used by
tests/fleet/test_role_matrix.py and the device matrix, tests/devices/test_device_authz_*.py."""

from __future__ import annotations

import difflib

PROJECT_APPS = ("accounts", "devices", "training")
# Written by a successful sign-in or token check even when the call is then refused; not what it asked for.
VOLATILE_FIELDS = {"accounts.User": {"last_login"}, "accounts.ApiToken": {"last_used_at"}}


def db_state() -> dict[str, list[tuple]]:
    """Every row of the project's models (but the sign-in bookkeeping above), ordered by primary key; the
    tables behind many-to-many fields too (which cohorts an adapter serves, say)."""
    from django.apps import apps

    state = {}
    for model in apps.get_models(include_auto_created=True):
        label = model._meta.label
        if model._meta.app_label not in PROJECT_APPS:
            continue
        skip = VOLATILE_FIELDS.get(label, set())
        fields = [column.attname for column in model._meta.concrete_fields if column.name not in skip]
        state[label] = list(model.objects.order_by("pk").values_list(*fields))
    return state


def db_changes(before: dict, after: dict) -> str:
    """What differs between two ``db_state()``s, readably ("" when nothing does)."""
    lines = []
    for label in sorted(before):
        if before[label] != after[label]:
            diff = difflib.unified_diff(list(map(repr, before[label])), list(map(repr, after[label])), lineterm="", n=0)
            lines.append(f"{label}:\n  " + "\n  ".join(list(diff)[2:12]))
    return "\n".join(lines)
