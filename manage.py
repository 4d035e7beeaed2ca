#!/usr/bin/env python
"""Django's command-line utility for the fleet personalization manager."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleet.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as exc:
        # A bad environment value: say which and why, without a traceback to dig through.
        sys.exit(f"configuration error: {exc}")


if __name__ == "__main__":
    main()
