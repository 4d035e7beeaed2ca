"""One command for the whole product: services, migrations, demo login, web + worker + beat, supervised.

    python -m fleet.launcher run [--port 8000]     # what `make run` does
    python -m fleet.launcher exec -- CMD ...       # run CMD with the services up (what `make test` does)

Without DATABASE_URL / REDIS_URL it starts embedded PostgreSQL and Redis in FLEET_DATA_DIR (default
./.data); with them it uses those servers. Ctrl-C (or SIGTERM, SIGHUP) stops the processes, the demo fleet first
(its agents talk to the web server), then the services; so does its parent going away when that parent is make
or ``--watch-parent`` asks for it (``fleet.parent_watch``: make stopped by a signal sent to make alone, or killed).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from fleet.devstack import Services, start_services
from fleet.parent_watch import ParentWatch
from fleet.serve import uvicorn_command

BASE_DIR = Path(__file__).resolve().parent.parent
logger = logging.getLogger("fleet.launcher")


def _say(message: str) -> None:
    print(f"[fleet] {message}", flush=True)


def _data_dir() -> Path:
    return Path(os.environ.get("FLEET_DATA_DIR") or BASE_DIR / ".data").resolve()


def _development_secret(data_dir: Path) -> str:
    """A per-installation secret kept in the data folder, so sessions survive restarts; never in the repo."""
    path = data_dir / "secret_key"
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(50))
    return path.read_text().strip()


def _child_env(services: Services, data_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["DATABASE_URL"] = services.database_url
    env["REDIS_URL"] = services.redis_url
    env["FLEET_DATA_DIR"] = str(data_dir)
    env.setdefault("DJANGO_SETTINGS_MODULE", "fleet.settings")
    if not env.get("SECRET_KEY") and not env.get("SECRET_KEY_FILE"):
        env["SECRET_KEY"] = _development_secret(data_dir)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Supervisor:
    """Runs named child processes, prefixes their output, and stops all of them together.

    A child that dies after it ran for a while (a Celery worker killed by the OOM killer, or exiting on an
    error it cannot recover from, as Celery 5.7's does when its Redis connection drops) is started again, as
    compose's ``restart: unless-stopped`` does: what is left of its process group is killed first (uvicorn's
    or Celery's orphaned children would keep the port or run tasks). A child that dies within
    ``min_uptime`` of its start could not start at all, and one that dies ``max_restarts`` times within
    ``restart_window`` keeps failing: then everything stops, as before."""

    min_uptime = 10.0
    max_restarts = 5
    restart_window = 300.0

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.children: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}
        self.started_at: dict[str, float] = {}
        self.restarts: dict[str, list[float]] = {}
        self.stopping = threading.Event()

    def start(self, name: str, argv: list[str]) -> None:
        process = subprocess.Popen(
            argv,
            cwd=BASE_DIR,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # signals come from us, in order, not from the terminal
        )
        self.children[name] = process
        self.argv[name] = argv
        self.started_at[name] = time.monotonic()
        threading.Thread(target=self._pump, args=(name, process), daemon=True).start()

    def _pump(self, name: str, process: subprocess.Popen) -> None:
        for line in process.stdout:
            sys.stdout.write(f"{name:>6} | {line}")
        sys.stdout.flush()

    def wait(self) -> int:
        """Block until we are asked to stop, or a child dies and cannot be started again; returns the exit
        code for the launcher."""
        while not self.stopping.is_set():
            for name, process in list(self.children.items()):
                code = process.poll()
                if code is not None and not self.stopping.is_set() and not self._restart(name, code):
                    return code or 1
            self.stopping.wait(0.5)
        return 0

    def _restart(self, name: str, code: int) -> bool:
        now = time.monotonic()
        uptime = now - self.started_at[name]
        recent = [at for at in self.restarts.get(name, []) if now - at < self.restart_window]
        if uptime < self.min_uptime or len(recent) >= self.max_restarts:
            why = "at start" if uptime < self.min_uptime else f"{len(recent) + 1} times in {self.restart_window:.0f}s"
            _say(f"{name} exited with code {code} ({why}); stopping everything")
            return False
        _say(f"{name} exited with code {code} after {uptime:.0f}s; starting it again")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.children[name].pid, signal.SIGKILL)  # its leftovers: the group is the child's own
        self.restarts[name] = [*recent, now]
        self.start(name, self.argv[name])
        return True

    def stop(self, timeout: float = 20.0, *, first: tuple[str, ...] = ()) -> None:
        """SIGTERM every child and wait for it, ``timeout`` at most (then SIGKILL). The children named in ``first``
        are stopped before the others: the demo fleet, whose agents would otherwise find the web server gone and
        retry against it while they stop."""
        early = [name for name in first if name in self.children]
        if early:
            self._stop_group(early, timeout)
        self._stop_group([name for name in self.children if name not in early], timeout)

    def _stop_group(self, names: list[str], timeout: float) -> None:
        for name in names:
            if self.children[name].poll() is None:
                self.children[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name in names:
            process = self.children[name]
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _say(f"{name} did not stop in {timeout:.0f}s; killing it")
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _wait_ready(url: str, timeout: float, stopping: threading.Event) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopping.is_set():
        try:
            with urllib.request.urlopen(url, timeout=3) as response:  # noqa: S310  (our own http URL)
                if response.status == 200:
                    return True
        except OSError:
            pass
        stopping.wait(0.5)
    return False


def _manage(env: dict[str, str], *args: str) -> str:
    result = subprocess.run([sys.executable, "manage.py", *args], cwd=BASE_DIR, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.stderr.write(result.stdout + result.stderr)
        raise SystemExit(f"[fleet] manage.py {' '.join(args)} failed (exit {result.returncode})")
    return result.stdout


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _install_signal_handlers(on_stop) -> None:
    def handler(signum, frame):
        on_stop()

    for number in STOP_SIGNALS:
        signal.signal(number, handler)


def _watch_parent(always: bool) -> ParentWatch:
    """Until the supervisor takes over, every stop signal is a Ctrl-C (KeyboardInterrupt: the ``finally``
    blocks stop what was started so far); the parent going away sends us SIGTERM, which is one. The parent is
    watched when it is make, or ``always`` (``--watch-parent``)."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.default_int_handler)

    def gone(reason: str) -> None:
        _say(f"{reason}; stopping everything")
        os.kill(os.getpid(), signal.SIGTERM)

    return ParentWatch(gone, always=always).start()


def _venv_python() -> str:
    """This interpreter as a person would type it from the checkout (``.venv/bin/python``)."""
    try:
        return str(Path(sys.executable).relative_to(BASE_DIR))
    except ValueError:
        return sys.executable


def _sign_in_hint(env: dict[str, str], demo: bool) -> str:
    """Who can sign in, as far as this run knows: the demo account (made or refreshed with the demo), an earlier
    demo's account still there without it, else how to make an operator."""
    if demo:
        username, password = _manage(env, "ensure_demo_operator").split()[-2:]
        return f"sign in as {username} / {password}"
    existing = _manage(env, "ensure_demo_operator", "--existing").split()
    if existing:
        return f"sign in as {existing[-2]} / {existing[-1]} (the demo account of an earlier run)"
    python = _venv_python()
    return (
        "sign in with an operator account; to create one (with an API token): "
        f"{python} -m fleet.launcher exec -- {python} manage.py create_operator NAME --role admin --api-token"
    )


def _raise_open_file_limit() -> None:
    """Every agent socket is a file descriptor; the usual soft limit of 1,024 caps the fleet far too low."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (min(hard, 1_048_576) if hard != resource.RLIM_INFINITY else 1_048_576, hard)
        )


def run(args: argparse.Namespace) -> int:
    _raise_open_file_limit()
    watch = _watch_parent(args.watch_parent)
    data_dir = _data_dir()
    started = time.monotonic()
    _say(f"data folder: {data_dir}")
    services = start_services(data_dir)
    for name, variable in (("postgres", "DATABASE_URL"), ("redis", "REDIS_URL")):
        origin = "embedded, in the data folder" if name in services.embedded else f"from {variable}"
        _say(f"{name}: {origin}")
    supervisor: Supervisor | None = None
    try:
        env = _child_env(services, data_dir)
        metrics_dir = data_dir / "prometheus"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True)
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        # Large rounds are cut into one shard of deltas per worker process: as many as this run starts.
        env.setdefault("AGGREGATION_WORKERS", str(args.worker_concurrency))

        _say("applying migrations")
        _manage(env, "migrate", "--noinput")
        if args.reset:
            _say("--reset: deleting every row in the database and the demo devices' state")
            _manage(env, "flush", "--noinput")
            shutil.rmtree(data_dir / "demo", ignore_errors=True)
        sign_in = _sign_in_hint(env, args.demo)
        if args.demo and args.devices == 0:
            _say("--devices 0: seeding the demo setup; no simulated devices")
            sys.stdout.write(_manage(env, "demo_fleet", "--devices", "0"))

        supervisor = Supervisor(env)
        _install_signal_handlers(supervisor.stopping.set)
        python = sys.executable
        supervisor.start(
            "web",
            uvicorn_command(host=args.host, port=args.port, workers=args.web_workers, graceful_shutdown=10),
        )
        supervisor.start(
            "worker",
            [
                python,
                "-m",
                "celery",
                "-A",
                "fleet",
                "worker",
                "--loglevel",
                "INFO",
                "--concurrency",
                str(args.worker_concurrency),
                "--hostname",
                "worker@%h",
                # Mingle and gossip sync worker state we do not use; skipping them saves a second at start.
                "--without-mingle",
                "--without-gossip",
            ],
        )
        supervisor.start(
            "beat",
            [
                python,
                "-m",
                "celery",
                "-A",
                "fleet",
                "beat",
                "--loglevel",
                "INFO",
                "--schedule",
                str(data_dir / "celerybeat-schedule"),
            ],
        )
        local_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host  # noqa: S104
        base = f"http://{local_host}:{args.port}"
        if _wait_ready(f"{base}/readyz", timeout=args.ready_timeout, stopping=supervisor.stopping):
            _say(f"ready in {time.monotonic() - started:.1f}s")
            _say(f"dashboard:  {base}/   {sign_in}")
            _say(f"API docs:   {base}/api/docs/")
            _say(f"readiness:  {base}/readyz")
            if args.demo and args.devices == 0:
                _say(
                    "demo setup: cohorts eu-phones and us-wearables, digits-lora v1 rolled out; no simulated devices "
                    f"(--devices 0): enroll your own with a token from {base}/enrollment-tokens/ or "
                    "POST /api/v1/enrollment-tokens/"
                )
            elif args.demo:
                supervisor.start(
                    "demo",
                    [python, "manage.py", "demo_fleet", "--server", base, "--devices", str(args.devices)],
                )
                _say(
                    f"demo fleet: {args.devices} simulated devices enroll, train and upload; within a few minutes "
                    f"rounds complete and accuracy rises: {base}/ (overview), {base}/api/v1/rounds/, "
                    f"{base}/api/v1/adapter-versions/ (eval_accuracy per version)"
                )
            _say("press Ctrl-C to stop")
        elif not supervisor.stopping.is_set():
            _say(f"not ready after {args.ready_timeout:.0f}s; see {base}/readyz and the output above")
        return supervisor.wait()
    finally:
        _say("stopping")
        if supervisor is not None:
            supervisor.stop(first=("demo",))  # the fleet's agents before the server they talk to
        services.stop()
        watch.stop()
        _say("stopped")


def exec_command(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("usage: python -m fleet.launcher exec -- COMMAND [ARGS...]")
    watch = _watch_parent(args.watch_parent)
    data_dir = _data_dir()
    services = start_services(data_dir)
    try:
        env = _child_env(services, data_dir)
        process = subprocess.Popen(command, env=env, cwd=BASE_DIR)
        signal.signal(signal.SIGTERM, lambda *_: process.terminate())
        signal.signal(signal.SIGHUP, lambda *_: process.terminate())
        while True:
            try:
                return process.wait()
            except KeyboardInterrupt:
                continue  # the child got the same Ctrl-C; wait for it to finish
    finally:
        services.stop()
        watch.stop()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="[fleet] %(message)s")
    parser = argparse.ArgumentParser(prog="python -m fleet.launcher")
    commands = parser.add_subparsers(dest="action", required=True)
    cpus = os.cpu_count() or 1

    watch_help = (
        "stop when the process that started the launcher exits, whatever it is (default: only when it is make; "
        "FLEET_WATCH_PARENT=1 alike)"
    )
    watch_default = os.environ.get("FLEET_WATCH_PARENT", "").strip().lower() in ("1", "true", "yes", "on")

    run_parser = commands.add_parser("run", help="run the whole product")
    run_parser.add_argument(
        "--host", default=os.environ.get("FLEET_HOST", "127.0.0.1"), help="address to serve on (FLEET_HOST)"
    )
    run_parser.add_argument(
        "--port", type=int, default=int(os.environ.get("FLEET_PORT", "8000")), help="port to serve on (FLEET_PORT)"
    )
    run_parser.add_argument("--web-workers", type=int, default=int(os.environ.get("WEB_CONCURRENCY", min(cpus, 2))))
    run_parser.add_argument(
        "--worker-concurrency", type=int, default=int(os.environ.get("WORKER_CONCURRENCY", min(cpus, 2)))
    )
    run_parser.add_argument("--ready-timeout", type=float, default=120.0)
    run_parser.add_argument(
        "--devices",
        type=int,
        default=int(os.environ.get("FLEET_DEMO_DEVICES", "12")),
        help="simulated demo devices (FLEET_DEMO_DEVICES, default 12; at least 3); 0: seed the demo setup "
        "(cohorts, base model, adapter, version 1 rolled out) and start no simulated devices",
    )
    run_parser.add_argument("--no-demo", dest="demo", action="store_false", help="no demo setup and no fleet")
    run_parser.add_argument(
        "--reset", action="store_true", help="start from an empty database (deletes all rows) and a new demo fleet"
    )
    run_parser.add_argument("--watch-parent", action="store_true", default=watch_default, help=watch_help)

    exec_parser = commands.add_parser("exec", help="run a command with DATABASE_URL and REDIS_URL provided")
    exec_parser.add_argument("--watch-parent", action="store_true", default=watch_default, help=watch_help)
    exec_parser.add_argument("command", nargs=argparse.REMAINDER)

    args = parser.parse_args(argv)
    if args.action == "run" and args.demo and (args.devices < 0 or 0 < args.devices < 3):
        parser.error(
            f"--devices {args.devices}: the demo fleet needs at least 3 devices; "
            "--devices 0 seeds the demo setup without any"
        )
    return run(args) if args.action == "run" else exec_command(args)


if __name__ == "__main__":
    sys.exit(main())
