"""Applying what the server assigns: verify the manifest, fetch and verify the bytes, swap atomically,
keep the previous version to fall back to, and report the outcome (with guard metrics) to the server.

On disk, under the agent home::

    base/<sha256>.safetensors            the base weights this device carries
    adapters/<adapter>/v<n>-<sha8>.safetensors
    adapters/state.json                  {last_seq, base_model_sha256, current, previous}
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from edge_agent.download import DownloadError, download
from edge_agent.families import get_family, loads_file
from edge_agent.identity import AgentState, atomic_write
from edge_agent.lora_layers import apply_adapter
from edge_agent.manifest import ManifestRefused, trusted_server_key, verify_manifest
from edge_agent.rest import DeviceSession, ServerError

logger = logging.getLogger("edge_agent.assignments")
SUPERSEDED = "assignment_superseded"  # the server's answer to a report on a withdrawn assignment (edge_agent/codes.py)
# Evaluates a new adapter file (and the one it replaces) on local validation data, given the signed manifest,
# returning guard metrics such as {"val_accuracy": 0.93, "val_accuracy_change": -0.01}.
Evaluator = Callable[[Path | None, Path, dict], dict]


def build_model(training: dict, tensors: dict, base_path: Path) -> torch.nn.Module:
    """The base model of ``training``'s family carrying ``tensors`` as its adapter, in eval mode."""
    family = get_family(training["family"])
    if loads_file(family):  # the stored file is the model itself (an exported program)
        base = family.load(training.get("family_config", {}), base_path)
    else:
        base = family.build(training.get("family_config", {}))
        base.load_state_dict(load_file(str(base_path)), strict=True)
    return apply_adapter(
        base,
        {k: v.clone() for k, v in tensors.items()},
        rank=training["rank"],
        alpha=training["alpha"],
        dropout=training.get("dropout", 0.0),
        target_modules=training["target_modules"],
        modules_to_save=training.get("modules_to_save", []),
    ).eval()


class AdapterStore:
    def __init__(self, home: Path):
        self.root = home / "adapters"
        self.base_root = home / "base"
        self.state_path = self.root / "state.json"

    def state(self) -> dict:
        if self.state_path.exists():
            return json.loads(self.state_path.read_text())
        return {"last_seq": 0, "base_model_sha256": None, "current": None, "previous": None}

    def save(self, state: dict) -> None:
        atomic_write(self.state_path, json.dumps(state, indent=2).encode(), mode=0o600)

    def current_path(self) -> Path | None:
        current = self.state().get("current")
        return Path(current["path"]) if current else None

    def base_path(self, sha256: str) -> Path:
        return self.base_root / f"{sha256}.safetensors"


class AssignmentHandler:
    """Handles the ``assignment`` command; returns what it did (also sent back as the command's ack)."""

    def __init__(self, *, home: Path, state: AgentState, session: DeviceSession, evaluate: Evaluator | None = None):
        self.home, self.state, self.session = home, state, session
        self.store = AdapterStore(home)
        self.evaluate = evaluate

    async def __call__(self, command: str, args: dict) -> dict:
        if command != "assignment":
            raise ValueError(f"unknown command {command!r}")
        import asyncio

        return await asyncio.to_thread(self.apply, args)

    def _report(self, assignment_id, status: str, reason: str = "", metrics: dict | None = None) -> str:
        """Report ``status`` on the assignment; returns "reported", "superseded" (a newer assignment, or the end of
        its rollout, withdrew it meanwhile: an expected race, docs/protocol/README.md, "Assignments") or "failed"."""
        try:
            self.session.post(
                f"/api/v1/device/assignments/{assignment_id}/report/",
                {"status": status, "reason": reason[:300], "metrics": metrics or {}},
            )
        except ServerError as error:
            if error.code == SUPERSEDED:
                logger.info("assignment %s was withdrawn by the server before it took the %s report: %s",
                            assignment_id, status, error.message)  # fmt: skip
                return "superseded"
            logger.warning("could not report %s for assignment %s: %s", status, assignment_id, error)
            return "failed"
        except OSError as error:
            logger.warning("could not report %s for assignment %s: %s", status, assignment_id, error)
            return "failed"
        return "reported"

    def _pin_server_key(self, server_key: str) -> None:
        """Trust the rotated server key from now on (it signed a manifest that passed every check, and each
        link to it was signed by the key trusted before); the retired key is refused from here on."""
        logger.warning(
            "the server rotated its signing key: now trusting %s (was %s)", server_key, self.state.server_public_key
        )
        self.state.server_public_key = server_key
        self.state.save(self.home)

    def apply(self, message: dict) -> dict:
        assignment_id = message.get("assignment_id")
        stored = self.store.state()
        # The base this device carries is pinned by the first manifest it accepts (signed by the pinned key).
        envelope = message.get("envelope")
        manifest_base = (
            (envelope or {}).get("manifest", {}).get("base_model_sha256") if isinstance(envelope, dict) else None
        )
        carried_base = stored.get("base_model_sha256") or manifest_base or ""
        try:
            server_key = trusted_server_key(envelope, self.state.server_public_key)
            manifest = verify_manifest(
                envelope,
                server_public_key=server_key,
                device_id=self.state.device_id,
                base_model_sha256=carried_base,
                last_accepted_seq=int(stored.get("last_seq", 0)),
                now=time.time(),
            )
        except ManifestRefused as refused:
            logger.warning("refused assignment %s: %s (%s)", assignment_id, refused, refused.code)
            self._report(assignment_id, "failed", f"refused: {refused.code}: {refused}")
            return {"status": "refused", "code": refused.code}
        if server_key != self.state.server_public_key:
            self._pin_server_key(server_key)
        if self._report(assignment_id, "delivered") == "superseded":
            logger.info("not installing %s v%s (assignment %s): the server no longer wants it; a newer one follows",
                        manifest["adapter"], manifest["version"], manifest["assignment_seq"])  # fmt: skip
            return {"status": "superseded", "version": manifest["version"]}
        try:
            base = message.get("base_model") or {}
            base_file = self.store.base_path(manifest["base_model_sha256"])
            if not base_file.exists():
                download(
                    self.session.server + base["download_path"],
                    base_file,
                    sha256=manifest["base_model_sha256"],
                    size=int(base["size"]),
                    headers=self.session.auth_headers(),
                )
            target = (
                self.store.root / manifest["adapter"] / f"v{manifest['version']}-{manifest['sha256'][:8]}.safetensors"
            )
            if not target.exists():
                download(
                    self.session.server + message["download_path"],
                    target,
                    sha256=manifest["sha256"],
                    size=manifest["size"],
                    headers=self.session.auth_headers(),
                )
        except (ManifestRefused, DownloadError, ServerError, OSError, KeyError, TypeError, ValueError) as error:
            code = getattr(error, "code", type(error).__name__)
            self._report(assignment_id, "failed", f"download failed: {code}: {error}")
            return {"status": "failed", "code": code}

        previous = stored.get("current")
        metrics = {}
        if self.evaluate is not None:
            try:
                metrics = self.evaluate(Path(previous["path"]) if previous else None, target, manifest) or {}
            except Exception as error:  # a broken evaluation must not brick the device: report it
                logger.warning("could not evaluate %s v%s (assignment %s): %s: %s", manifest["adapter"],
                               manifest["version"], assignment_id, type(error).__name__, error)  # fmt: skip
                self._report(assignment_id, "failed", f"evaluation failed: {type(error).__name__}: {error}")
                return {"status": "failed", "code": "evaluation_failed"}
        # The swap: one atomic write of the state file; the previous file stays for falling back.
        self.store.save(
            {
                "last_seq": manifest["assignment_seq"],
                "base_model_sha256": manifest["base_model_sha256"],
                "current": {
                    "adapter": manifest["adapter"],
                    "version": manifest["version"],
                    "sha256": manifest["sha256"],
                    "path": str(target),
                    "installed_at": time.time(),
                    "training": manifest.get("training"),
                },
                "previous": previous,
            }
        )
        self._report(assignment_id, "installed", metrics=metrics)
        logger.info(
            "installed %s v%s (assignment %s)", manifest["adapter"], manifest["version"], manifest["assignment_seq"]
        )
        return {"status": "installed", "version": manifest["version"]}
