"""The agent as the device's application uses it: hand it samples, get the device's own model back.

    from edge_agent.api import Agent

    agent = Agent()                              # the agent's home (~/.fleet-agent or FLEET_AGENT_HOME)
    agent.add_samples({"x": images, "y": labels})  # checked against the family's schema, then stored
    agent.predict({"x": images})                 # {"labels": [...], "probabilities": [[...]], "serving": ...}
    model = agent.model()                        # the served torch module, ready for inference (eval mode)
    agent.status()                               # versions, personal model, samples, last training

The served model is the personal one where the device's validation says it helps, else the shared version
(``edge_agent.personal``). ``edge-agent run`` trains in its own process or thread and writes new models to
disk; the next ``predict`` notices and builds the new model in the background while it keeps answering with
the one it has, so a training pass never makes a prediction wait longer than the swap of a reference.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from edge_agent.assignments import AdapterStore, build_model
from edge_agent.families import get_family
from edge_agent.families.common import LABEL
from edge_agent.identity import default_home
from edge_agent.personal import PersonalSettings, PersonalStore, derive
from edge_agent.sample_files import check, encode, read_samples
from edge_agent.samples import SampleStore


class NotReady(RuntimeError):
    """No adapter is installed yet: the family (and so the sample schema and the model) is not known."""


NOT_INSTALLED = (
    "no adapter installed yet: the agent must receive its first assignment, which names the family and so what a "
    "sample is. Run `edge-agent run` on an approved device until `edge-agent status` shows a version installed; "
    "files dropped in the inbox meanwhile wait there and are taken then"
)


class Agent:
    def __init__(self, home: Path | str | None = None):
        self.home = Path(home) if home is not None else default_home()
        self.adapters = AdapterStore(self.home)
        self.personal = PersonalStore(self.home)
        self.samples = SampleStore(self.home / "samples")
        self._lock = threading.Lock()
        self._served: tuple[tuple, torch.nn.Module, dict] | None = None  # (stamp, model, what it is)
        self._building: threading.Thread | None = None

    def _current(self) -> dict:
        current = self.adapters.state().get("current")
        if not current or not current.get("training"):
            raise NotReady(NOT_INSTALLED)
        return current

    def _family(self):
        training = self._current()["training"]
        return get_family(training["family"]), training.get("family_config", {})

    def schema(self) -> dict[str, str]:
        """The fields a sample needs, each described (``{"x": "float32 [1, 8, 8] in [0, 1]", ...}``)."""
        family, config = self._family()
        return {name: field.describe() for name, field in family.sample_fields(config).items()}

    def add_samples(self, samples: dict) -> int:
        """Store labelled samples (field -> one value per sample); returns how many. A batch that does not fit
        the schema raises ``SampleError`` and stores nothing."""
        family, config = self._family()
        arrays = encode(family, config, check(family.sample_fields(config), samples))
        before = len(self.samples)
        return self.samples.append(arrays) - before

    def add_file(self, path: Path | str) -> int:
        """Store the samples of a file or image folder (``edge_agent.sample_files``); returns how many."""
        family, config = self._family()
        arrays = read_samples(Path(path), family, config)
        before = len(self.samples)
        return self.samples.append(arrays) - before

    # The served model -------------------------------------------------------------------------------

    def _stamp(self) -> tuple:
        def mtime(path: Path) -> int:
            try:
                return path.stat().st_mtime_ns
            except FileNotFoundError:
                return 0

        return mtime(self.adapters.state_path), mtime(self.personal.state_path)

    def _build(self, stamp: tuple) -> tuple[tuple, torch.nn.Module, dict]:
        state = self.adapters.state()
        current = state.get("current") or {}
        if not current.get("training"):
            raise NotReady(NOT_INSTALLED)
        personal = self.personal.state()
        tensors, serving = None, "shared"
        mine = personal.get("serving") == "personal" and personal.get("adapter") == current["adapter"]
        if mine:
            tensors = self.personal.tensors()
            serving = "personal" if tensors is not None else "shared"
            if tensors is not None and personal.get("method") == "private_modules":  # on the installed body
                settings = PersonalSettings.from_training(current["training"])
                tensors = derive(load_file(current["path"]), tensors, settings)
        if tensors is None:
            tensors = load_file(current["path"])
        model = build_model(current["training"], tensors, self.adapters.base_path(state["base_model_sha256"]))
        about = {"serving": serving, "adapter": current["adapter"], "version": current["version"],
                 "method": personal.get("method", "none")}  # fmt: skip
        return stamp, model, about

    def _refresh(self) -> None:
        try:
            built = self._build(self._stamp())
        except Exception:  # a model being written is read again at the next call
            return
        with self._lock:
            self._served = built

    def served(self) -> tuple[torch.nn.Module, dict]:
        """The model to use now and what it is; a newer one on disk is built in the background."""
        stamp = self._stamp()
        with self._lock:
            served = self._served
        if served is None:
            built = self._build(stamp)
            with self._lock:
                self._served = served = built
        elif served[0] != stamp and (self._building is None or not self._building.is_alive()):
            self._building = threading.Thread(target=self._refresh, name="edge-agent-model", daemon=True)
            self._building.start()
        return served[1], served[2]

    def model(self) -> torch.nn.Module:
        """The served model (personal or shared) as a torch module in eval mode. Do not train it in place."""
        return self.served()[0]

    def predict(self, inputs: dict) -> dict:
        """Predictions for ``inputs`` (the schema's fields without ``y``; or a path to a file of them)."""
        family, config = self._family()
        if isinstance(inputs, str | Path):
            arrays = read_samples(Path(inputs), family, config, labelled=False)
        else:
            arrays = encode(family, config, check(family.sample_fields(config), inputs, labelled=False))
        model, about = self.served()
        batch = {key: torch.as_tensor(np.ascontiguousarray(value)) for key, value in arrays.items() if key != LABEL}
        with torch.no_grad():
            probabilities = torch.softmax(model(**batch), dim=-1)
        return {
            "labels": probabilities.argmax(-1).tolist(),
            "probabilities": [[round(p, 6) for p in row] for row in probabilities.tolist()],
            **about,
        }

    def status(self) -> dict:
        """What the application may want to show: the installed version, the personal model, the samples."""
        current = self.adapters.state().get("current")
        return {
            "installed": {k: current.get(k) for k in ("adapter", "version", "sha256")} if current else None,
            "personal": {k: v for k, v in self.personal.state().items() if k not in ("file", "saved")},
            "samples": {"stored": len(self.samples), "new": self.samples.new_count()},
        }
