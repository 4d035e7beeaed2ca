"""``edge-agent``: the command devices run.

edge-agent enroll --server URL --token T [--name NAME] [--label key=value ...]
edge-agent run          # stay connected, train when the policy allows, upload deltas, apply assignments
edge-agent train-once   # one training pass now (--force ignores the policy)
edge-agent status       # identity, versions, outbox, last training, connection
edge-agent export DIR   # the installed adapter as a PEFT directory (--personal: the device's own model)
edge-agent configure    # local settings: data source, power source, policy, training
edge-agent add-samples PATH ...   # samples from files (npz, JSON lines, CSV, image folders)
edge-agent predict [FILE]         # the served model's predictions for samples in FILE (or JSON lines on stdin)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
import time
from pathlib import Path

from edge_agent import __version__
from edge_agent.api import Agent, NotReady
from edge_agent.identity import STATE_FILE, AgentState, default_home, load_or_create_key
from edge_agent.inbox import Inbox
from edge_agent.sample_files import SampleError


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


def _load(args):
    state = AgentState.load(args.home)
    key = load_or_create_key(args.home)
    return state, key


def cmd_run(args) -> int:
    from edge_agent.connection import AgentConnection, Backoff, Retired
    from edge_agent.runtime import DeviceRuntime
    from edge_agent.uploads import OutboxUploads

    try:
        state, key = _load(args)
        runtime = DeviceRuntime(home=args.home, state=state, key=key)
    except (FileNotFoundError, PermissionError, ValueError) as error:
        print(error, file=sys.stderr)
        return 1

    agent, inbox = Agent(args.home), Inbox(args.home)
    logging.getLogger("edge_agent").info("inbox: files dropped in %s are taken before each pass", inbox.make())

    def take_inbox() -> None:
        if not (inbox.waiting() or any(inbox.taking.glob("*"))):
            return
        try:
            agent.schema()
        except NotReady:  # files wait until the first version tells the agent what samples look like
            return
        inbox.take(agent.add_file)

    async def train_forever(stop: asyncio.Event) -> None:
        interval = float(runtime.config.train_interval_seconds)
        while not stop.is_set():
            try:
                await asyncio.to_thread(take_inbox)
                outcome = await asyncio.to_thread(runtime.train_once)
                logging.getLogger("edge_agent").info("training: %s (%s)", outcome["status"], outcome.get("reason"))
            except Exception:  # a failed pass is logged and retried at the next interval, never fatal
                logging.getLogger("edge_agent").exception("training pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval)

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
            heartbeat=runtime.heartbeat,
            backoff=Backoff(cap=args.max_backoff),
            on_command=AssignmentHandler(
                home=args.home, state=state, session=session, evaluate=runtime.evaluate_versions
            ),
            uploads=OutboxUploads(runtime.outbox),
        )
        trainer = asyncio.create_task(train_forever(stop)) if not args.no_training else None
        try:
            await connection.run(stop)
        except Retired as retired:
            print(f"this device is retired: {retired}", file=sys.stderr)
            return 3
        finally:
            stop.set()
            if trainer is not None:
                await trainer
        return 0

    return asyncio.run(main())


def cmd_train_once(args) -> int:
    from edge_agent.runtime import DeviceRuntime

    try:
        state, key = _load(args)
        outcome = DeviceRuntime(home=args.home, state=state, key=key).train_once(force=args.force)
    except (FileNotFoundError, PermissionError, ValueError) as error:
        print(error, file=sys.stderr)
        return 1
    print(json.dumps(outcome, indent=2))
    return 0 if outcome["status"] in ("trained", "skipped", "discarded", "personalized") else 1


def cmd_export(args) -> int:
    from safetensors.torch import load_file, save_file

    from edge_agent.assignments import AdapterStore
    from edge_agent.lora import peft_config
    from edge_agent.personal import PersonalSettings, PersonalStore, derive

    current = AdapterStore(args.home).state().get("current")
    if not current or not current.get("training"):
        print("no adapter installed yet", file=sys.stderr)
        return 1
    training = current["training"]
    tensors, what = load_file(current["path"]), f"{current['adapter']} v{current['version']}"
    if args.personal:
        store = PersonalStore(args.home)
        state, tensors = store.state(), store.tensors()
        if tensors is None or state.get("adapter") != current["adapter"]:
            print(
                "no personal model yet: it is made by the first training pass (edge-agent train-once)", file=sys.stderr
            )
            return 1
        if state.get("method") == "private_modules":  # the device's modules on the installed body, as served
            tensors = derive(load_file(current["path"]), tensors, PersonalSettings.from_training(training))
        what = f"the personal model ({state.get('method')}) on {what}"
    args.directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.directory / "adapter_model.safetensors"))
    config = peft_config(
        rank=training["rank"],
        alpha=training["alpha"],
        dropout=training.get("dropout", 0.0),
        target_modules=training["target_modules"],
        modules_to_save=training.get("modules_to_save", []),
    )
    (args.directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    print(f"exported {what} to {args.directory}")
    return 0


def cmd_add_samples(args) -> int:
    agent, failed = Agent(args.home), 0
    for path in args.paths:
        try:
            added = agent.add_file(path)
        except NotReady as error:
            print(error, file=sys.stderr)
            return 1
        except (SampleError, OSError) as error:
            print(f"{path}: refused, nothing stored: {error}", file=sys.stderr)
            failed += 1
            continue
        print(f"{path}: {added} samples stored")
    return 1 if failed else 0


def cmd_predict(args) -> int:
    agent = Agent(args.home)
    try:
        if args.file and args.file != "-":
            answer = agent.predict(Path(args.file))
        else:
            records = [json.loads(line) for line in sys.stdin if line.strip()]
            if not records:
                raise SampleError("no samples on standard input (one JSON object a line)")
            answer = agent.predict({name: [r.get(name) for r in records] for name in records[0]})
    except (NotReady, SampleError, OSError) as error:
        print(f"cannot predict: {error}", file=sys.stderr)
        return 1
    except json.JSONDecodeError as error:
        print(f"cannot predict: standard input is not JSON lines ({error})", file=sys.stderr)
        return 1
    about = {k: answer[k] for k in ("serving", "adapter", "version", "method")}
    for label, probabilities in zip(answer["labels"], answer["probabilities"], strict=True):
        print(json.dumps({"label": label, "probabilities": probabilities, **about}))
    return 0


def cmd_configure(args) -> int:
    from edge_agent.runtime import AgentConfig

    config = AgentConfig.load(args.home)
    if args.data == "app":
        config.data = {"kind": "app"}  # samples only from the application: the inbox, add-samples, the Python API
    if args.simulate_device:
        index, _, total = args.simulate_device.partition("/")
        config.data = {"kind": "simulated", "device_index": int(index), "num_devices": int(total or 10)}
        if args.alpha is not None:
            config.data["alpha"] = args.alpha
    if args.power:
        config.power = {"kind": args.power}
    if args.min_new_samples is not None:
        config.policy["min_new_samples"] = args.min_new_samples
    if args.encoding:
        config.encoding = args.encoding
    if args.train_interval is not None:
        config.train_interval_seconds = args.train_interval
    config.save(args.home)
    print(json.dumps(config.__dict__, indent=2))
    if config.data.get("kind") == "app":
        print(f"samples come from the application: drop sample files in {Inbox(args.home).make()}", file=sys.stderr)
    return 0


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
    from edge_agent.assignments import AdapterStore
    from edge_agent.packaging import Outbox
    from edge_agent.personal import PersonalStore
    from edge_agent.runtime import LAST_TRAINING_FILE, AgentConfig

    adapters = AdapterStore(args.home).state()
    outbox: dict[str, int] = {}
    for item in Outbox(args.home).items():
        outbox[item.state] = outbox.get(item.state, 0) + 1
    last_path = args.home / LAST_TRAINING_FILE
    last = json.loads(last_path.read_text()) if last_path.exists() else None
    config = AgentConfig.load(args.home)
    report = {
        "identity": state,
        "connection": connection,
        "versions": {"current": adapters.get("current"), "previous": adapters.get("previous")},
        "outbox": outbox,
        "last_training": last,
        "personal": {k: v for k, v in PersonalStore(args.home).state().items() if k not in ("file", "saved")},
        "next_training_check_in_seconds": (
            max(0.0, round(last["at"] + config.train_interval_seconds - time.time(), 1)) if last else 0.0
        ),
    }
    print(json.dumps(report, indent=2, default=str))
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
    run.add_argument("--no-training", action="store_true", help="only stay connected (no local training)")
    run.set_defaults(handler=cmd_run)

    train = commands.add_parser("train-once", help="one training pass now")
    train.add_argument("--force", action="store_true", help="ignore the sample, power and time policy")
    train.set_defaults(handler=cmd_train_once)

    export = commands.add_parser("export", help="write the installed adapter as a PEFT directory")
    export.add_argument("directory", type=Path)
    export.add_argument("--personal", action="store_true", help="the device's own model, not the shared version")
    export.set_defaults(handler=cmd_export)

    add = commands.add_parser("add-samples", help="store samples from files: npz, JSON lines, CSV, image folders")
    add.add_argument("paths", nargs="+", type=Path)
    add.set_defaults(handler=cmd_add_samples)

    predict = commands.add_parser("predict", help="the served model's predictions, one JSON line a sample")
    predict.add_argument("file", nargs="?", help="a sample file without labels; '-' or none: JSON lines on stdin")
    predict.set_defaults(handler=cmd_predict)

    configure = commands.add_parser("configure", help="local settings (stored in <home>/settings.json)")
    configure.add_argument("--data", choices=["app"], help="app: samples only from the device's application")
    configure.add_argument("--simulate-device", metavar="INDEX/TOTAL", help="demo data: this device's shard")
    configure.add_argument("--alpha", type=float, help="Dirichlet alpha of the simulated shards")
    configure.add_argument("--power", choices=["sysfs", "simulated"])
    configure.add_argument("--min-new-samples", type=int)
    configure.add_argument("--encoding", choices=["f32", "f16", "int8"])
    configure.add_argument("--train-interval", type=float, help="seconds between training checks")
    configure.set_defaults(handler=cmd_configure)

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
