"""Domain errors (core.errors) carry no HTTP: the API's one exception handler maps each kind to its status,
and an app's families keep the status of their kind (the kind is listed first)."""

import pytest

from core.api.errors import domain_status
from core.errors import Conflict, DomainError, Forbidden, Invalid, NotFound, TooLarge, TooMany, Unauthenticated
from devices.errors import (
    DeviceAuthFailed,
    DeviceAuthMalformed,
    DeviceNotAllowed,
    DeviceNotAuthenticated,
    EnrollmentConflict,
    EnrollmentInvalid,
    EnrollmentTokenRefused,
    InvalidTransition,
)
from training.federation.intake import (
    UploadConflict,
    UploadForbidden,
    UploadNotFound,
    UploadRefused,
    UploadTooLarge,
    UploadTooMany,
)
from training.federation.rounds import DpBudgetExhausted, RoundAlreadyOpen


@pytest.mark.parametrize(
    ("kind", "status"),
    [
        (DomainError, 400),
        (Invalid, 400),
        (Unauthenticated, 401),
        (Forbidden, 403),
        (NotFound, 404),
        (Conflict, 409),
        (TooLarge, 413),
        (TooMany, 429),
        (UploadRefused, 400),
        (UploadNotFound, 404),
        (UploadForbidden, 403),
        (UploadConflict, 409),
        (UploadTooLarge, 413),
        (UploadTooMany, 429),
        (DeviceAuthMalformed, 400),
        (DeviceNotAuthenticated, 401),
        (DeviceNotAllowed, 403),
        (EnrollmentInvalid, 400),
        (EnrollmentTokenRefused, 401),
        (EnrollmentConflict, 409),
        (DpBudgetExhausted, 409),
        (RoundAlreadyOpen, 409),
    ],
)
def test_each_kind_of_refusal_has_its_status_and_families_keep_their_kind(kind, status):
    assert domain_status(kind("some_code", "a message")) == status


def test_a_family_is_caught_as_one_and_carries_its_code_message_and_details():
    with pytest.raises(DeviceAuthFailed) as caught:
        raise DeviceNotAllowed("device_suspended", "This device is suspended.", details={"status": "suspended"})
    assert (caught.value.code, caught.value.message, caught.value.details) == (
        "device_suspended",
        "This device is suspended.",
        {"status": "suspended"},
    )
    transition = InvalidTransition("Cannot approve a device that is active.")
    assert (transition.code, domain_status(transition)) == ("invalid_transition", 409)


def test_the_api_answers_a_services_refusal_with_the_error_body_and_its_status(api_client_for, adapter):
    """Through a real view to a service that refuses (a round for an adapter with no version yet): the
    domain error's code and message, the status of its kind, and nothing stored."""
    from training.models import Round

    response = api_client_for("operator").post("/api/v1/rounds/", {"adapter": adapter.name}, format="json")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "no_version"
    assert "no version to build on" in response.json()["error"]["message"]
    assert not Round.objects.exists()
