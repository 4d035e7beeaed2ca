"""The harsh split of issue 47 over scikit-learn's bundled digits (nothing downloaded).

Only the devices' pool is used (the digits train part less the demo's factory share, ``FACTORY_FRACTION``, that
the base was trained on); the server's evaluation set (the test part) is never a device's. The pool is cut once,
stratified, into a part the devices' own samples come from and a test reserve their held-out TEST sets come from,
so no image a device's test set holds is in any agent's store.

Per seed: labels over devices by Dirichlet(alpha) (``dirichlet_shards``: 2 to 3 dominant classes a device at
0.2); a third of the devices see through their own sensor (a fixed Gaussian blur, a brightness gain and a
one-pixel shift), a third name three digits their own way (a 3-cycle of labels, one of them among the device's
own dominant classes so it matters to it), the rest differ only in label mix; a tenth (at least one) hold fewer
than 10 samples. A device's test set has its label mix (the proportions of its Dirichlet shard), its sensor and its
names, and at least ``MIN_TEST`` samples, the small devices included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from edge_agent.families.common import dirichlet_shards
from edge_agent.families.digits import load_split
from edge_agent.families.digits_users import factory_split

FACTORY_FRACTION = 0.03  # demo.fleet_demo.FACTORY_FRACTION (not imported: that module needs Django)
TEST_RESERVE = 0.3  # of the pool, stratified: where the devices' test sets are drawn from
MIN_TEST, MAX_TEST = 30, 120
GROUPS = ("label", "feature", "concept")


@dataclass
class DeviceData:
    index: int
    group: str  # label / feature / concept
    small: bool  # one of the tenth that holds fewer than 10 samples
    train: dict  # what the application hands the agent: {"x": float32 [n,1,8,8], "y": int64 [n]} as the user sees it
    test: dict  # held out, never handed to the agent; same view and names
    transform: dict = field(default_factory=dict)  # feature: {"sigma", "gain", "shift"}
    cycle: list[int] = field(default_factory=list)  # concept: a -> b -> c -> a
    classes: dict = field(default_factory=dict)  # label -> count in the device's Dirichlet shard (true digits)

    def describe(self) -> str:
        if self.group == "feature":
            t = self.transform
            return f"blur {t['sigma']:.2f}, gain {t['gain']:.2f}, shift {tuple(t['shift'])}"
        if self.group == "concept":
            a, b, c = self.cycle
            return f"names {a}->{b}, {b}->{c}, {c}->{a}"
        return "label mix only"


def blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    radius = 2
    grid = torch.arange(-radius, radius + 1, dtype=torch.float32)
    kernel1 = torch.exp(-(grid**2) / (2 * sigma**2))
    kernel1 = kernel1 / kernel1.sum()
    kernel = (kernel1[:, None] * kernel1[None, :])[None, None]
    return F.conv2d(F.pad(x, (radius,) * 4, mode="replicate"), kernel)


def sensor(x: np.ndarray, transform: dict) -> np.ndarray:
    """Images [N,1,8,8] in [0, 1] as this device's sensor sees them: blur, then gain, then a one-pixel shift."""
    if not transform:
        return x
    out = blur(torch.as_tensor(x, dtype=torch.float32), transform["sigma"])
    out = (out * transform["gain"]).clamp(0.0, 1.0)
    dy, dx = transform["shift"]
    out = torch.roll(out, shifts=(dy, dx), dims=(2, 3))
    if dy:  # no wrap-around: the row or column that came in is empty
        out[:, :, 0 if dy > 0 else -1, :] = 0.0
    if dx:
        out[:, :, :, 0 if dx > 0 else -1] = 0.0
    return out.numpy().astype(np.float32)


def rename(y: np.ndarray, cycle: list[int]) -> np.ndarray:
    if not cycle:
        return y
    mapping = np.arange(10)
    a, b, c = cycle
    mapping[a], mapping[b], mapping[c] = b, c, a
    return mapping[y]


def make_split(seed: int, devices: int, alpha: float, *, small_share: float = 0.1) -> list[DeviceData]:
    train, _ = load_split()
    x_all, y_all = train["x"].numpy(), train["y"].numpy()
    _, pool = factory_split(y_all, fraction=FACTORY_FRACTION, seed=0)  # the factory part: the base's, not theirs
    rng = np.random.default_rng([seed, 47])
    own, reserve = [], []
    for label in range(10):
        members = rng.permutation(pool[y_all[pool] == label])
        cut = round(len(members) * TEST_RESERVE)
        reserve.extend(members[:cut].tolist())
        own.extend(members[cut:].tolist())
    own, reserve = np.asarray(sorted(own)), np.asarray(sorted(reserve))
    shards = [own[s] for s in dirichlet_shards(y_all[own], devices, alpha, seed)]

    order = rng.permutation(devices)
    groups = [""] * devices
    third = devices // 3
    for rank, d in enumerate(order):
        groups[d] = "feature" if rank < third else "concept" if rank < 2 * third else "label"
    n_small = max(1, math.floor(devices * small_share + 1e-9))
    sizes = np.asarray([len(s) for s in shards])
    # the small devices: drawn among those whose shard has at least 10 samples (so they have classes to show)
    candidates = [d for d in rng.permutation(devices) if sizes[d] >= 10] or list(range(devices))
    small = {int(d) for d in candidates[:n_small]}

    reserve_by_class = {label: rng.permutation(reserve[y_all[reserve] == label]) for label in range(10)}
    out = []
    for d in range(devices):
        shard = rng.permutation(shards[d])
        counts = np.bincount(y_all[shard], minlength=10)
        transform, cycle = {}, []
        if groups[d] == "feature":
            gain = float(rng.choice([rng.uniform(0.5, 0.75), rng.uniform(1.3, 1.7)]))
            shifts = [(a, b) for a in (-1, 0, 1) for b in (-1, 0, 1) if (a, b) != (0, 0)]
            transform = {"sigma": float(rng.uniform(0.6, 1.0)), "gain": gain,
                         "shift": [int(v) for v in shifts[rng.integers(len(shifts))]]}  # fmt: skip
        elif groups[d] == "concept":
            dominant = [int(c) for c in np.argsort(-counts)[:2] if counts[c]]
            first = int(rng.choice(dominant)) if dominant else int(rng.integers(10))
            others = [int(c) for c in rng.choice([c for c in range(10) if c != first], size=2, replace=False)]
            cycle = [first, *others]
        keep = shard[: int(rng.integers(3, 10))] if d in small else shard
        # test set: the device's label mix (of its whole shard), from the reserve
        size = int(np.clip(round(0.5 * len(shard)), MIN_TEST, MAX_TEST))
        share = counts / max(counts.sum(), 1)
        want = np.floor(share * size).astype(int)
        for c in np.argsort(-(share * size - want))[: size - want.sum()]:
            want[c] += 1
        test_idx = []
        for label in range(10):
            members = reserve_by_class[label]
            test_idx.extend(members[: min(int(want[label]), len(members))].tolist())
            reserve_by_class[label] = np.roll(members, -int(want[label]))  # the next device starts elsewhere
        test_idx = np.asarray(test_idx, dtype=np.int64)

        def view(index, transform=transform, cycle=cycle):
            return {"x": sensor(x_all[index], transform), "y": rename(y_all[index], cycle).astype(np.int64)}

        out.append(DeviceData(index=d, group=groups[d], small=d in small, train=view(keep), test=view(test_idx),
                              transform=transform, cycle=cycle,
                              classes={int(c): int(n) for c, n in enumerate(counts) if n}))  # fmt: skip
    return out
