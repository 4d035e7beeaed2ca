"""The device side of the fleet: training loop, delta packaging, outbox, sync client, CLI.

Plain Python and torch; this package must never import Django (the server imports the wire formats from
here, never the other way round).
"""

__version__ = "0.1.0"
