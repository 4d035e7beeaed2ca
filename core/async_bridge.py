"""Run a coroutine from sync code (Celery tasks, services under a request) on one long-lived event loop.

``async_to_sync`` starts a thread and a new event loop for every call, and channels-redis and redis-py
keep their connections per event loop, so each live event or device push from a worker opened fresh Redis
connections (a measurable share of a verification, bench/README.md). Here one daemon thread per process
runs one loop for the life of the process, so those clients and their pools are made once and reused. A
process forked after the loop started (Celery's prefork pool) starts its own.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_pid: int | None = None


def _bridge_loop() -> asyncio.AbstractEventLoop:
    global _loop, _thread, _pid
    with _lock:
        if _loop is None or _pid != os.getpid() or _thread is None or not _thread.is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="fleet-async-bridge", daemon=True)
            thread.start()
            _loop, _thread, _pid = loop, thread, os.getpid()
        return _loop


def run_async(func: Callable[..., Awaitable[T]], *args: Any, timeout: float = 10.0) -> T:
    """``await func(*args)`` on the process's bridge loop and return its result (raises what it raised, or
    TimeoutError after ``timeout`` seconds). Callable from any thread except the bridge's own, including a
    thread that runs another event loop (sync code called from async code without a thread hop)."""
    loop = _bridge_loop()
    if threading.current_thread() is _thread:
        raise RuntimeError("run_async cannot be called from the bridge loop itself")
    future = asyncio.run_coroutine_threadsafe(func(*args), loop)
    try:
        return future.result(timeout=timeout)
    except TimeoutError:
        future.cancel()
        raise
