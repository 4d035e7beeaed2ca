"""The presence flush (devices/presence.py) against other writers of the device rows, on real PostgreSQL and
Redis: it locks what it writes in id order, and a flush PostgreSQL ends to break a deadlock is run again."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from django.db import OperationalError, connection, transaction

from devices import presence
from devices.models import Device

pytestmark = pytest.mark.django_db(transaction=True)


def backends_waiting_on_a_lock() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0]


def test_a_flush_caught_in_a_deadlock_by_a_writer_out_of_id_order_is_run_again_and_writes_the_presence(
    enrolled, caplog
):
    # Another writer holds the device with the higher id and then wants the lower one: a writer that locks devices
    # one by one out of id order (a rollout assigned its devices in bucket order before). The flush, locking in id
    # order, holds the lower one and waits for the higher: a cycle PostgreSQL breaks by ending one of the two.
    low, high = sorted((enrolled("active", name="a"), enrolled("active", name="b")), key=lambda d: uuid.UUID(d.id))
    now = time.time()
    presence.sync_client().zadd(presence.key("seen"), {low.id: now, high.id: now})
    held, go, outcome = threading.Event(), threading.Event(), {}

    def other_writer():
        try:
            with transaction.atomic():
                Device.objects.select_for_update(no_key=True).filter(pk=high.id).first()
                held.set()
                go.wait(30)
                Device.objects.select_for_update(no_key=True).filter(pk=low.id).first()
        except OperationalError as exc:
            outcome["writer"] = exc
        finally:
            connection.close()

    def flush():
        try:
            outcome["flush"] = presence.flush_presence(now=now)
        except Exception as exc:  # noqa: BLE001 (reported below)
            outcome["flush_error"] = exc
        finally:
            connection.close()

    writer = threading.Thread(target=other_writer)
    writer.start()
    assert held.wait(30)
    flusher = threading.Thread(target=flush)
    flusher.start()
    deadline = time.monotonic() + 30
    while backends_waiting_on_a_lock() == 0:  # the flush holds the lower row and waits for the higher
        assert time.monotonic() < deadline, "the flush never waited for the other writer's row"
        time.sleep(0.05)
    go.set()
    writer.join(60)
    flusher.join(60)
    assert "flush_error" not in outcome, outcome.get("flush_error")
    # the cycle happened: PostgreSQL ended the writer, or the flush, which was then run again
    assert "writer" in outcome or "flushing again" in caplog.text
    assert set(outcome["flush"].came_online) == {low.id, high.id}
    assert Device.objects.filter(pk__in=[low.id, high.id], online=True).count() == 2


def test_a_flush_that_fails_otherwise_is_not_run_again(enrolled, monkeypatch):
    device = enrolled("active")
    presence.sync_client().zadd(presence.key("seen"), {device.id: time.time()})
    calls = []

    def refusing(rows, online):
        calls.append(1)
        raise OperationalError("the server closed the connection unexpectedly")

    monkeypatch.setattr(presence, "_write_presence", refusing)
    with pytest.raises(OperationalError, match="closed the connection"):
        presence.flush_presence()
    assert calls == [1]
    assert not Device.objects.get(pk=device.id).online
