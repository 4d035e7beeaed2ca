"""A device with a shared version installed by hand (no server): the base, the adapter file and the state the
assignment handler writes, so the runtime's personal passes can be tested alone."""

from __future__ import annotations

import time
from pathlib import Path

from safetensors.torch import save_file

from edge_agent.assignments import AdapterStore
from edge_agent.identity import AgentState, load_or_create_key
from edge_agent.lora_layers import adapter_tensors
from edge_agent.runtime import AgentConfig, DeviceRuntime
from tests.edge_agent.support import adapted


def training_manifest(family, personalization: dict) -> dict:
    return {
        "family": family.name,
        "family_config": {"seed": 0},
        "rank": 4,
        "alpha": 8.0,
        "dropout": 0.0,
        "target_modules": list(family.default_targets),
        "modules_to_save": list(family.default_modules_to_save),
        "ffa": False,
        "personalization": personalization,
    }


def install(home: Path, base, family, *, version: int, training: dict, tensors=None) -> dict:
    """Install ``tensors`` (a fresh adapter on ``base`` when None) as shared version ``version``."""
    store = AdapterStore(home)
    store.base_root.mkdir(parents=True, exist_ok=True)
    base_sha = "b" * 64
    save_file({k: v.contiguous() for k, v in base.state_dict().items()}, str(store.base_path(base_sha)))
    tensors = tensors if tensors is not None else adapter_tensors(adapted(base, family))
    store.root.mkdir(parents=True, exist_ok=True)
    path = store.root / f"v{version}.safetensors"
    save_file(tensors, str(path))
    state = store.state()
    store.save(
        {
            "last_seq": version,
            "base_model_sha256": base_sha,
            "current": {
                "adapter": "digits-lora",
                "version": version,
                "sha256": f"{version:064d}",
                "path": str(path),
                "installed_at": time.time(),
                "training": training,
            },  # fmt: skip
            "previous": state.get("current"),
        }
    )
    return tensors


def device(home: Path, *, scenario: str, index: int = 3, per_poll: int = 200) -> DeviceRuntime:
    """A simulated device of the digits fleet whose user differs as ``scenario`` says, on mains power."""
    config = AgentConfig(
        data={
            "kind": "simulated",
            "device_index": index,
            "num_devices": 4,
            "alpha": 100.0,
            "per_poll": per_poll,
            "scenario": scenario,
            "wrap": False,
        },  # fmt: skip
        power={"kind": "simulated", "level": 100.0, "charging": True},
        policy={"min_new_samples": 16, "min_battery_percent": 30.0},
        train={"epochs": 4, "lr": 0.01, "replay_ratio": 0.0},
    )
    state = AgentState(server="http://127.0.0.1:9", device_id="00000000-0000-0000-0000-000000000003",
                       server_public_key="", cohort="c", status="active", websocket_path="/ws/agent/",
                       heartbeat_interval=30)  # fmt: skip
    return DeviceRuntime(home=home, state=state, key=load_or_create_key(home), config=config)
