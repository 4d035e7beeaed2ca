"""``manage.py demo_fleet``: seed the demo (once) and run a simulated fleet of real agents (demo.fleet_demo)."""

import asyncio
import signal
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Seed the demo setup and run N simulated devices with the real agent code until stopped."

    def add_arguments(self, parser):
        parser.add_argument("--server", required=True, help="the product's URL, e.g. http://127.0.0.1:8000")
        parser.add_argument("--devices", type=int, default=12)
        parser.add_argument("--home", type=Path, default=None, help="agent homes (default: DATA_DIR/demo)")

    def handle(self, *args, server, devices, home, **options):
        from demo.fleet_demo import plan, run_fleet, seed

        if devices < 3:
            raise SystemExit("the demo needs at least 3 devices")
        tokens = seed(devices=devices)
        root = home or Path(settings.DATA_DIR) / "demo"
        fleet = plan(devices, root)

        async def main():
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, stop.set)
            await run_fleet(server=server, devices=fleet, tokens=tokens, stop=stop)

        asyncio.run(main())
