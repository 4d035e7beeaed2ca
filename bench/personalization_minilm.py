"""A smaller run of the personalization benchmark on ``minilm-text``: the product's methods through the agent's
own code (``bench/personalization_product.py``) on a MiniLM fleet whose users differ as people do.

Each device holds template sentences (``toy_texts``) with its own topic mix (Dirichlet over the four
``TOPICS``, distinct sentences within a device), a random quarter of them its local test slice. Half the
devices (chosen by the seed) are "concept" users: they name their two most frequent topics the other way
round (those two labels swapped, in training and test data alike).

Version 1: the pretrained encoder, a fresh LoRA (the family's default shape: rank 4 on its default targets) and
a head trained "at the factory" in plain torch on a small central set of sentences (``pretrain`` on the frozen encoder's
pooled embeddings). Then the product's federated run exactly as for digits (``personalization_product``: shared
passes with ``train_adapter``, FedAvg, each device's ``personalize`` pass) for ditto, finetune and
private_modules with ``PERSONALIZATION_DEFAULTS`` (``--personal-epochs`` and ``--personal-lambda`` override
its ``epochs`` and ``lambda``). ``personalization_product`` names its family and LoRA targets as module globals
(digits); they are set to MiniLM's for the run (``minilm_family``) and restored after it.

Reported per row, for all devices and for the plain and concept devices apart, as mean +- standard deviation
over the seeds: mean and 10th percentile of the per-device accuracies on the local test slices, the share of
devices better than version 1 and not worse (at most one test sample below it), the personal model's mean and
the share of devices serving their personal model. Prints Markdown; ``--json PATH`` keeps the per-device figures.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import personalization_product as product
import torch
from personalization import ROOT, _cell, device_stats, summarize
from personalization_data import Config
from personalization_methods import METHODS, Result
from torch import nn

from edge_agent.families import default_shape
from edge_agent.families.common import pretrain
from edge_agent.families.minilm import TOPICS, MiniLMText, tokenize, toy_texts
from edge_agent.lora_layers import adapter_tensors
from edge_agent.samples import device_split
from training.registry.personalization_settings import PERSONALIZATION_DEFAULTS

FAMILY = MiniLMText()
ROWS = (
    "version1",
    "product-shared",
    "product-ditto",
    "product-ditto_pull_all",
    "product-finetune",
    "product-private_modules",
)
GROUPS = {"all": "all devices", "plain": "plain devices", "concept": "concept devices (two topics swapped)"}
COLUMNS = (("mean acc", "mean"), ("10th pct acc", "p10"), ("better than v1", "better"),
           ("not worse than v1", "not_worse"), ("personal model mean acc", "personal_mean"),
           ("served personal", "serving_personal_mean"), ("shared version mean acc", "shared_mean"))  # fmt: skip


@dataclass(frozen=True)
class Settings:
    devices: int = 6
    rounds: int = 3
    sentences: int = 40  # per device, before its test slice
    test_share: float = 0.25
    topic_alpha: float = 0.5  # Dirichlet over the topics, per device
    concept_share: float = 0.5  # devices that swap their two most frequent topics
    max_length: int = 16  # tokens (the template sentences have at most 9)
    local_epochs: int = 1  # the shared pass, per round
    personal_epochs: int = PERSONALIZATION_DEFAULTS["epochs"]  # the product's; lower it for time
    personal_lambda: float = PERSONALIZATION_DEFAULTS["lambda"]  # the product's Ditto pull
    factory_sentences: int = 48
    factory_epochs: int = 20
    factory_lr: float = 0.01

    def product_config(self) -> Config:
        """The product rows' settings (lr 0.01, micro-batch 16, clip 1, the family's LoRA rank and alpha: the
        references')."""
        rank, alpha = default_shape(FAMILY)
        return Config(devices=self.devices, rounds=self.rounds, local_epochs=self.local_epochs, rank=rank, alpha=alpha,
                      product_epochs=self.personal_epochs, product_lambda=self.personal_lambda)  # fmt: skip


@dataclass
class TextSplit:
    """What ``personalization_product`` reads of a split (``seed``, ``scenario``, ``config``, ``cache``), with
    the devices' data (``{"train", "test"}`` of token ids, masks and labels) and who they are."""

    seed: int
    config: Config
    devices: list[dict]
    concept: np.ndarray  # bool per device
    profiles: list[dict]
    scenario: str = "minilm-text"
    cache: dict = field(default_factory=dict)


@contextlib.contextmanager
def minilm_family():
    """``personalization_product``'s family and LoRA targets (digits, module globals) as MiniLM's, for a run."""
    saved = product.FAMILY, product.TARGETS, product.SAVED
    product.FAMILY, product.TARGETS, product.SAVED = FAMILY, FAMILY.default_targets, FAMILY.default_modules_to_save
    try:
        yield
    finally:
        product.FAMILY, product.TARGETS, product.SAVED = saved


def _encode(texts: list[str], labels: list[int], settings: Settings) -> dict:
    return {**tokenize(texts, max_length=settings.max_length), "y": torch.tensor(labels, dtype=torch.int64)}


def device_data(seed: int, device: int, concept: bool, settings: Settings) -> tuple[dict, dict, dict]:
    """One user's sentences in arrival order (train, test) and profile: a topic mix, distinct sentences per
    topic (``toy_texts`` of that topic, deduplicated), and for a concept user its two most frequent topics
    swapped."""
    rng = np.random.default_rng([seed, device, 2525])
    mix = rng.dirichlet(np.full(len(TOPICS), settings.topic_alpha))
    pools = [list(dict.fromkeys(toy_texts(256, seed=seed * 1009 + device * 17 + t, topics=(name,))[0]))
             for t, name in enumerate(TOPICS)]  # fmt: skip
    texts, labels = [], []
    for _ in range(settings.sentences):
        left = np.asarray([len(pool) > 0 for pool in pools], dtype=float) * mix
        topic = int(rng.choice(len(TOPICS), p=left / left.sum()))
        texts.append(pools[topic].pop())
        labels.append(topic)
    counts = np.bincount(labels, minlength=len(TOPICS))
    swap = sorted(int(t) for t in np.argsort(-counts, kind="stable")[:2]) if concept else []
    if swap:
        labels = [swap[1] if y == swap[0] else swap[0] if y == swap[1] else y for y in labels]
    order = rng.permutation(len(texts))
    n_test = max(1, round(settings.test_share * len(texts)))
    parts = [_encode([texts[i] for i in index], [labels[i] for i in index], settings)
             for index in (order[n_test:], order[:n_test])]  # fmt: skip
    profile = {"mix": [round(float(p), 3) for p in mix], "counts": counts.tolist(), "concept": concept, "swap": swap}
    return parts[0], parts[1], profile


def make_split(seed: int, settings: Settings) -> TextSplit:
    concept = np.zeros(settings.devices, dtype=bool)
    chosen = np.random.default_rng([seed, 3131]).permutation(settings.devices)
    concept[chosen[: round(settings.concept_share * settings.devices)]] = True
    devices, profiles = [], []
    for d in range(settings.devices):
        train, test, profile = device_data(seed, d, bool(concept[d]), settings)
        devices.append({"train": train, "test": test})
        profiles.append(profile)
    return TextSplit(seed, settings.product_config(), devices, concept, profiles)


def factory_base(encoder: nn.Module, seed: int, settings: Settings) -> nn.Module:
    """Version 1's base: the pretrained encoder and a head trained centrally in plain torch (Adam, ``pretrain``)
    on the frozen encoder's pooled embeddings of a small set of sentences with their plain topic labels."""
    base = copy.deepcopy(encoder).eval()
    torch.manual_seed(seed)
    base.head.reset_parameters()
    texts, labels = toy_texts(settings.factory_sentences, seed=seed * 7 + 1000)
    data = _encode(texts, labels, settings)
    head, base.head = base.head, nn.Identity()
    with torch.no_grad():
        pooled = base(data["input_ids"], data["attention_mask"])
    base.head = head
    pretrain(head, {"input": pooled, "y": data["y"]}, epochs=settings.factory_epochs, lr=settings.factory_lr,
             batch_size=16, seed=seed)  # fmt: skip
    return base.eval()


class TextDevices(product.Devices):
    """``personalization_product.Devices`` on MiniLM: its ``build`` and ``accuracy``, this split's base and data."""

    def __init__(self, split: TextSplit, base: nn.Module):
        self.split, self.base = split, base
        self.version1 = adapter_tensors(self.build(None, seed=split.seed))
        self.local = [device_split(d["train"]) for d in split.devices]
        self.tests = [d["test"] for d in split.devices]


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_seed(seed: int, settings: Settings, encoder: nn.Module) -> list[dict]:
    began = time.monotonic()
    split = make_split(seed, settings)
    fleet = TextDevices(split, factory_base(encoder, seed, settings))
    split.cache["product-devices"] = fleet
    v1 = fleet.accuracy([fleet.version1] * settings.devices)
    n_test = np.asarray([len(t["y"]) for t in fleet.tests], dtype=float)
    masks = {"all": np.ones_like(split.concept), "plain": ~split.concept, "concept": split.concept}
    _log(f"[seed {seed}] version 1 ({time.monotonic() - began:.1f} s): plain {v1[~split.concept].mean():.3f}, "
         f"concept {v1[split.concept].mean():.3f}")  # fmt: skip
    runs, per_device = [], {}
    for name in ROWS:
        started = time.monotonic()
        result = Result(v1) if name == "version1" else METHODS[name].fn(split)
        acc = np.asarray(result.accuracy, dtype=float)
        for group, mask in masks.items():
            stats = device_stats(acc[mask], v1[mask], n_test[mask])
            stats.update({f"{k}_mean": float(np.nanmean(np.asarray(v)[mask])) for k, v in result.extras.items()})
            runs.append({"scenario": group, "seed": seed, "method": name, "table": "personalization", "stats": stats})
        per_device[name] = {
            "accuracy": acc.tolist(),
            **{k: np.asarray(v, float).tolist() for k, v in result.extras.items()},
        }
        _log(f"[seed {seed}] {name}: {acc.mean():.3f} ({time.monotonic() - started:.1f} s)")
    runs.append({"scenario": "_split", "seed": seed, "method": "_split", "version1": v1.tolist(),
                 "test_samples": n_test.tolist(), "train_samples": [len(d["train"]["y"]) for d in split.devices],
                 "profiles": split.profiles, "rows": per_device})  # fmt: skip
    return runs


def table(rows: list[dict], group: str) -> list[str]:
    lines = ["| row | " + " | ".join(header for header, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    picked = [row for row in rows if row["scenario"] == group]
    return lines + [
        "| " + " | ".join([row["method"], *(_cell(row.get(k)) for _, k in COLUMNS)]) + " |" for row in picked
    ]


def report(data: dict) -> None:
    settings = data["settings"]
    print(
        f"\n## Personalization, minilm-text (smaller run): {settings['devices']} devices, {settings['rounds']} rounds\n"
    )
    print(f"`{data['command']}`\n")
    for group, title in GROUPS.items():
        print(f"### {title}\n\n" + "\n".join(table(data["rows"], group)) + "\n")
    print(
        f"Mean ± standard deviation over seeds {data['seeds']}. Accuracy per device on its local test slice; mean and "
        "10th percentile over devices; better = above version 1 on that device; not worse = at most one test sample "
        "below it; served personal = share of devices whose served model is their personal one."
    )
    print(
        f"\n{data['seconds'] / 60:.1f} min wall ({data['cpu_seconds'] / 60:.1f} min of CPU); load average "
        f"{data['load_before'][0]:.2f} before, {data['load_after'][0]:.2f} after; torch {data['torch']}, "
        f"{data['threads']} thread(s). Settings: {json.dumps(settings)}; personalization: "
        f"{json.dumps(data['personalization'])}; shared pass: {json.dumps(data['shared_pass'])}"
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds (a fleet, a factory head, training)")
    for name, value in asdict(Settings()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "personalization_minilm.json")
    parser.add_argument("--from-json", type=Path, help="print the tables of an earlier run's JSON file")
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.settings = Settings(**{name: getattr(args, name) for name in asdict(Settings())})
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        report(json.loads(args.from_json.read_text()))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    command = ".venv/bin/python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    began, cpu, load_before = time.monotonic(), time.process_time(), os.getloadavg()
    encoder = FAMILY.build({"seed": 0, "num_classes": len(TOPICS)})
    runs = []
    with minilm_family():
        for seed in args.seeds:
            runs += run_seed(seed, args.settings, encoder)
    config = args.settings.product_config()
    data = {
        "command": command, "seconds": time.monotonic() - began, "cpu_seconds": time.process_time() - cpu,
        "load_before": load_before, "load_after": os.getloadavg(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "seeds": args.seeds, "settings": asdict(args.settings),
        "personalization": {k: v for k, v in {**PERSONALIZATION_DEFAULTS, **config.product_overrides()}.items()
                            if k != "method"},
        "shared_pass": {k: getattr(config, k) for k in ("lr_lora", "batch", "clip", "rank", "alpha")},
        "rows": summarize([r for r in runs if r["method"] != "_split"]), "runs": runs,
    }  # fmt: skip
    report(data)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1))
    _log(f"wrote {os.path.relpath(args.json, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
