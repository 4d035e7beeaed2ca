"""The web server's command line, written once: the uvicorn flags every web process runs with.

``uvicorn_args`` is what the launcher (``make run``), the production image (``python -m fleet.serve``, the
Dockerfile's CMD) and the benchmarks' no-op echo server (``bench/fleetsim/echo_server.py``, its own app) pass
to uvicorn. ``python -m fleet.serve --host H --port P --workers N`` replaces itself with that uvicorn.

It sets nothing up itself (no Django, no services): uvicorn's workers import the app as before.
"""

from __future__ import annotations

import argparse
import os
import sys

APP = "fleet.asgi:application"


def uvicorn_args(
    *,
    host: str,
    port: int,
    workers: int,
    app: str = APP,
    graceful_shutdown: int | None = None,
    forwarded_allow_ips: str | None = None,
) -> list[str]:
    """uvicorn's arguments (after ``python -m uvicorn``) serving ``app`` on ``host:port`` with ``workers``
    processes. ``graceful_shutdown``: seconds open connections get at shutdown (``--timeout-graceful-shutdown``;
    uvicorn's default, waiting for them without limit, when None). ``forwarded_allow_ips``: the proxies whose
    ``X-Forwarded-*`` headers are trusted (``--proxy-headers``; uvicorn's default, 127.0.0.1 or the
    FORWARDED_ALLOW_IPS variable, when None)."""
    args = [
        app,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--ws",
        "wsproto",
        # Protocol pings only find sockets whose peer vanished (presence comes from the agents'
        # heartbeats): uvicorn's default, every 20 s, was 100 pings and pongs a second for 2,000 agents.
        "--ws-ping-interval",
        "60",
        "--ws-ping-timeout",
        "30",
        "--loop",
        "uvloop",
        "--http",
        "httptools",
        "--lifespan",
        "off",
        "--no-access-log",
    ]
    if graceful_shutdown is not None:
        args += ["--timeout-graceful-shutdown", str(graceful_shutdown)]
    if forwarded_allow_ips is not None:
        args += ["--proxy-headers", "--forwarded-allow-ips", forwarded_allow_ips]
    return args


def uvicorn_command(**kwargs) -> list[str]:
    """The whole command: this interpreter running uvicorn with ``uvicorn_args(**kwargs)``."""
    return [sys.executable, "-m", "uvicorn", *uvicorn_args(**kwargs)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fleet.serve", description="Run the web server (uvicorn).")
    parser.add_argument("--app", default=APP, help=f"the ASGI app (default {APP})")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=int(os.environ.get("WEB_CONCURRENCY") or 2))
    parser.add_argument(
        "--timeout-graceful-shutdown", dest="graceful_shutdown", type=int, default=None, metavar="SECONDS"
    )
    parser.add_argument(
        "--forwarded-allow-ips",
        default=None,
        metavar="ADDRESSES",
        help="trust X-Forwarded-* headers from these proxies ('*': any; behind a load balancer)",
    )
    args = parser.parse_args(argv)
    command = uvicorn_command(
        app=args.app,
        host=args.host,
        port=args.port,
        workers=args.workers,
        graceful_shutdown=args.graceful_shutdown,
        forwarded_allow_ips=args.forwarded_allow_ips,
    )
    sys.stdout.flush()
    os.execv(command[0], command)  # noqa: S606  (uvicorn takes this process over: same pid, signals reach it)


if __name__ == "__main__":
    main()
