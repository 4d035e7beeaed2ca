"""``edge-agent``: the command devices run.

edge-agent enroll --server URL --token T [--name NAME] [--label key=value ...]
edge-agent run          # stay connected: heartbeats, commands, reconnect with backoff
edge-agent status       # what this device knows about itself and its connection
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import sys
import time
from pathlib import Path

from edge_agent import __version__
from edge_agent.identity import STATE_FILE, AgentState, default_home, load_or_create_key


def _labels(pairs: list[str]) -> dict:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--label takes key=value, got {pair!r}")
        labels[key] = value
    return labels


def cmd_enroll(args) -> int:
    from edge_agent.enroll import EnrollmentError, enroll

    try:
        state = enroll(
            home=args.home,
            server=args.server,
            token=args.token,
            name=args.name or socket.gethostname(),
            labels=_labels(args.label),
            force=args.force,
        )
    except EnrollmentError as error:
        print(f"enrollment failed: {error}", file=sys.stderr)
        return 1
    print(f"enrolled as {state.device_id} in cohort {state.cohort} (status: {state.status})")
    if state.status == "pending":
        print("an operator must approve this device before it can sync; `edge-agent run` waits for that")
    print(f"pinned server key {state.server_public_key}; identity stored in {args.home}")
    return 0


def cmd_run(args) -> int:
    from edge_agent.connection import AgentConnection, Backoff, Retired

    try:
        state = AgentState.load(args.home)
        key = load_or_create_key(args.home)
    except (FileNotFoundError, PermissionError, ValueError) as error:
        print(error, file=sys.stderr)
        return 1

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        from edge_agent.assignments import AssignmentHandler
        from edge_agent.rest import DeviceSession

        session = DeviceSession(server=state.server, device_id=state.device_id, key=key)
        connection = AgentConnection(
            home=args.home,
            state=state,
            key=key,
            backoff=Backoff(cap=args.max_backoff),
            on_command=AssignmentHandler(home=args.home, state=state, session=session),
        )
        try:
            await connection.run(stop)
        except Retired as retired:
            print(f"this device is retired: {retired}", file=sys.stderr)
            return 3
        return 0

    return asyncio.run(main())


def cmd_status(args) -> int:
    path = args.home / STATE_FILE
    if not path.exists():
        print(f"not enrolled (no {path})")
        return 1
    state = json.loads(path.read_text())
    status_path = args.home / "status.json"
    connection = json.loads(status_path.read_text()) if status_path.exists() else {}
    if connection.get("updated_at"):
        connection["updated_seconds_ago"] = round(time.time() - connection.pop("updated_at"), 1)
    print(json.dumps({"identity": state, "connection": connection}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-agent", description="Fleet personalization edge agent.")
    parser.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    parser.add_argument("--home", type=Path, default=default_home(), help="identity and state folder")
    parser.add_argument("-v", "--verbose", action="store_true")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    enroll = commands.add_parser("enroll", help="join a fleet with an enrollment token")
    enroll.add_argument("--server", required=True, help="e.g. https://fleet.example.com")
    enroll.add_argument("--token", required=True)
    enroll.add_argument("--name", help="defaults to the host name")
    enroll.add_argument("--label", action="append", default=[], help="key=value, repeatable")
    enroll.add_argument("--force", action="store_true", help="enroll again with the same key")
    enroll.set_defaults(handler=cmd_enroll)

    run = commands.add_parser("run", help="stay connected to the server")
    run.add_argument("--max-backoff", type=float, default=60.0, help="longest wait between reconnects (s)")
    run.set_defaults(handler=cmd_run)

    status = commands.add_parser("status", help="show identity and connection state")
    status.set_defaults(handler=cmd_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s [agent] %(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
