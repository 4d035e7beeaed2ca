"""What the benchmark reads back: the API's versions, rounds and deltas (an admin's token), and each device's
models on its held-out TEST set: version 1, the newest released version, what the agent serves
(``Agent(home).model()``), and a plain local fine-tune of version 1's adapter on the samples the device holds."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from edge_agent.api import Agent
from edge_agent.assignments import AdapterStore, build_model
from edge_agent.families import get_family
from edge_agent.personal import PersonalSettings, PersonalStore, derive, misread_labels
from edge_agent.training import TrainConfig, train_adapter

FINETUNE = {"epochs": 50, "lr": 0.01, "micro_batch": 16, "patience": 5, "refit": True}


class ApiReader:
    def __init__(self, base_url: str, token: str):
        self.base_url, self.token = base_url, token

    def get(self, path: str):
        request = urllib.request.Request(self.base_url + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310  (our own server)
            return json.loads(response.read())

    def pages(self, path: str) -> list[dict]:
        out, separator = [], "&" if "?" in path else "?"
        url = f"{path}{separator}page_size=500"
        while url:
            page = self.get(url)
            out += page["results"]
            url = page["next"].split("://", 1)[1].partition("/")[2] if page.get("next") else None
            url = "/" + url if url else None
        return out

    def versions(self, adapter: str) -> list[dict]:
        return sorted(self.pages(f"/api/v1/adapter-versions/?adapter__name={adapter}"), key=lambda v: v["number"])

    def rounds(self, adapter: str) -> list[dict]:
        return sorted(self.pages(f"/api/v1/rounds/?adapter__name={adapter}"), key=lambda r: r["id"])

    def deltas(self, adapter: str) -> list[dict]:
        return sorted(self.pages(f"/api/v1/deltas/?adapter_name={adapter}"), key=lambda d: d["id"])


def as_tensors(data: dict) -> dict:
    """Samples as the family reads them: the labels ``y`` int64, float inputs float32 (digits' ``x``, a sensor's
    ``window``), integer inputs int64."""

    def tensor(key: str, value) -> torch.Tensor:
        value = np.asarray(value)
        whole = key == "y" or np.issubdtype(value.dtype, np.integer)
        return torch.as_tensor(value, dtype=torch.int64 if whole else torch.float32)

    return {key: tensor(key, value) for key, value in data.items()}


class Models:
    """Builds the adapter's models as the agents do (``build_model``: the installed base and manifest)."""

    def __init__(self, any_home: Path, blobs: Path):
        state = AdapterStore(any_home).state()
        self.training = state["current"]["training"]
        self.base_path = AdapterStore(any_home).base_path(state["base_model_sha256"])
        self.family = get_family(self.training["family"])
        self.blobs = blobs

    def version_tensors(self, sha256: str) -> dict:
        return load_file(str(self.blobs / sha256[:2] / sha256))

    def build(self, tensors: dict):
        return build_model(self.training, tensors, self.base_path)

    def accuracy(self, model, data: dict) -> float:
        if not len(data["y"]):
            return float("nan")
        with torch.no_grad():
            return float(self.family.evaluate(model.eval(), as_tensors(data))["accuracy"])

    def finetune(self, start: dict, held: dict, seed: int) -> tuple[torch.nn.Module, dict]:
        """Plain local fine-tuning: version 1's adapter (LoRA matrices and head) trained on the device's own
        samples, every 5th a validation slice for early stopping (on loss, patience 5, up to 50 epochs, AdamW
        lr 0.01), then refit on all of them for the best epoch count; the start is kept where no epoch beats it."""
        model = self.build(start)
        data = as_tensors(held)
        n = len(data["y"])
        val_mask = (np.arange(n) % 5) == 4
        train = {k: v[~val_mask] for k, v in data.items()}
        val = {k: v[val_mask] for k, v in data.items()}
        if not len(train["y"]):
            return model.eval(), {"epochs": 0, "note": "no samples"}
        config = TrainConfig(**FINETUNE, seed=seed, judge_min_samples=0, progress_bar=False)
        result = train_adapter(model, train, val, config=config, family=self.family)
        if result.discarded:
            model = self.build(start)
        return model.eval(), {"best_epoch": result.best_epoch, "epochs_run": result.epochs_run,
                              "discarded": result.discarded, "val_samples": int(val_mask.sum())}  # fmt: skip


def both_models(home: Path, models: Models, test: dict, held: dict) -> dict:
    """The two models the device chose between, each on its TEST set (``shared_model``: the installed version,
    ``personal_model``: its own adapter, None if it has none), what its last pass judged by on its held slice
    (``choice``: the accuracies and paired counts), and the classes of the samples it holds that the installed
    version reads as something else more than half the time (``misread``): what a serving rule is judged on."""
    state = AdapterStore(home).state().get("current") or {}
    if not state.get("path"):
        return {}
    shared_tensors = load_file(state["path"])
    shared = models.build(shared_tensors)
    store = PersonalStore(home)
    personal_state, tensors = store.state(), store.tensors()
    personal = None
    if tensors is not None and personal_state.get("adapter") == state.get("adapter"):
        if personal_state.get("method") == "private_modules":
            tensors = derive(shared_tensors, tensors, PersonalSettings.from_training(state["training"]))
        personal = models.accuracy(models.build(tensors), test)
    keys = ("version", "serving", "shared_accuracy", "personal_accuracy", "val_samples", "shared_only_right",
            "personal_only_right")  # fmt: skip
    return {
        "shared_model": models.accuracy(shared, test),
        "personal_model": personal,
        "choice": {key: personal_state.get(key) for key in keys},
        "misread": misread_labels(shared.eval(), as_tensors(held)) if len(held["y"]) else [],
    }


def served(home: Path) -> tuple[torch.nn.Module, dict]:
    return Agent(home).served()


def device_report(home: Path) -> dict:
    """What the device reports of its personal model (its heartbeat's ``personal``) and its state."""
    status = Agent(home).status()
    personal = status.get("personal") or {}
    keep = ("version", "method", "serving", "shared_accuracy", "personal_accuracy", "val_samples", "trained_samples")
    return {"installed": (status.get("installed") or {}).get("version"), "samples": status["samples"],
            **{k: personal.get(k) for k in keep}}  # fmt: skip
