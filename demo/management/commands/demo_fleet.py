"""``manage.py demo_fleet``: seed the demo (once) and run a simulated fleet of real agents (demo.fleet_demo)."""

import asyncio
import signal
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = (
        "Seed the demo setup and run N simulated devices with the real agent code until stopped; with --devices 0, "
        "only seed the setup (cohorts, base model, adapter, version 1 rolled out) and exit."
    )

    def add_arguments(self, parser):
        parser.add_argument("--server", help="the product's URL, e.g. http://127.0.0.1:8000 (needed with devices)")
        parser.add_argument("--devices", type=int, default=12, help="at least 3; 0: the setup alone")
        parser.add_argument("--home", type=Path, default=None, help="agent homes (default: DATA_DIR/demo)")

    def handle(self, *args, server, devices, home, **options):
        from demo.fleet_demo import plan, reset_unbound_homes, run_fleet, seed

        if devices < 0 or 0 < devices < 3:
            raise CommandError("the demo fleet needs at least 3 devices; --devices 0 seeds the setup without any")
        if devices and not server:
            raise CommandError("--server is needed to run devices")
        tokens = seed(devices=devices)
        if not devices:
            self.stdout.write("[demo] the demo setup is ready; no simulated devices (--devices 0)\n")
            return
        root = home or Path(settings.DATA_DIR) / "demo"
        fleet = plan(devices, root)
        reset_unbound_homes(fleet, server)

        async def main():
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, stop.set)
            await run_fleet(server=server, devices=fleet, tokens=tokens, stop=stop)

        asyncio.run(main())
