"""The server side of a run: the demo's own seed (``demo.fleet_demo.seed``: cohorts, the factory-trained
``digits-cnn`` base, the ``digits-lora`` adapter with the demo's aggregation and default personalization,
version 1 released and rolled out to both cohorts, pre-authorized enrollment tokens) in a Django script against
the fresh database, then the aggregation changes the run asks for on top of the demo's, and an admin's API token
to read the API with."""

from __future__ import annotations

import json

SEED_SCRIPT = r"""
import json, sys
import django
django.setup()
from accounts.roles import Role
from accounts.services import api_token_create, user_create
from demo.fleet_demo import ADAPTER, seed
from training.federation.aggregation_settings import validate_aggregation
from training.models import Adapter
from training.registry.personalization_settings import personalization_settings
from training.registry.services import adapter_set_aggregation

devices, changes, admin = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
tokens = seed(devices=devices)
adapter = Adapter.objects.get(name=ADAPTER)
demo = dict(adapter.aggregation)
if changes:
    wanted = {**demo, **changes}
    validate_aggregation(wanted)
    adapter = adapter_set_aggregation(adapter=adapter, actor=None, aggregation=wanted)
user = user_create(username=admin, role=Role.ADMIN)
print(json.dumps({"tokens": tokens, "adapter_id": adapter.pk, "adapter": adapter.name,
                  "demo_aggregation": demo, "aggregation": adapter.aggregation,
                  "personalization": personalization_settings(adapter),
                  "api_token": api_token_create(user=user, name="fleet_learning bench").raw}))
"""


def seed_server(server, *, devices: int, changes: dict) -> dict:
    out = server.run_django(SEED_SCRIPT, str(devices), json.dumps(changes), f"bench-{server.run_id}",
                            what="seeding the demo's setup")  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])
