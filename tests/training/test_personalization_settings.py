"""An adapter's personalization setting: validated (each bad value a 400 that changes nothing), set at creation
and with PUT by operators, audited, shown resolved, and signed into every manifest's training object."""

from __future__ import annotations

import time

import pytest

from devices.server_key import server_public_key_b64
from edge_agent.manifest import verify_manifest
from training.models import Adapter, TrainingEvent
from training.registry.personalization_settings import PERSONALIZATION_DEFAULTS, personalization_settings
from training.registry.services import version_create_seeded
from training.rollouts.manifests import manifest_sign

pytestmark = pytest.mark.django_db

# Each as the JSON text a client sends (1e400 reaches the server as written: its parser makes it infinity).
BAD_SETTINGS = [
    ('{"method": "magic"}', "method must be one of"),
    ('{"method": 3}', "method must be one of"),
    ('{"lambda": 0}', "lambda must be a finite number above 0"),
    ('{"lambda": -0.5}', "lambda must be a finite number above 0"),
    ('{"lambda": "0.1"}', "lambda must be a finite number above 0"),
    ('{"lambda": true}', "lambda must be a finite number above 0"),
    ('{"lambda": 1e400}', "lambda must be a finite number above 0"),
    ('{"private_modules": "head"}', "private_modules must be a list"),
    ('{"private_modules": ["head", 3]}', "private_modules must be a list"),
    ('{"private_modules": [""]}', "private_modules must be a list"),
    ('{"private_modules": ["head", "head"]}', "names a module twice"),
    ('{"private_modules": ["decoder"]}', "not among the adapter's target_modules or modules_to_save"),
    ('{"method": "private_modules", "private_modules": []}', "needs at least one module"),
    ('{"epochs": 0}', "epochs must be a whole number from 1 to 100"),
    ('{"epochs": 101}', "epochs must be a whole number from 1 to 100"),
    ('{"epochs": 2.5}', "epochs must be a whole number from 1 to 100"),
    ('{"lr": 0}', "lr must be a finite number above 0"),
    ('{"lr": null}', "lr must be a finite number above 0"),
    ('{"margin": -0.01}', "margin must be a number from 0 to 1"),
    ('{"margin": 1.5}', "margin must be a number from 0 to 1"),
    ('{"min_val_samples": -1}', "min_val_samples must be a whole number from 0 to 10000"),
    ('{"min_val_samples": 10001}', "min_val_samples must be a whole number from 0 to 10000"),
    ('{"min_val_samples": false}', "min_val_samples must be a whole number from 0 to 10000"),
    ('{"release_classes": 1}', "release_classes must be true or false"),
    ('{"release_classes": "yes"}', "release_classes must be true or false"),
    ('{"unlabeled": "guess"}', "unlabeled must be one of none, pseudo_label, not 'guess'"),
    ('{"unlabeled": null}', "unlabeled must be one of none, pseudo_label"),
    ('{"confidence": 0}', "confidence must be a number above 0 and at most 1"),
    ('{"confidence": 1.01}', "confidence must be a number above 0 and at most 1"),
    ('{"confidence": "0.9"}', "confidence must be a number above 0 and at most 1"),
    ('{"mu": 0.1}', "unknown personalization settings: ['mu']"),
    ('"ditto"', "must be a JSON object"),
    ('[{"method": "ditto"}]', "must be a JSON object"),
]


def _url(adapter) -> str:
    return f"/api/v1/adapters/{adapter.pk}/personalization/"


@pytest.mark.parametrize(("bad", "message"), BAD_SETTINGS, ids=[text[:40] for text, _ in BAD_SETTINGS])
def test_each_bad_setting_is_a_400_naming_it_and_changes_nothing(adapter, api_client_for, bad, message):
    operator = api_client_for("operator")
    operator.put(_url(adapter), {"personalization": {"method": "finetune", "epochs": 3}}, format="json")
    events = TrainingEvent.objects.count()
    body = '{"personalization": ' + bad + "}"
    response = operator.generic("PUT", _url(adapter), body, content_type="application/json")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid"
    assert message in error["details"]["personalization"][0]
    adapter.refresh_from_db()
    assert adapter.personalization == {"method": "finetune", "epochs": 3}
    assert TrainingEvent.objects.count() == events


def test_nan_and_a_body_without_the_setting_are_refused_and_change_nothing(adapter, api_client_for):
    operator = api_client_for("operator")
    nan = operator.generic(
        "PUT", _url(adapter), '{"personalization": {"lambda": NaN}}', content_type="application/json"
    )
    assert nan.status_code == 400 and nan.json()["error"]["code"] == "parse_error"
    missing = operator.put(_url(adapter), {"method": "ditto"}, format="json")
    assert missing.status_code == 400 and "personalization" in missing.json()["error"]["details"]
    not_json = operator.generic("PUT", _url(adapter), "method=ditto", content_type="application/x-www-form-urlencoded")
    assert not_json.status_code == 415
    adapter.refresh_from_db()
    assert adapter.personalization == {}
    assert not adapter.events.filter(kind="adapter.personalization_changed").exists()


def test_operators_set_the_setting_viewers_and_strangers_cannot_and_unknown_adapters_are_404(adapter, api_client_for):
    body = {"personalization": {"method": "private_modules", "private_modules": ["head"], "lr": 0.05}}
    assert api_client_for(None).put(_url(adapter), body, format="json").status_code == 401
    refused = api_client_for("viewer").put(_url(adapter), body, format="json")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    adapter.refresh_from_db()
    assert adapter.personalization == {}
    missing = api_client_for("operator").put("/api/v1/adapters/999999/personalization/", body, format="json")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert api_client_for("operator").delete(_url(adapter)).status_code == 405

    done = api_client_for("operator").put(_url(adapter), body, format="json")
    assert done.status_code == 200, done.content
    expected = {**PERSONALIZATION_DEFAULTS, **body["personalization"]}
    assert done.json() == {"adapter": adapter.name, "personalization": expected}
    adapter.refresh_from_db()
    assert adapter.personalization == body["personalization"]  # only what the operator set
    event = adapter.events.get(kind="adapter.personalization_changed")
    assert event.detail == {"personalization": body["personalization"], "previous": {}}
    assert event.actor_label.startswith("operator-")
    # The adapter's own read shows every setting resolved; the same PUT again records nothing new.
    shown = api_client_for("viewer").get(f"/api/v1/adapters/{adapter.pk}/").json()
    assert shown["personalization"] == expected
    api_client_for("admin").put(_url(adapter), body, format="json")
    assert adapter.events.filter(kind="adapter.personalization_changed").count() == 1


def test_an_adapter_is_created_with_its_setting_and_a_bad_one_creates_nothing(base_model, api_client_for):
    admin = api_client_for("admin")
    base = {"name": "personal-lora", "base_model": base_model.name, "rank": 4, "alpha": 8.0}
    bad = admin.post("/api/v1/adapters/", {**base, "personalization": {"method": "sometimes"}}, format="json")
    assert bad.status_code == 400 and "method must be one of" in bad.json()["error"]["details"]["personalization"][0]
    # Only the service knows the modules: a module the adapter does not have is refused there, as a field error.
    foreign = admin.post(
        "/api/v1/adapters/",
        {**base, "modules_to_save": [], "personalization": {"method": "private_modules", "private_modules": ["head"]}},
        format="json",
    )
    assert foreign.status_code == 400, foreign.content
    assert "not among the adapter's" in foreign.json()["error"]["details"]["personalization"][0]
    assert not Adapter.objects.filter(name="personal-lora").exists()

    made = admin.post("/api/v1/adapters/", {**base, "personalization": {"method": "finetune"}}, format="json")
    assert made.status_code == 201, made.content
    assert made.json()["personalization"] == {**PERSONALIZATION_DEFAULTS, "method": "finetune"}
    assert Adapter.objects.get(name="personal-lora").personalization == {"method": "finetune"}
    # Without one it takes the defaults, and the default private_modules need not exist where unused.
    plain = admin.post("/api/v1/adapters/", {**base, "name": "plain-lora", "modules_to_save": []}, format="json")
    assert plain.status_code == 201 and plain.json()["personalization"] == PERSONALIZATION_DEFAULTS


def test_the_manifest_signs_the_resolved_setting_and_the_agent_accepts_it(adapter, cohort, api_client_for):
    adapter.cohorts.add(cohort)
    version = version_create_seeded(adapter=adapter, seed=3)
    device_id = "6a1c1c52-8f1e-4a43-9d7b-3c2f50a1e001"

    def checked(seq: int) -> dict:
        envelope = manifest_sign(device_id=device_id, version=version, assignment_seq=seq)
        return verify_manifest(
            envelope,
            server_public_key=server_public_key_b64(),
            device_id=device_id,
            base_model_sha256=adapter.base_model.weights_sha256,
            last_accepted_seq=seq - 1,
            now=time.time(),
        )

    assert checked(1)["training"]["personalization"] == PERSONALIZATION_DEFAULTS
    setting = {"method": "ditto", "lambda": 0.5, "epochs": 8, "release_classes": False}
    api_client_for("operator").put(_url(adapter), {"personalization": setting}, format="json")
    adapter.refresh_from_db()
    manifest = checked(2)  # the same version, signed again: the new setting, and the signature holds
    assert manifest["training"]["personalization"] == {**PERSONALIZATION_DEFAULTS, **setting}
    assert manifest["training"]["personalization"] == personalization_settings(adapter)
    assert manifest["training"]["rank"] == adapter.rank  # the rest of the training object is as before
