"""``edge-agent enroll`` against a live server: a refusal names the field and the code, an empty token is caught
before anything is sent, and a rate limit is waited out as the server asks (or reported with the wait)."""

from __future__ import annotations

import pytest

from edge_agent import enroll as enroll_module
from edge_agent.enroll import EnrollmentError, enroll


@pytest.mark.django_db(transaction=True)
def test_refusals_say_what_is_wrong_and_a_rate_limit_is_waited_out(live_server, tmp_path, settings, monkeypatch):
    settings.ENROLLMENT_RATE = "2/min"  # the two refusals below use it up
    with pytest.raises(EnrollmentError, match="--token is empty"):
        enroll(home=tmp_path / "a", server=live_server.url, token="  ", name="phone")
    assert not (tmp_path / "a").exists()  # nothing made, not even a key

    with pytest.raises(EnrollmentError) as refused:
        enroll(home=tmp_path / "b", server=live_server.url, token="fet_nonsense", name="x" * 101)
    assert "name" in str(refused.value) and "HTTP 400" in str(refused.value)  # the field the server refused

    with pytest.raises(EnrollmentError, match=r"enrollment_token_invalid, HTTP 401"):
        enroll(home=tmp_path / "c", server=live_server.url, token="fet_nonsense", name="phone")

    waits: list[float] = []
    monkeypatch.setattr(enroll_module, "sleep", waits.append)
    with pytest.raises(EnrollmentError) as limited:
        enroll(home=tmp_path / "d", server=live_server.url, token="fet_nonsense", name="phone")
    assert "HTTP 429" in str(limited.value) and "try again in" in str(limited.value)
    # Waited as asked, RATE_LIMIT_RETRIES times, then reported: the limit lasts a minute here.
    assert len(waits) == enroll_module.RATE_LIMIT_RETRIES and all(0 < wait <= 60 for wait in waits)

    # The rate lowered below what is on record (DRF alone would say nothing of when): still a Retry-After.
    settings.ENROLLMENT_RATE = "1/min"
    waits.clear()
    with pytest.raises(EnrollmentError, match="try again in"):
        enroll(home=tmp_path / "e", server=live_server.url, token="fet_nonsense", name="phone")
    assert len(waits) == enroll_module.RATE_LIMIT_RETRIES
