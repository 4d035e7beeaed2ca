import random
import stat

import pytest

from edge_agent.connection import Backoff
from edge_agent.identity import AgentState, load_or_create_key, public_key_b64


def test_key_is_created_once_with_mode_0600_and_reused(tmp_path):
    key = load_or_create_key(tmp_path)
    path = tmp_path / "device_key.pem"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert public_key_b64(load_or_create_key(tmp_path)) == public_key_b64(key)


def test_a_key_file_readable_by_others_is_refused(tmp_path):
    load_or_create_key(tmp_path)
    (tmp_path / "device_key.pem").chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        load_or_create_key(tmp_path)


def test_missing_state_explains_how_to_enroll(tmp_path):
    with pytest.raises(FileNotFoundError, match="edge-agent enroll"):
        AgentState.load(tmp_path)


def test_backoff_grows_exponentially_with_full_jitter_and_resets():
    backoff = Backoff(base=1.0, cap=60.0, rng=random.Random(7))
    ceilings = [min(60.0, 2.0**n) for n in range(1, 12)]
    delays = [backoff.next_delay() for _ in ceilings]
    assert all(0 <= delay <= ceiling for delay, ceiling in zip(delays, ceilings, strict=True))
    assert max(delays[-4:]) > 10  # it really does grow
    assert len(set(delays)) == len(delays)  # and is jittered
    backoff.reset()
    assert backoff.next_delay() <= 2.0
    slow = [backoff.next_delay(slowest=True) for _ in range(20)]
    assert all(30.0 <= delay <= 60.0 for delay in slow)
