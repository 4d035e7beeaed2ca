"""``edge-agent``: the command devices run.

edge-agent enroll --server URL --token T [--name NAME] [--label key=value ...]
edge-agent run          # stay connected, train when the policy allows, upload deltas, apply assignments
edge-agent train-once   # one training pass now (--force ignores the policy)
edge-agent status       # identity, versions, outbox, samples (new, and how many more a pass waits for),
                        # unlabeled samples, feedback counts, last training, connection
edge-agent export DIR   # the installed adapter as a PEFT directory (--personal: the device's own model)
edge-agent configure    # local settings: data source, power source, policy, training
edge-agent add-samples PATH ...   # samples from files (npz, JSON lines, CSV, image folders), labelled or not
edge-agent predict [FILE]         # the served model's predictions for samples in FILE (or JSON lines on stdin)
edge-agent ask K                  # the K unlabeled samples whose labels would help most, as answers to label
edge-agent feedback ID LABEL      # a user confirms or corrects an answer of predict or ask: a labelled sample
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from edge_agent import __version__
from edge_agent.api import Agent, NotReady, samples_status
from edge_agent.assignments import AdapterStore, AssignmentHandler
from edge_agent.cli_samples import cmd_add_samples, cmd_ask, cmd_feedback, cmd_predict
from edge_agent.connection import AgentConnection, Backoff, Retired
from edge_agent.enroll import EnrollmentError, enroll
from edge_agent.families import get_family, loads_file
from edge_agent.families.exported import adapter_card
from edge_agent.feedback import Answers
from edge_agent.identity import STATE_FILE, AgentState, default_home, load_or_create_key
from edge_agent.inbox import Inbox
from edge_agent.lora import peft_config
from edge_agent.packaging import Outbox
from edge_agent.personal import PersonalSettings, PersonalStore, derive
from edge_agent.rest import DeviceSession
from edge_agent.runtime import LAST_TRAINING_FILE, AgentConfig, DeviceRuntime
from edge_agent.samples import SampleStore
from edge_agent.training import Interrupted
from edge_agent.unlabeled import MAX_UNLABELED, UnlabeledStore
from edge_agent.uploads import OutboxUploads


def _labels(pairs: list[str]) -> dict:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--label takes key=value, got {pair!r}")
        labels[key] = value
    return labels


def cmd_enroll(args) -> int:
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


def take_inbox(inbox: Inbox, agent: Agent) -> list[dict]:
    """What ``run`` does with the inbox before each training check: take every file (``Inbox.take``): a feedback
    file's feedback, any other file's samples (``Agent.take_file``), once the first version has told the agent what
    a sample is; until then files wait."""
    if not (inbox.waiting() or inbox.interrupted()):
        return []
    try:
        agent.schema()
    except NotReady:
        return []
    return inbox.take(agent.take_file)


def inbox_for(home: Path, config) -> Inbox:
    """The inbox, its ``rejected/`` bounded as the settings say."""
    return Inbox(home, keep_files=config.rejected_keep_files, keep_bytes=int(config.rejected_keep_mib * 2**20))


# How long `run` waits, after SIGTERM or Ctrl-C, for what it is doing to end on its own (a training pass ends at its
# next optimizer step, checkpointed; the socket closes within a second) before it exits regardless. What is still
# running then (an assignment's download, a large inbox file) is cut short as by a power cut, which the agent is
# built for: it is taken up again at the next start.
STOP_GRACE_SECONDS = 1.5


def _exit(code: int) -> None:
    """End the process now, its output flushed. The interpreter's own teardown (torch's modules) takes another
    second and has nothing left to do: every file the agent keeps is written atomically as it goes."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_now(log: logging.Logger) -> None:
    log.info("still busy %.1fs after the stop: exiting now; what was cut short is taken up at the next start",
             STOP_GRACE_SECONDS)  # fmt: skip
    _exit(0)


def cmd_run(args) -> int:
    """Stay connected and train until SIGTERM or Ctrl-C: then say so, end the current step (a training pass
    checkpoints and stops before its next optimizer step), close the socket and exit the process within
    STOP_GRACE_SECONDS or so."""

    try:
        state, key = _load(args)
        runtime = DeviceRuntime(home=args.home, state=state, key=key)
    except (FileNotFoundError, PermissionError, ValueError) as error:
        print(error, file=sys.stderr)
        return 1

    agent, inbox = Agent(args.home), inbox_for(args.home, runtime.config)
    logging.getLogger("edge_agent").info("inbox: files dropped in %s are taken before each pass", inbox.make())

    async def train_forever(stop: asyncio.Event) -> None:
        interval = float(runtime.config.train_interval_seconds)
        while not stop.is_set():
            try:  # (each file's trouble stays with it; this is for the inbox folder itself, unreadable say)
                await asyncio.to_thread(take_inbox, inbox, agent)
            except Exception:
                logging.getLogger("edge_agent").exception("taking the inbox failed")
            try:
                outcome = await asyncio.to_thread(runtime.train_once)
                logging.getLogger("edge_agent").info("training: %s (%s)", outcome["status"], outcome.get("reason"))
            except Interrupted as interrupted:  # the agent is stopping
                logging.getLogger("edge_agent").info(
                    "training stopped (%s): it resumes from its checkpoint at the next start", interrupted
                )
            except Exception:  # a failed pass is logged and retried at the next interval, never fatal
                logging.getLogger("edge_agent").exception("training pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval)

    log = logging.getLogger("edge_agent")

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def stopping(signum: int) -> None:
            if stop.is_set():
                return
            log.info("stopping (%s): ending the current step", signal.Signals(signum).name)
            stop.set()
            runtime.stopping.set()  # a training pass checkpoints and ends before its next step
            deadline = threading.Timer(STOP_GRACE_SECONDS, _exit_now, args=(log,))
            deadline.daemon = True  # gone with the process when it exits in time
            deadline.start()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stopping, signum)

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
            runtime.stopping.set()
            if trainer is not None:
                await trainer
        return 0

    code = asyncio.run(main())
    log.info("stopped")
    _exit(code)  # (the process ends here: `run` is the agent's process, never a step inside another program)
    return code


def cmd_train_once(args) -> int:
    try:
        state, key = _load(args)
        outcome = DeviceRuntime(home=args.home, state=state, key=key).train_once(force=args.force)
    except (FileNotFoundError, PermissionError, ValueError) as error:
        print(error, file=sys.stderr)
        return 1
    print(json.dumps(outcome, indent=2))
    return 0 if outcome["status"] in ("trained", "skipped", "discarded", "personalized") else 1


def cmd_export(args) -> int:
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
    family = get_family(training["family"])
    if loads_file(family) and not getattr(family, "exports_peft", False):  # an exported program: no PEFT class fits
        base_sha = AdapterStore(args.home).state().get("base_model_sha256")
        card = adapter_card(training, tensors, base_sha)
        (args.directory / "adapter_card.json").write_text(json.dumps(card, indent=2))
        print(f"exported {what} to {args.directory} (adapter_card.json says how to apply it)")
        return 0
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


def cmd_configure(args) -> int:
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
    if args.rejected_keep_files is not None:
        config.rejected_keep_files = args.rejected_keep_files
    if args.rejected_keep_mib is not None:
        config.rejected_keep_mib = args.rejected_keep_mib
    if args.answers_keep is not None:
        if args.answers_keep < 0:
            raise SystemExit("--answers-keep takes a count, 0 or more (0: no answer is kept, feedback is refused)")
        config.answers_keep = args.answers_keep
    if args.answers_keep_days is not None:
        if not args.answers_keep_days > 0:
            raise SystemExit("--answers-keep-days takes a number of days above 0")
        config.answers_keep_days = args.answers_keep_days
    if args.unlabeled_keep is not None:
        if not 0 <= args.unlabeled_keep <= MAX_UNLABELED:
            raise SystemExit(
                f"--unlabeled-keep takes a count from 0 to {MAX_UNLABELED:,} (0: unlabeled samples are refused)"
            )
        config.unlabeled_keep = args.unlabeled_keep
        dropped = UnlabeledStore.of(args.home, config).trim()
        if dropped:
            print(f"dropped the oldest {dropped} unlabeled samples to keep {config.unlabeled_keep}", file=sys.stderr)
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
        "samples": samples_status(args.home, SampleStore(args.home / "samples")),
        "last_training": last,
        "personal": {k: v for k, v in PersonalStore(args.home).state().items() if k not in ("file", "saved")},
        "unlabeled": UnlabeledStore.of(args.home, config).status(),
        "feedback": Answers.of(args.home, config).status(),
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

    ask = commands.add_parser(
        "ask", help="the unlabeled samples whose labels would help most, one JSON line each, to label by feedback"
    )
    ask.add_argument("count", type=int, help="how many questions (at most answers_keep)")
    ask.set_defaults(handler=cmd_ask)

    feedback = commands.add_parser(
        "feedback",
        help="confirm or correct an answer of predict or ask by its id: the answer becomes a labelled sample",
    )
    feedback.add_argument(
        "id", help="the answer's id, as predict printed it (an older agent's id may start with '-': put -- before it)"
    )
    feedback.add_argument("label", help="the right label: the predicted one confirms the answer, another corrects it")
    feedback.set_defaults(handler=cmd_feedback)

    configure = commands.add_parser("configure", help="local settings (stored in <home>/settings.json)")
    configure.add_argument("--data", choices=["app"], help="app: samples only from the device's application")
    configure.add_argument("--simulate-device", metavar="INDEX/TOTAL", help="demo data: this device's shard")
    configure.add_argument("--alpha", type=float, help="Dirichlet alpha of the simulated shards")
    configure.add_argument("--power", choices=["sysfs", "simulated"])
    configure.add_argument("--min-new-samples", type=int)
    configure.add_argument("--encoding", choices=["f32", "f16", "int8"])
    configure.add_argument("--train-interval", type=float, help="seconds between training checks")
    configure.add_argument("--rejected-keep-files", type=int, help="refused inbox files kept in inbox/rejected/")
    configure.add_argument("--rejected-keep-mib", type=float, help="MiB of refused inbox files kept there")
    configure.add_argument("--answers-keep", type=int, help="recent answers whose inputs are kept for feedback")
    configure.add_argument("--answers-keep-days", type=float, help="days an answer's input is kept for feedback")
    configure.add_argument("--unlabeled-keep", type=int, help="unlabeled samples kept, the oldest dropped first")
    configure.set_defaults(handler=cmd_configure)

    status = commands.add_parser(
        "status",
        help="identity, versions, samples (and how many more new ones training waits for), unlabeled samples, "
        "feedback, connection",
    )
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
