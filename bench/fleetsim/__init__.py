"""Simulated fleets for the load benchmarks: the product started for real, agents that speak only the wire
protocol (``edge_agent.protocol``, never Django), and the figures they report.

- ``server``: the product started with ``python -m fleet.launcher run`` on a fresh database and Redis prefix,
  its processes, and the clean-up (stop, drop the database, delete the Redis keys);
- ``resources``: CPU and RSS of process trees and of the machine;
- ``stats``: percentiles, summaries and number formatting for the tables;
- ``agent``: the protocol-level agent's handshake (challenge, signed hello, welcome) and heartbeat;
- ``loop_health``: a load generator's own event-loop lag and GC pauses, so a client stall is not reported as
  server latency;
- ``generator`` / ``connections``: the load-generator processes and the phases of ``agent_connections.py``;
- ``family``, ``deltas``, ``provision``, ``http_client``, ``ingest_agent``, ``ingest_run``, ``ingest_report``,
  ``echo_server``, ``profiling``: the fleet simulator of ``fleet_simulator.py`` (enrolled agents uploading
  signed deltas);
- ``services``, ``fault_traffic``, ``fault_inject``, ``fault_checks``: ``faults.py`` (the product on embedded
  PostgreSQL and Redis of its own, live traffic, the faults, and the checks that no delta was lost or counted
  twice).
"""

from __future__ import annotations

from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent.parent
RESULTS_DIR = BASE_DIR / "bench" / "results"


def say(message: str) -> None:
    print(f"[bench] {message}", flush=True)
