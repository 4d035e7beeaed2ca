"""The dashboard's live socket over the real Redis channel layer."""

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.test import Client

from fleet.asgi import application
from frontend.consumers import CLOSE_UNAUTHENTICATED
from frontend.live import LiveEvent, apublish

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


def test_publish_from_sync_code_does_not_fail_without_listeners():
    from frontend.live import publish

    publish(LiveEvent(kind="nobody.listening", data={}))


def test_publish_from_sync_code_reaches_the_dashboard_on_one_long_lived_loop(make_user):
    """Workers publish from sync code; the events go out on the process's bridge loop (one set of Redis
    connections for the life of the process), also from a thread that itself runs an event loop."""
    import asyncio
    import threading

    from fleet import async_bridge
    from frontend.live import publish

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
