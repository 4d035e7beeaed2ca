"""The embedded Redis keeps its data over a restart (queued Celery tasks included)."""

from __future__ import annotations

from urllib.parse import urlsplit

import redis

from fleet.devstack import _start_embedded_redis


def test_embedded_redis_saves_its_data_and_loads_it_again_on_the_same_port(tmp_path):
    url, stop = _start_embedded_redis(tmp_path)
    try:
        client = redis.Redis.from_url(url)
        assert client.config_get("save") == {"save": "60 1000"}
        client.set("queued-task", "kept")
        client.close()
    finally:
        stop()  # SIGTERM: Redis saves on the way out
    again, stop = _start_embedded_redis(tmp_path, port=urlsplit(url).port)
    try:
        assert again == url
        assert redis.Redis.from_url(again).get("queued-task") == b"kept"
    finally:
        stop()
