"""Why a shared version gets worse, read after the run from the server's own blobs on its evaluation set (the
digits test part, as ``training.registry.evaluation`` uses it):

- per version: accuracy, how many of the ten classes it still recalls at 50% or more, and which parts carry
  the change: the version's LoRA body with version 1's head (``body``) and version 1's body with the version's
  head (``head``);
- per delta (where its blob is still stored): the accuracy of its base version plus that one delta alone
  (``solo``), against its base version's, so the deltas that pull the shared version down can be named.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from edge_agent.families.digits import load_split

HEAD = "head"


def _accuracy(models, tensors: dict, test: dict) -> tuple[float, np.ndarray]:
    model = models.build(tensors).eval()
    with torch.no_grad():
        predicted = model(test["x"]).argmax(-1).numpy()
    y = test["y"].numpy()
    recall = np.asarray([(predicted[y == c] == c).mean() for c in range(10)])
    return float((predicted == y).mean()), recall


def versions(models, versions_: list[dict]) -> list[dict]:
    _, test = load_split()
    v1 = models.version_tensors(versions_[0]["blob_sha256"])
    out = []
    for v in versions_:
        tensors = models.version_tensors(v["blob_sha256"])
        accuracy, recall = _accuracy(models, tensors, test)
        body = {k: (v1[k] if HEAD in k.split(".") else t) for k, t in tensors.items()}
        head = {k: (t if HEAD in k.split(".") else v1[k]) for k, t in tensors.items()}
        out.append({
            "version": v["number"], "accuracy": accuracy, "classes_recalled": int((recall >= 0.5).sum()),
            "recall": [round(float(r), 3) for r in recall],
            "body_with_v1_head": _accuracy(models, body, test)[0],
            "v1_body_with_head": _accuracy(models, head, test)[0],
        })  # fmt: skip
    return out


def deltas(models, blobs: Path, versions_: list[dict], deltas_: list[dict]) -> list[dict]:
    _, test = load_split()
    by_number = {v["number"]: v for v in versions_}
    cache: dict[int, tuple[dict, float]] = {}
    out = []
    for d in deltas_:
        if d["state"] != "aggregated" or d["base_version"] not in by_number:
            continue
        path = blobs / d["sha256"][:2] / d["sha256"]
        if not path.exists():
            continue
        if d["base_version"] not in cache:
            base = models.version_tensors(by_number[d["base_version"]]["blob_sha256"])
            cache[d["base_version"]] = (base, _accuracy(models, base, test)[0])
        base, base_accuracy = cache[d["base_version"]]
        try:
            change = load_file(str(path))
            solo = {k: t + change[k].float() if k in change else t for k, t in base.items()}
        except Exception:  # noqa: BLE001  (an encoding this reader does not decode: skipped)
            continue
        head_norm = float(torch.sqrt(sum(change[k].float().square().sum() for k in change if HEAD in k.split("."))))
        out.append({
            "delta": d["id"], "device": d["device_name"], "round": d["round"], "base_version": d["base_version"],
            "norm": d["norm"], "head_norm": head_norm, "base_accuracy": base_accuracy,
            "solo_accuracy": _accuracy(models, solo, test)[0],
        })  # fmt: skip
    return out
