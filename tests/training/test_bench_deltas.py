"""The aggregation benchmark's delta files (bench/aggregation_data.py) are what a device would upload: each one's
envelope passes the protocol's schema and its signature, and its contents pass the server's own one-pass check
with the norm the values give. The benchmark times that check, so files the server would refuse measure nothing
(bench/README.md, "aggregation.py")."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench_modules(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import aggregation_data
    import aggregation_methods

    monkeypatch.setattr(aggregation_data, "CACHE", tmp_path / "cache")
    yield aggregation_data, aggregation_methods
    for name in ("aggregation_data", "aggregation_methods"):
        sys.modules.pop(name, None)


def test_the_benchmarks_deltas_pass_the_servers_checks_with_the_norm_their_values_give(bench_modules):
    data, methods = bench_modules
    size = data.parse_size("3x2K")
    assert data.ensure(size, log=lambda *a, **k: None) == 3
    assert data.ensure(size, log=lambda *a, **k: None) == 0  # cached
    spec = methods.spec_of(size)
    adapter = SimpleNamespace(tensor_spec=spec, aggregation={}, dp={})
    for index, (path, sidecar_path) in enumerate(zip(size.paths(), size.sidecars(), strict=True)):
        sidecar = json.loads(sidecar_path.read_text())
        envelope = methods.check_envelope(sidecar)  # the schema (device id, adapter name, ...) and the signature
        assert envelope["num_samples"] == data.num_samples(index)
        norm = methods.verify_product(str(path), sidecar, adapter)
        values = np.concatenate([v.ravel().astype(np.float64) for v in load_file(str(path)).values()])
        assert norm == pytest.approx(math.sqrt(float(values @ values)), rel=1e-6)  # float32's precision
    methods.floor_pass([str(p) for p in size.paths()], [json.loads(p.read_text()) for p in size.sidecars()])
