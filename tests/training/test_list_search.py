"""``?search=`` on every list of the REST API: it narrows the list, and no list ignores it silently."""

import pytest
from django.urls import get_resolver
from rest_framework.filters import SearchFilter

from devices.services import cohort_create
from training.federation.rounds import round_open
from training.registry.services import adapter_create, version_create_seeded
from training.rollouts.lifecycle import rollout_create


def _list_viewsets():
    """Every viewset behind a ``/api/v1/`` list route."""
    found = {}

    def walk(patterns, prefix=""):
        for pattern in patterns:
            if hasattr(pattern, "url_patterns"):
                walk(pattern.url_patterns, prefix + str(pattern.pattern))
                continue
            actions = getattr(pattern.callback, "actions", None) or {}
            route = prefix + str(pattern.pattern)
            if route.startswith("api/v1/") and actions.get("get") == "list":
                found[route] = pattern.callback.cls

    walk(get_resolver().url_patterns)
    return found


def test_every_list_that_takes_a_search_says_what_it_searches():
    lists = _list_viewsets()
    assert {"api/v1/rollouts/$", "api/v1/rounds/$", "api/v1/adapter-versions/$"} <= {
        route.replace("^", "") for route in lists
    }, sorted(lists)
    silent = [
        route
        for route, view in lists.items()
        if SearchFilter in view.filter_backends and not getattr(view, "search_fields", None)
    ]
    assert not silent, f"these lists would ignore ?search=: {silent}"


@pytest.mark.django_db
def test_search_narrows_versions_rounds_and_rollouts_to_the_adapter_named(base_model, make_user, api_client_for):
    admin = make_user("admin")
    cohort = cohort_create(name="eu-phones")
    for name in ("digits-lora", "keyboard-lora"):
        adapter = adapter_create(name=name, base_model=base_model, rank=4, alpha=8.0, actor=admin)
        adapter.cohorts.add(cohort)
        version = version_create_seeded(adapter=adapter, seed=1)
        round_open(adapter=adapter, actor=admin)
        rollout_create(version=version, cohort=cohort, phases=[{"percent": 100}], actor=admin)
    viewer = api_client_for("viewer")
    for path, adapter_of in (
        ("/api/v1/adapter-versions/", lambda row: row["adapter"]),
        ("/api/v1/rounds/", lambda row: row["adapter"]),
        ("/api/v1/rollouts/", lambda row: row["adapter"]),
    ):
        everything = viewer.get(path).json()
        assert everything["count"] == 2, (path, everything)
        found = viewer.get(path, {"search": "keyboard"}).json()
        assert found["count"] == 1 and adapter_of(found["results"][0]) == "keyboard-lora", (path, found)
        assert viewer.get(path, {"search": "no-such-adapter"}).json()["count"] == 0, path
