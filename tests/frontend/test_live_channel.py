"""The dashboard's live socket over the real Redis channel layer."""

import logging
import time

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from core.live import LiveEvent, apublish
from devices import presence
from devices.models import Device
from devices.tasks import flush_presence
from fleet.asgi import application
from frontend.consumers import CLOSE_UNAUTHENTICATED
from tests.frontend.conftest import make_deltas, make_devices, make_versions
from training.federation.events import delta_payload
from training.models import Delta

pytestmark = pytest.mark.django_db(transaction=True)


async def _connect(cookie: str | None, origin: str = "http://localhost"):
    headers = [(b"origin", origin.encode()), (b"host", b"localhost")]
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    communicator = WebsocketCommunicator(application, "/ws/live/", headers=headers)
    connected, code = await communicator.connect(timeout=5)
    return communicator, connected, code


def _session_cookie(user) -> str:
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}"


def test_a_group_message_over_redis_reaches_a_signed_in_dashboard(make_user):
    cookie = _session_cookie(make_user("viewer"))

    async def scenario():
        communicator, connected, _ = await _connect(cookie)
        assert connected
        assert (await communicator.receive_json_from(timeout=5))["kind"] == "hello"
        await apublish(LiveEvent(kind="device.online", data={"device": "abc"}))
        message = await communicator.receive_json_from(timeout=5)
        assert message["kind"] == "device.online" and message["data"] == {"device": "abc"}
        assert message["text"] == "a device came online" and message["at"].endswith("+00:00")
        # Written in words with the device's name, linked to its page.
        device = "3f0e8c52-6a8e-4f3a-9d59-1f2b3c4d5e6f"
        await apublish(LiveEvent(kind="device.offline", data={"device": device, "name": "demo-03"}))
        message = await communicator.receive_json_from(timeout=5)
        assert message["text"] == "demo-03 went offline" and message["url"] == f"/devices/{device}/"
        # Events above the viewer's role are not forwarded.
        await apublish(LiveEvent(kind="secret.thing", data={}, min_role="admin"))
        await apublish(LiveEvent(kind="after", data={}))
        assert (await communicator.receive_json_from(timeout=5))["kind"] == "after"
        await communicator.disconnect()

    async_to_sync(scenario)()


def test_anonymous_and_foreign_origin_sockets_are_refused(make_user):
    cookie = _session_cookie(make_user("viewer"))

    async def scenario():
        communicator, connected, code = await _connect(None)
        assert not connected and code == CLOSE_UNAUTHENTICATED
        communicator, connected, _ = await _connect(cookie, origin="http://evil.example")
        assert not connected

    async_to_sync(scenario)()


def test_publish_from_sync_code_does_not_fail_without_listeners(caplog):
    """``publish`` swallows (and logs) what goes wrong, so not raising proves nothing: the send must not have
    failed, i.e. nothing was logged, also with no dashboard in the group."""
    from core.live import publish

    with caplog.at_level(logging.WARNING, logger="core.live"):
        publish(LiveEvent(kind="nobody.listening", data={}))
    assert not [record for record in caplog.records if record.name == "core.live"], caplog.text


def test_publish_from_sync_code_reaches_the_dashboard_on_one_long_lived_loop(make_user):
    """Workers publish from sync code; the events go out on the process's bridge loop (one set of Redis
    connections for the life of the process), also from a thread that itself runs an event loop."""
    import asyncio
    import threading

    from core import async_bridge
    from core.live import publish

    cookie = _session_cookie(make_user("viewer"))

    def from_a_thread(kind: str, *, inside_a_loop: bool) -> None:
        def run():
            if inside_a_loop:
                loop = asyncio.new_event_loop()
                loop.run_until_complete(_call_sync_inside(kind))
                loop.close()
            else:
                publish(LiveEvent(kind=kind, data={}))

        thread = threading.Thread(target=run)
        thread.start()
        thread.join(timeout=10)

    async def _call_sync_inside(kind):
        publish(LiveEvent(kind=kind, data={}))  # sync code called from async code, no thread hop

    async def scenario():
        communicator, connected, _ = await _connect(cookie)
        assert connected
        assert (await communicator.receive_json_from(timeout=5))["kind"] == "hello"
        await asyncio.to_thread(from_a_thread, "from.worker", inside_a_loop=False)
        assert (await communicator.receive_json_from(timeout=5))["kind"] == "from.worker"
        first_loop = async_bridge._loop
        await asyncio.to_thread(from_a_thread, "from.loop.thread", inside_a_loop=True)
        assert (await communicator.receive_json_from(timeout=5))["kind"] == "from.loop.thread"
        for i in range(20):
            await asyncio.to_thread(publish, LiveEvent(kind=f"n{i}", data={}))
        kinds = [(await communicator.receive_json_from(timeout=5))["kind"] for _ in range(20)]
        assert kinds == [f"n{i}" for i in range(20)]
        assert async_bridge._loop is first_loop and first_loop.is_running()
        await communicator.disconnect()

    async_to_sync(scenario)()


def test_presence_changes_reach_the_dashboard_with_the_devices_name(make_user, cohort):
    cookie = _session_cookie(make_user("viewer"))
    (device,) = make_devices(cohort, 1, prefix="kiosk")
    Device.objects.filter(pk=device.pk).update(online=False)
    presence.sync_client().zadd(presence.key("seen"), {str(device.pk): time.time()})

    async def scenario():
        communicator, connected, _ = await _connect(cookie)
        assert connected
        assert (await communicator.receive_json_from(timeout=5))["kind"] == "hello"
        await database_sync_to_async(flush_presence)()
        message = await communicator.receive_json_from(timeout=5)
        assert message["kind"] == "device.online"
        assert message["data"] == {"device": str(device.pk), "name": "kiosk-00000"}
        assert message["text"] == "kiosk-00000 came online" and message["url"] == f"/devices/{device.pk}/"
        await communicator.disconnect()

    async_to_sync(scenario)()


def test_a_delta_event_names_its_device_when_the_row_came_with_it_and_never_queries_for_it(
    cohort, adapter, django_assert_num_queries
):
    (device,) = make_devices(cohort, 1, prefix="demo")
    (version,) = make_versions(adapter, 1)
    (delta,) = make_deltas([device], adapter, version, 1)
    with django_assert_num_queries(0):
        assert delta_payload(delta)["device_name"] == "demo-00000"
    fresh = Delta.objects.get(pk=delta.pk)
    with django_assert_num_queries(0):
        payload = delta_payload(fresh)
    assert payload["device_name"] is None and payload["num_samples"] == 32
    assert payload["device"] == str(device.pk)
