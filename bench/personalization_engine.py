"""Training every device at once for the personalization references (``bench/personalization.py``), in plain
torch: DigitsNet written as a function of its parameters (with optional LoRA on ``conv2`` and ``fc1``), and
``torch.vmap`` over a leading device dimension of the trainable parameters and of the padded per-device data.

A device's parameters are rows of stacked tensors (``{name: [D, ...]}``). One local step of all devices is one
vmapped gradient over their own mini-batches (padding masked out), then Adam on the stacked tensors; a device
whose data is used up for this epoch (fewer samples than others) is inactive and does not step, so each
device does ``ceil(n / batch)`` steps per epoch, as it would alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from personalization_data import Config, Padded
from torch.func import grad, vmap

from edge_agent.families.digits import DigitsCNN

BASE_KEYS = (
    *("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"),
    *("fc1.weight", "fc1.bias", "head.weight", "head.bias"),
)
HEAD_KEYS = ("head.weight", "head.bias")


def _conv_lora(params: dict, layer: str, h: torch.Tensor, z: torch.Tensor, scaling: float) -> torch.Tensor:
    if f"{layer}.lora_A" not in params:
        return z
    return z + scaling * F.conv2d(F.conv2d(h, params[f"{layer}.lora_A"], padding=1), params[f"{layer}.lora_B"])


def forward(params: dict[str, torch.Tensor], x: torch.Tensor, scaling: float) -> torch.Tensor:
    """DigitsNet's logits for images ``x [N, 1, 8, 8]``; with ``<layer>.lora_A`` / ``<layer>.lora_B`` present,
    that layer (``conv1``, ``conv2`` or ``fc1``) adds ``scaling * B(A(input))`` (A a 3x3 convolution to ``rank``
    channels and B 1x1 on a convolution, both linear on ``fc1``)."""
    z = _conv_lora(params, "conv1", x, F.conv2d(x, params["conv1.weight"], params["conv1.bias"], padding=1), scaling)
    h = torch.max_pool2d(torch.relu(z), 2)
    z = _conv_lora(params, "conv2", h, F.conv2d(h, params["conv2.weight"], params["conv2.bias"], padding=1), scaling)
    h = torch.max_pool2d(torch.relu(z), 2).flatten(1)
    z = F.linear(h, params["fc1.weight"], params["fc1.bias"])
    if "fc1.lora_A" in params:
        z = z + scaling * F.linear(F.linear(h, params["fc1.lora_A"]), params["fc1.lora_B"])
    return F.linear(torch.relu(z), params["head.weight"], params["head.bias"])


@dataclass
class Form:
    """What a reference trains: ``full`` (every parameter) or ``lora`` (the LoRA tensors and the head; the
    rest of the base frozen). ``start`` is version 1's trainable part, unbatched."""

    name: str
    frozen: dict[str, torch.Tensor]
    start: dict[str, torch.Tensor]
    scaling: float

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.start)


def make_form(name: str, base_state: dict[str, torch.Tensor], config: Config, seed: int) -> Form:
    base = {key: base_state[key].detach().clone() for key in BASE_KEYS}
    if name == "full":
        return Form(name, {}, base, 1.0)
    if name != "lora":
        raise ValueError(f"unknown form {name!r}")
    generator = torch.Generator().manual_seed(seed * 31 + 5)
    start = {}
    for layer in DigitsCNN.default_targets:  # the family's default shape, as the product's adapter
        weight = base[f"{layer}.weight"]
        a_shape = (config.rank, *weight.shape[1:])
        b_shape = (weight.shape[0], config.rank, *([1, 1] if weight.dim() == 4 else []))
        bound = 1 / math.sqrt(math.prod(a_shape[1:]))  # Kaiming-uniform (a = sqrt 5), as PEFT starts A
        start[f"{layer}.lora_A"] = torch.empty(a_shape).uniform_(-bound, bound, generator=generator)
        start[f"{layer}.lora_B"] = torch.zeros(b_shape)  # zero: version 1 is the base itself
    start.update({key: base.pop(key) for key in HEAD_KEYS})
    return Form(name, base, start, config.alpha / config.rank)


def broadcast(params: dict[str, torch.Tensor], devices: int) -> dict[str, torch.Tensor]:
    """One model as every device's copy (stacked)."""
    return {key: value.unsqueeze(0).repeat(devices, *([1] * value.dim())) for key, value in params.items()}


def weighted_mean(stacked: dict[str, torch.Tensor], weights: torch.Tensor, keys=None) -> dict[str, torch.Tensor]:
    """FedAvg: the sample-weighted mean over devices of ``keys`` (default all)."""
    w = weights.double() / weights.double().sum()
    return {
        key: (value.double() * w.view(-1, *([1] * (value.dim() - 1)))).sum(0).float()
        for key, value in stacked.items()
        if keys is None or key in keys
    }


def _device_loss(trainable, frozen, x, y, mask, anchor, lam, scaling):
    logits = forward({**frozen, **trainable}, x, scaling)
    loss = (F.cross_entropy(logits, y, reduction="none") * mask).sum() / mask.sum().clamp(min=1)
    if anchor is not None:  # Ditto's proximal pull toward the shared model
        loss = loss + lam / 2 * sum(((trainable[k] - anchor[k]) ** 2).sum() for k in trainable)
    return loss


_grads = vmap(grad(_device_loss), in_dims=(0, None, 0, 0, 0, 0, None, None))
_grads_no_anchor = vmap(grad(_device_loss), in_dims=(0, None, 0, 0, 0, None, None, None))


class Adam:
    """Adam on stacked parameters with a step count per device; a step updates the given rows (devices) only."""

    def __init__(self, params: dict[str, torch.Tensor], lr: float, betas=(0.9, 0.999), eps=1e-8):
        self.lr, self.betas, self.eps = lr, betas, eps
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}
        self.t = torch.zeros(next(iter(params.values())).shape[0])

    def step(self, params: dict, grads: dict, rows: torch.Tensor) -> None:
        """In place: ``params[k][rows]`` take one step along ``grads[k]`` (``[len(rows), ...]``)."""
        b1, b2 = self.betas
        self.t[rows] += 1
        for key, value in params.items():
            t = self.t[rows].view(-1, *([1] * (value.dim() - 1)))
            m = b1 * self.m[key][rows] + (1 - b1) * grads[key]
            v = b2 * self.v[key][rows] + (1 - b2) * grads[key].square()
            self.m[key][rows], self.v[key][rows] = m, v
            value[rows] -= self.lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + self.eps)


def _clip(grads: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads.values()))
    factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return {k: g * factor.view(-1, *([1] * (g.dim() - 1))) for k, g in grads.items()}


def local_train(
    form: Form,
    params: dict[str, torch.Tensor],
    data: Padded,
    epochs: int,
    config: Config,
    generator: torch.Generator,
    *,
    anchor: dict[str, torch.Tensor] | None = None,
    lam: float = 0.0,
    replay: Padded | None = None,
) -> dict[str, torch.Tensor]:
    """Every device trains its row of ``params`` for ``epochs`` passes over its own data (shuffled mini-batches
    of ``config.batch``), with a fresh Adam. ``anchor`` (stacked): Ditto's proximal term ``lam / 2 ||p - a||^2``.
    ``replay``: each batch also carries ``replay_share`` of replayed samples, drawn with replacement from the
    device's reservoir."""
    params = {k: v.clone() for k, v in params.items()}
    optimizer = Adam(params, config.lr(form.name))
    devices, width = data.y.shape
    batch = config.batch
    extra = round(batch * config.replay_share / (1 - config.replay_share)) if replay is not None else 0
    for _ in range(epochs):
        keys = torch.rand(devices, width, generator=generator).masked_fill(~data.mask, 2.0)
        order = keys.argsort(1)  # each device's own samples first, in a random order
        steps = math.ceil(int(data.n.max()) / batch)
        order = F.pad(order, (0, max(0, steps * batch - width)))
        for step in range(steps):
            rows = torch.nonzero(data.n > step * batch).flatten()  # devices with samples left this epoch
            if not len(rows):
                break
            positions = torch.arange(step * batch, (step + 1) * batch)
            index = order[rows][:, positions]
            mask = (positions[None, :] < data.n[rows, None]).float()
            x, y = data.x[rows[:, None], index], data.y[rows[:, None], index]
            if extra:
                pick = (torch.rand(len(rows), extra, generator=generator) * replay.n[rows, None]).long()
                x = torch.cat([x, replay.x[rows[:, None], pick]], 1)
                y = torch.cat([y, replay.y[rows[:, None], pick]], 1)
                mask = torch.cat([mask, (replay.n[rows, None] > 0).float().expand(len(rows), extra)], 1)
            own = {k: v[rows] for k, v in params.items()}
            if anchor is None:
                grads = _grads_no_anchor(own, form.frozen, x, y, mask, None, lam, form.scaling)
            else:
                grads = _grads(own, form.frozen, x, y, mask, {k: v[rows] for k, v in anchor.items()}, lam, form.scaling)
            if config.clip:
                grads = _clip(grads, config.clip)
            optimizer.step(params, grads, rows)
    return params


@torch.no_grad()
def accuracy(form: Form, params: dict[str, torch.Tensor], data: Padded) -> torch.Tensor:
    """Per-device accuracy ``[D]`` of each device's model (row of ``params``) on its own samples of ``data``;
    NaN for a device without samples."""
    predict = vmap(lambda p, x: forward({**form.frozen, **p}, x, form.scaling).argmax(-1), in_dims=(0, 0))
    correct = ((predict(params, data.x) == data.y) & data.mask).sum(1).double()
    return correct / data.n.double()
