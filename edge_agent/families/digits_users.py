"""Digits devices that differ as users do: each sees the digits through its own sensor and vocabulary.

A label mix alone (Dirichlet shards) leaves a well-trained shared model little to gain on any one device. Real
users also differ in how their inputs look (a sensor's or a writer's baseline) and in what some labels mean to
them. A ``UserProfile`` describes one device's difference, fixed for the device's life:

- ``rotation`` (degrees), ``scale`` and ``shift`` of the image (one affine warp), then ``contrast`` and
  ``brightness`` of its pixels (clipped to [0, 1]): the ``feature`` scenario;
- ``swaps``: pairs of labels this user names the other way round: the ``concept`` scenario.

``profile_for(scenario, index, seed)`` draws a device's profile; ``SCENARIOS`` names them (``label`` is the
identity, ``mixed`` gives a third of the devices each of the other three, as the demo fleet does). The data
split used for a factory-trained base is ``factory_split``: a stratified "factory" part the base is trained on
centrally, and the pool devices draw their shards from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

SCENARIOS = ("label", "feature", "concept", "mixed")
MAX_ROTATION = 60.0


@dataclass(frozen=True)
class UserProfile:
    rotation: float = 0.0
    scale: float = 1.0
    shift: tuple[float, float] = (0.0, 0.0)  # in half-image units (affine_grid's coordinates)
    contrast: float = 1.0
    brightness: float = 0.0
    swaps: tuple[tuple[int, int], ...] = field(default_factory=tuple)

    @property
    def is_identity(self) -> bool:
        return self == UserProfile()

    def as_dict(self) -> dict:
        return {k: (list(map(list, v)) if k == "swaps" else list(v) if k == "shift" else v)
                for k, v in asdict(self).items()}  # fmt: skip

    @classmethod
    def from_dict(cls, values: dict) -> UserProfile:
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown profile fields {sorted(unknown)}")
        values = dict(values)
        if "shift" in values:
            values["shift"] = tuple(float(v) for v in values["shift"])
        if "swaps" in values:
            values["swaps"] = tuple((int(a), int(b)) for a, b in values["swaps"])
        return cls(**values)

    def label_map(self, num_classes: int = 10) -> np.ndarray:
        mapping = np.arange(num_classes)
        for a, b in self.swaps:
            mapping[a], mapping[b] = b, a
        return mapping


def _feature(rng: np.random.Generator) -> dict:
    return {
        "rotation": float(rng.uniform(-MAX_ROTATION, MAX_ROTATION)),
        "scale": float(rng.uniform(0.8, 1.2)),
        "shift": (float(rng.uniform(-0.15, 0.15)), float(rng.uniform(-0.15, 0.15))),
        "contrast": float(rng.uniform(0.5, 1.5)),
        "brightness": float(rng.uniform(-0.1, 0.2)),
    }


def _concept(rng: np.random.Generator) -> dict:
    a, b, c, d = (int(v) for v in rng.choice(10, size=4, replace=False))
    return {"swaps": ((a, b), (c, d))}


def profile_for(scenario: str, index: int, *, seed: int = 0) -> UserProfile:
    """Device ``index``'s profile in ``scenario``, fixed by ``seed`` (the same device gets the same one)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}: use one of {list(SCENARIOS)}")
    rng = np.random.default_rng([seed, index, 2718])
    if scenario == "mixed":
        scenario = SCENARIOS[index % 3]
    if scenario == "feature":
        return UserProfile(**_feature(rng))
    if scenario == "concept":
        return UserProfile(**_concept(rng))
    return UserProfile()


def view(x, profile: UserProfile) -> torch.Tensor:
    """Images ``[N, 1, H, W]`` in [0, 1] as this user's sensor sees them."""
    x = torch.as_tensor(x, dtype=torch.float32)
    if profile.rotation or profile.scale != 1.0 or any(profile.shift):
        angle = np.deg2rad(profile.rotation)
        cos, sin = np.cos(angle) / profile.scale, np.sin(angle) / profile.scale
        theta = torch.tensor([[cos, -sin, profile.shift[0]], [sin, cos, profile.shift[1]]], dtype=torch.float32).expand(
            len(x), 2, 3
        )
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        x = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    if profile.contrast != 1.0 or profile.brightness:
        x = (x * profile.contrast + profile.brightness).clamp(0.0, 1.0)
    return x.contiguous()


def relabel(y, profile: UserProfile) -> torch.Tensor:
    y = torch.as_tensor(y, dtype=torch.int64)
    return torch.as_tensor(profile.label_map(), dtype=torch.int64)[y] if profile.swaps else y.clone()


def user_data(data: dict, profile: UserProfile) -> dict:
    """A ``{"x", "y"}`` data set as this user sees and labels it."""
    return {**data, "x": view(data["x"], profile), "y": relabel(data["y"], profile)}


def factory_split(labels, *, fraction: float = 0.3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(factory, pool)`` index arrays: a stratified ``fraction`` of every class for the central base, the rest
    for devices. Deterministic from ``seed``; every index in exactly one part."""
    if not 0 < fraction < 1:
        raise ValueError("fraction must be between 0 and 1")
    labels = np.asarray(labels)
    rng = np.random.default_rng([seed, 31415])
    factory = []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        factory.extend(members[: max(1, round(len(members) * fraction))].tolist())
    factory = np.sort(np.asarray(factory, dtype=np.int64))
    pool = np.setdiff1d(np.arange(len(labels)), factory)
    return factory, pool
