"""``python -m conformance --server http://127.0.0.1:8000 --operator-token fpm_...``: run the suite against a
running server with the reference client (or ``--client module:Class``); exit code 1 on any FAIL or SKIP."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from conformance.client import Client, ReferenceClient
from conformance.operator import RestOperator
from conformance.suite import SCHEMA_DIR, Schemas, run


def load_client(spec: str) -> type[Client]:
    module, _, name = spec.partition(":")
    client = getattr(importlib.import_module(module), name)
    if not (isinstance(client, type) and issubclass(client, Client)):
        raise SystemExit(f"{spec} is not a conformance.client.Client subclass")
    return client


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__)
    parser.add_argument("--server", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument(
        "--operator-token",
        default=os.environ.get("FLEET_OPERATOR_TOKEN", ""),
        help="an admin's API token (Bearer fpm_...; or FLEET_OPERATOR_TOKEN)",
    )
    parser.add_argument("--client", default="", help="module:Class implementing conformance.client.Client")
    parser.add_argument("--chunk-size", type=int, default=0, help="delta chunk bytes (default: a third of the file)")
    parser.add_argument("--result-timeout", type=float, default=60, help="seconds to wait for a delta_result")
    parser.add_argument("--schemas", type=Path, default=SCHEMA_DIR, help="the JSON Schemas (docs/protocol/schemas)")
    args = parser.parse_args(argv)
    if not args.operator_token:
        parser.error("--operator-token (an admin's API token) is required")
    client = load_client(args.client) if args.client else ReferenceClient
    results = run(
        args.server,
        client,
        RestOperator(args.server, args.operator_token),
        chunk_size=args.chunk_size,
        result_timeout=args.result_timeout,
        schemas=Schemas(args.schemas),
    )
    failed = [r for r in results if r.status != "PASS"]
    print(f"{len(results) - len(failed)} of {len(results)} steps passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
