"""A load generator's own health: event-loop lag and GC pauses, recorded while ``state.recording`` is true
(into ``state.lag_ms`` and ``state.gc_pauses_ms``), so a stall on the client side is reported as such instead
of showing up as server latency. The generator tunes its collector the way ``fleet/asgi.py`` tunes the server's."""

from __future__ import annotations

import asyncio
import gc
import time

# Keep the generator's GC from stalling its event loop (the same reasoning as fleet/asgi.py).
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def lag_monitor(state) -> None:
    """How late the generator's own loop wakes up: a busy generator would inflate the measured round trips."""
    loop = asyncio.get_running_loop()
    period = 0.1
    while True:
        before = loop.time()
        await asyncio.sleep(period)
        if state.recording:
            state.lag_ms.append(max(0.0, (loop.time() - before - period) * 1000))


def install_gc_probe(state) -> None:
    started: list[float] = []

    def probe(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started and state.recording:
            state.gc_pauses_ms.append((time.perf_counter() - started[0]) * 1000)

    gc.callbacks.append(probe)


def run_loop(coroutine) -> None:
    """Run ``coroutine`` on uvloop when it is installed (as the server does), else on asyncio's loop."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    runner(coroutine)


def run_main(run, args) -> int:
    """A simulator script's ``main``: ``await run(args, command_line)`` on the event loop with Ctrl-C and SIGTERM
    stopping it cleanly, the open-file limit raised and the results folder made; returns its exit code."""
    import shlex
    import signal
    import sys
    from pathlib import Path

    from bench.fleetsim import RESULTS_DIR
    from bench.fleetsim.resources import raise_open_file_limit

    command_line = shlex.join([Path(sys.executable).as_posix(), *sys.argv])
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    raise_open_file_limit()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    outcome: list[int] = []

    async def body() -> None:
        outcome.append(await run(args, command_line))

    run_loop(body())
    return outcome[0] if outcome else 1
