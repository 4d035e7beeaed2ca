"""Aggregation strategies (README.md, "Deltas, verification and rounds"): pure torch + safetensors, no Django,
no database.

``get_strategy(name).aggregate(inputs, spec=..., base=..., params=...)`` returns the aggregated delta
(float32, every key of ``spec``) to add to ``base``. Strategies split by coordinates (the robust rules; the
mean family without DP: ``by_coordinates``) also offer ``spans``, ``span_partial`` and ``assemble``, and their
``aggregate`` gives the bytes of the spans joined in order; the mean family with DP offers ``partial`` and
``combine``, and its ``aggregate`` is ``combine`` over ``partial`` of consecutive shards (``shards``: over
``shard_size`` inputs, one per worker of ``workers``).

Params every strategy accepts (ignoring those it does not use; unknown names are refused):
``shard_size`` (64), ``workers`` (2), ``chunk_elements`` (1 << 20), ``clip_norm`` (None), ``trim_ratio`` (0.1),
``byzantine`` (None: the largest Krum allows), ``multi_k`` (None: N - f), ``mixing`` (None, or ``"nnm"``:
nearest-neighbour mixing before the robust strategies, see ``robust.py``); and ``dp`` for fedavg, fedbuff
and ffa_lora only (see ``dp.py``).
"""

from __future__ import annotations

from .base import DeltaInput, Strategy, shards
from .mean import FedAvg, FedBuff, FfaLora
from .product import LoraProduct
from .robust import Krum, Median, MultiKrum, TrimmedMean

_CLASSES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (FedAvg, FedBuff, FfaLora, LoraProduct, TrimmedMean, Median, Krum, MultiKrum)
}
STRATEGIES: tuple[str, ...] = tuple(_CLASSES)


def get_strategy(name: str) -> Strategy:
    """A new instance of the named strategy; LookupError listing the known names otherwise."""
    if not isinstance(name, str) or name not in _CLASSES:
        raise LookupError(f"unknown aggregation strategy {name!r}: use one of {', '.join(STRATEGIES)}")
    return _CLASSES[name]()


__all__ = ["STRATEGIES", "DeltaInput", "Strategy", "get_strategy", "shards"]
