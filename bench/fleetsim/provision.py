"""What the fleet simulator needs on the server, made through the product's REST API with an admin's API
token, as an operator would: a cohort, a base model and an adapter sized for the requested deltas, its first
version, a pre-authorized enrollment token; then every agent enrolls (``POST /api/v1/enroll/``) with its own
Ed25519 key.

When the simulator starts the server itself, the admin and the token are made with the product's services
(``accounts.services``) in a small Django script against the fresh database.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from bench.fleetsim.agent import AGENT_VERSION, HARDWARE
from bench.fleetsim.family import RANK, features_for
from bench.fleetsim.http_client import Api, HttpError, request
from edge_agent.protocol import b64encode

ADMIN_SCRIPT = r"""
import sys
import django
django.setup()
from accounts.roles import Role
from accounts.services import api_token_create, user_create
user = user_create(username=sys.argv[1], role=Role.ADMIN)
print(api_token_create(user=user, name="fleet simulator").raw)
"""

# The same enrollment the API's view makes (devices.services.device_enroll), one agent after another, without
# HTTP: used when the server's HTTP path cannot take a few thousand enrollments (see bench/README.md).
ENROLL_SCRIPT = r"""
import json, sys
import django
django.setup()
from devices.services import device_enroll
token, hardware, agent_version = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
agents = json.load(sys.stdin)
ids = [
    str(device_enroll(token=token, public_key=a["public_key"], name=a["name"], hardware=hardware,
                      agent_version=agent_version).pk)
    for a in agents
]
print(json.dumps(ids))
"""

BENCH_FAMILY = "bench.fleetsim.family:BenchLinear"


@dataclass
class Setup:
    cohort: str
    adapter: str
    adapter_id: int
    base_version: int
    tensor_spec: dict
    enrollment_token: str


def adapter_plan(family: str, delta_kb: float) -> dict:
    """The base model's family config and the adapter's rank and modules for deltas of about ``delta_kb``."""
    if family == "bench":
        return {
            "family": BENCH_FAMILY,
            "family_config": {"seed": 1, "features": features_for(delta_kb)},
            "rank": RANK,
            "target_modules": ["proj"],
            "modules_to_save": [],
        }
    if family == "digits-cnn":
        # conv2 (16 -> 32, 3x3) and fc1 (128 -> 64) hold 368 values per rank; the head (650 values) is saved whole
        rank = max(1, min(256, round((delta_kb * 1024 / 4 - 650) / 368)))
        return {"family": "digits-cnn", "family_config": {"seed": 1}, "rank": rank, "target_modules": ["conv2", "fc1"]}
    raise ValueError(f"unknown family {family!r}: bench or digits-cnn")


def local_tensor_spec(family: str, delta_kb: float) -> dict:
    """The adapter's tensor spec as the server will compute it (same family, same ``edge_agent.lora``)."""
    from edge_agent.families import get_family
    from edge_agent.lora import tensor_spec

    plan = adapter_plan(family, delta_kb)
    family_ = get_family(plan["family"])
    spec = tensor_spec(
        family_.build(plan["family_config"]),
        rank=plan["rank"],
        target_modules=plan.get("target_modules", list(family_.default_targets)),
        modules_to_save=plan.get("modules_to_save", list(family_.default_modules_to_save)),
    )
    return {name: value.as_json() for name, value in spec.items()}


async def provision(
    api: Api, *, name: str, family: str, delta_kb: float, agents: int, aggregation: dict, hours: float = 12
) -> Setup:
    plan = adapter_plan(family, delta_kb)
    await api.call("POST", "/api/v1/cohorts/", {"name": name, "description": "fleet simulator"})
    await api.call(
        "POST",
        "/api/v1/base-models/",
        {"name": name, "family": plan["family"], "family_config": plan["family_config"]},
    )
    body = {
        "name": name,
        "base_model": name,
        "cohorts": [name],
        "rank": plan["rank"],
        "alpha": float(plan["rank"]),
        "aggregation": aggregation,
    }
    body.update({k: plan[k] for k in ("target_modules", "modules_to_save") if k in plan})
    adapter = await api.call("POST", "/api/v1/adapters/", body)
    version = await api.call("POST", f"/api/v1/adapters/{adapter['id']}/versions/seed/", {"seed": 1})
    token = await api.call(
        "POST",
        "/api/v1/enrollment-tokens/",
        {
            "cohort": name,
            "name": "fleet simulator",
            "expires_at": (datetime.now(UTC) + timedelta(hours=hours)).isoformat(),
            "uses_left": agents,
            "requires_approval": False,
        },
    )
    return Setup(name, name, adapter["id"], version["number"], adapter["tensor_spec"], token["token"])


def enroll_with_services(server, token: str, keys: list) -> list[str]:
    """Enroll one device per key through ``device_enroll`` in a Django script against the server's database."""
    import json
    import subprocess
    import sys

    from bench.fleetsim import BASE_DIR

    agents = [
        {"public_key": b64encode(key.public_key().public_bytes_raw()), "name": f"sim-{index:06d}"}
        for index, key in enumerate(keys)
    ]
    result = subprocess.run(
        [sys.executable, "-c", ENROLL_SCRIPT, token, json.dumps(HARDWARE), AGENT_VERSION],
        input=json.dumps(agents),
        cwd=BASE_DIR,
        env=server.env,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"enrolling through the services failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


async def enroll_all(base_url: str, token: str, keys: list, *, concurrency: int = 16) -> list[str]:
    """Enroll one device per key (pre-authorized: active at once); their ids in the keys' order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, key) -> str:
        body = {
            "token": token,
            "public_key": b64encode(key.public_key().public_bytes_raw()),
            "name": f"sim-{index:06d}",
            # what the agents say in their hello, so a hello writes nothing (a fleet reconnecting)
            "hardware": HARDWARE,
            "agent_version": AGENT_VERSION,
        }
        async with gate:
            for _attempt in range(30):
                response = await request(base_url, "POST", "/api/v1/enroll/", json_body=body)
                if response.status == 429:  # the server's ENROLLMENT_RATE: wait as told
                    await asyncio.sleep(float(response.headers.get("retry-after") or 2))
                    continue
                if response.status != 201:
                    raise HttpError(response, f"enrolling agent {index}")
                answer = response.json()
                if answer["status"] != "active":
                    raise RuntimeError(f"agent {index} enrolled as {answer['status']}, not active")
                return answer["device_id"]
        raise RuntimeError(f"agent {index}: enrollment still throttled after 30 tries (raise ENROLLMENT_RATE)")

    return list(await asyncio.gather(*(one(i, key) for i, key in enumerate(keys))))


async def server_totals(api: Api, adapter: str) -> dict:
    """What the server says it holds for the adapter: deltas by state, rounds and how many deltas they count."""
    totals: dict = {"deltas": {}}
    for state in ("received", "accepted", "rejected", "aggregated"):
        page = await api.call("GET", f"/api/v1/deltas/?adapter_name={adapter}&state={state}&page_size=1")
        totals["deltas"][state] = page["count"]
    rounds, path = [], f"/api/v1/rounds/?adapter__name={adapter}&page_size=500"
    while path:
        page = await api.call("GET", path)
        rounds += page["results"]
        path = page["next"].split("://", 1)[1].partition("/")[2] if page.get("next") else None
        path = "/" + path if path else None
    by_state: dict[str, int] = {}
    for round_ in rounds:
        by_state[round_["state"]] = by_state.get(round_["state"], 0) + 1
    totals["rounds"] = by_state
    totals["deltas_in_rounds"] = sum(r["accepted"] or 0 for r in rounds)
    totals["versions_made"] = sum(1 for r in rounds if r.get("result_version") is not None)
    totals["aggregation_seconds"] = [r["stats"].get("seconds") for r in rounds if r.get("stats")]
    totals["failures"] = [r["failure"][:200] for r in rounds if r.get("failure")]
    return totals
