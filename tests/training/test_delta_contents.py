"""The one-pass contents check (training/federation/delta_contents.py) reads float deltas a read at a time
across tensor boundaries and int8 deltas a tensor at a time: whatever the reads' sizes, the norm is the
norm of the decoded values (in float64 with the compiled loop, sum_kernel.c; to float32's precision, within
1e-4 of the float64 norm, relative, with torch's float32 products where it is not built: both paths are run
here), a NaN or an infinity is found in the tensor it lies in, and a finite value whose square overflows
float32 is a large norm, not a bad value."""

from __future__ import annotations

import ctypes
import hashlib
import io
import json
import math
import mmap
import struct
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load as load_safetensors

from edge_agent.delta import CLIP_SHARE, clip_to_bound, compute_delta, decode_tensor, encode_delta, read_encoding
from tests.training.forked_checks import ROUNDS
from training.federation import delta_contents
from training.federation.delta_contents import Rejection, contents_check
from training.federation.strategies.kernels import sum_kernel
from training.registry.artifacts import PassedHeaders
from training.registry.blobs import CHUNK, page_aligned
from training.registry.services import adapter_set_aggregation
from training.rollouts.manifests import training_config

ROOT = Path(__file__).resolve().parents[2]

SHAPES = {f"layers.{i}.lora_{ab}.weight": ((4, 33) if ab == "A" else (33, 4)) for i in range(5) for ab in "AB"}


class Trickle(io.RawIOBase):
    """A stored file that hands out at most ``step`` bytes per read, so values straddle reads."""

    def __init__(self, data: bytes, step: int):
        self.data, self.step, self.at = data, step, 0

    def read(self, count: int = -1) -> bytes:
        part = self.data[self.at : self.at + min(self.step, count if count >= 0 else self.step)]
        self.at += len(part)
        return part


class TrickleInto(Trickle):
    """The same, filling the reader's buffer (``readinto``, as a local file does) at most ``step`` bytes a time."""

    def readinto(self, buffer) -> int:
        part = self.read(len(buffer))
        buffer[: len(part)] = part
        return len(part)


@pytest.fixture(params=["compiled", "torch"])
def norm_path(request, monkeypatch):
    """The sum of squares by the compiled loop (the install builds it: this suite requires it), then by torch's
    float32 products, as where no C compiler built it."""
    if request.param == "compiled":
        assert sum_kernel is not None, "training/federation/strategies/sum_kernel.c was not built (make install)"
    else:
        monkeypatch.setattr(delta_contents, "sum_kernel", None)
    return request.param


def _adapter(encoding: str, max_norm: float | None = None):
    dtype = {"f32": "F32", "f16": "F16", "int8": "I8"}[encoding]
    spec = {name: {"shape": list(shape), "dtype": dtype} for name, shape in SHAPES.items()}
    return SimpleNamespace(tensor_spec=spec, aggregation={"max_norm": max_norm}, dp={})


def _tensors(**override) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    tensors = {name: torch.randn(shape, generator=generator) * 0.01 for name, shape in SHAPES.items()}
    return {**tensors, **override}


def _metadata(data: bytes) -> dict:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]).get("__metadata__", {})


def _check(data: bytes, encoding: str, step: int | None, max_norm: float | None = None):
    handle = io.BytesIO(data) if step is None else Trickle(data, step)
    return contents_check(
        handle, size=len(data), sha256=hashlib.sha256(data).hexdigest(), adapter=_adapter(encoding, max_norm)
    )


@pytest.mark.parametrize("encoding", ["f32", "f16", "int8"])
@pytest.mark.parametrize("step", [None, 1, 3, 7, 4096])
def test_the_norm_is_the_decoded_values_norm_whatever_the_reads(encoding, step, norm_path):
    data = encode_delta(_tensors(), encoding=encoding)
    stored = load_safetensors(data)
    _, scales = read_encoding(_metadata(data))
    expected = math.sqrt(
        sum(
            float(decode_tensor(tensor, encoding=encoding, scale=scales.get(name)).double().square().sum())
            for name, tensor in stored.items()
        )
    )
    # Compiled: float64 sums of exact squares. Torch: float32 sums per slice, added in float64 (float32's precision).
    rel = 1e-12 if norm_path == "compiled" else 1e-6
    assert _check(data, encoding, step) == (encoding, pytest.approx(expected, rel=rel))


@pytest.mark.parametrize("encoding", ["f32", "f16"])
@pytest.mark.parametrize("step", [None, 3])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_bad_value_is_found_in_the_tensor_it_lies_in(encoding, step, bad, norm_path):
    names = list(SHAPES)
    target = names[6]
    value = _tensors()[target].clone()
    value[2, 1] = bad
    data = encode_delta(_tensors(**{target: value}), encoding=encoding)
    with pytest.raises(Rejection) as found:
        _check(data, encoding, step)
    assert found.value.code == "not_finite"
    assert found.value.detail == f"tensor {target!r} holds NaN or infinite values"


def test_the_last_value_of_a_tensor_is_found_in_that_tensor_not_the_next(norm_path):
    names = list(SHAPES)
    value = _tensors()[names[3]].clone()
    value[-1, -1] = float("nan")
    with pytest.raises(Rejection, match=repr(names[3])):
        _check(encode_delta(_tensors(**{names[3]: value})), "f32", 5)


def test_a_finite_value_whose_square_overflows_float32_is_a_large_norm_not_a_bad_value(norm_path):
    names = list(SHAPES)
    value = _tensors()[names[1]].clone()
    value[0, 0] = 1e30
    data = encode_delta(_tensors(**{names[1]: value}))
    assert _check(data, "f32", None)[1] == pytest.approx(1e30, rel=1e-6)
    with pytest.raises(Rejection) as found:
        _check(data, "f32", 11, max_norm=10.0)
    assert found.value.code == "norm_too_large"


def test_the_headers_kept_are_few_and_small_the_oldest_dropped_first():
    kept = PassedHeaders(max_entries=2, max_bytes=16)
    kept.keep((b"a" * 8, 100), "first")
    kept.keep((b"b" * 8, 100), "second")
    kept.keep((b"a" * 8, 100), "first again")  # already kept: replaced, nothing dropped
    assert kept.get((b"a" * 8, 100)) == "first again" and kept.get((b"b" * 8, 100)) == "second"
    kept.keep((b"c" * 8, 100), "third")
    assert kept.get((b"a" * 8, 100)) is None  # the oldest, dropped
    assert kept.get((b"c" * 8, 100)) == "third"
    assert kept.get((b"c" * 8, 101)) is None  # the same header in a file of another size is another key
    kept.keep((b"d" * 17, 100), "too large")
    assert kept.get((b"d" * 17, 100)) is None and kept.get((b"b" * 8, 100)) == "second"


@pytest.mark.parametrize("step", [1, 7, 4096])
def test_a_stream_filling_the_readers_buffer_in_short_reads_gives_the_same_answers(step):
    data = encode_delta(_tensors(), encoding="f16")
    want = _check(data, "f16", None)
    sha = hashlib.sha256(data).hexdigest()
    got = contents_check(TrickleInto(data, step), size=len(data), sha256=sha, adapter=_adapter("f16"))
    assert got == (want[0], pytest.approx(want[1], rel=1e-6))  # float32 sums follow the reads' grouping
    with pytest.raises(Rejection) as found:  # and every byte still hashed: one changed is a mismatch
        changed = data[:-1] + bytes([data[-1] ^ 1])
        contents_check(TrickleInto(changed, step), size=len(data), sha256=sha, adapter=_adapter("f16"))
    assert found.value.code == "hash_mismatch"


def test_a_header_seen_before_is_still_checked_against_each_adapter_and_its_values_read_each_time():
    data = encode_delta(_tensors())
    assert _check(data, "f32", None)[0] == "f32"  # its header is now known to pass
    other = _adapter("f32")
    name = next(iter(SHAPES))
    other.tensor_spec[name] = {"shape": [5, 33], "dtype": "F32"}
    with pytest.raises(Rejection) as found:
        contents_check(io.BytesIO(data), size=len(data), sha256=hashlib.sha256(data).hexdigest(), adapter=other)
    assert found.value.code == "spec_mismatch"
    names = list(SHAPES)
    value = _tensors()[names[2]].clone()
    value[0, 0] = float("nan")
    bad = encode_delta(_tensors(**{names[2]: value}))
    assert bad[:64] == data[:64]  # the same header, byte for byte
    with pytest.raises(Rejection, match="not_finite|holds NaN"):
        _check(bad, "f32", None)


def test_a_delta_of_many_reads_and_slices_gives_its_norm_and_finds_a_bad_value_late_in_it():
    # 420,000 values of one tensor: two 1 MiB reads, each several slices.
    big = {"big.lora_A.weight": (600, 700), "small.lora_B.weight": (10, 10)}
    generator = torch.Generator().manual_seed(3)
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in big.items()}
    adapter = SimpleNamespace(
        tensor_spec={name: {"shape": list(shape), "dtype": "F32"} for name, shape in big.items()},
        aggregation={"max_norm": None},
        dp={},
    )
    data = encode_delta(tensors)
    expected = math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))
    sha = hashlib.sha256(data).hexdigest()
    assert contents_check(io.BytesIO(data), size=len(data), sha256=sha, adapter=adapter) == (
        "f32",
        pytest.approx(expected, rel=1e-6),
    )
    tensors["big.lora_A.weight"][500, 3] = float("nan")  # value 350,003: the second read, not its first slice
    data = encode_delta(tensors)
    with pytest.raises(Rejection) as found:
        contents_check(io.BytesIO(data), size=len(data), sha256=hashlib.sha256(data).hexdigest(), adapter=adapter)
    assert found.value.detail == "tensor 'big.lora_A.weight' holds NaN or infinite values"


def test_checks_on_two_threads_at_once_each_read_into_their_own_buffers():
    names = list(SHAPES)
    value = _tensors()[names[4]].clone()
    value[1, 1] = float("inf")
    good, bad = encode_delta(_tensors()), encode_delta(_tensors(**{names[4]: value}))
    want = _check(good, "f32", 64)  # the same reads (the sum's grouping follows them)
    answers: dict[str, list] = {"good": [], "bad": []}

    def check(kind: str, data: bytes) -> None:
        for _ in range(20):
            try:  # short reads, so the two threads take turns inside a check
                answers[kind].append(_check(data, "f32", 64))
            except Rejection as rejection:
                answers[kind].append(rejection.code)

    threads = [threading.Thread(target=check, args=args) for args in (("good", good), ("bad", bad))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == {"good": [want] * 20, "bad": ["not_finite"] * 20}


def test_checks_in_processes_forked_after_the_buffers_were_made_read_into_their_own(tmp_path):
    """Celery's prefork pool imports this module (making the main thread's read buffer) and then forks its
    children, which verify deltas at the same time. A read buffer shared by the forked children (an anonymous
    mapping is shared unless made private) had each child read another's bytes between its read and its hash:
    correctly signed deltas rejected as ``hash_mismatch`` under load (tests/training/forked_checks.py)."""
    ran = subprocess.run(
        [sys.executable, "-m", "tests.training.forked_checks", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    found = json.loads(ran.stdout.strip().splitlines()[-1])
    assert found["exitcodes"] == [0, 0], ran.stderr[-3000:]
    wrong = [answer for answers in found["answers"] for answer in answers if answer != "f32"]
    assert found["answers"] == [["f32"] * 2 * ROUNDS] * 2, wrong


def test_read_buffers_start_on_a_page():
    buffer = page_aligned(CHUNK)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert address % mmap.PAGESIZE == 0 and len(buffer) == CHUNK
    assert len(page_aligned(0)) == 1  # never empty: a view of it is a buffer


@pytest.mark.parametrize("kind", ["nan", "large"])
def test_values_in_place_and_values_copied_first_give_the_same_answers(kind, norm_path):
    # Aligned, writable float32 values are summed where they lie; a read-only or misaligned buffer (a stream's
    # ``read()`` bytes, a value split between reads, a data section at an odd offset) is copied into the
    # thread's float32 slice first. Both give the same norm, the same large-norm fallback and the same name.
    names = list(SHAPES)
    value = _tensors()[names[7]].clone()
    value[3, 2] = float("nan") if kind == "nan" else 3e20  # 3e20 squared is past float32's range
    data = encode_delta(_tensors(**{names[7]: value}))
    sha = hashlib.sha256(data).hexdigest()
    answers = []
    for handle in (io.BytesIO(data), Trickle(data, 1 << 20)):  # readinto a page-aligned buffer; read() bytes
        try:
            answers.append(contents_check(handle, size=len(data), sha256=sha, adapter=_adapter("f32")))
        except Rejection as rejection:
            answers.append((rejection.code, rejection.detail))
    if kind == "nan":
        assert answers == [("not_finite", f"tensor {names[7]!r} holds NaN or infinite values")] * 2
    else:
        assert answers[0] == answers[1] and answers[0][1] == pytest.approx(3e20, rel=1e-6)
    (length,) = struct.unpack("<Q", data[:8])  # the same file with its header one space longer (JSON allows
    padded = data[8 : 8 + length] + b" "  # it): every value of its data section lies one byte off alignment
    odd = struct.pack("<Q", len(padded)) + padded + data[8 + length :]
    try:
        odd_answer = _check(odd, "f32", None)
    except Rejection as rejection:
        odd_answer = (rejection.code, rejection.detail)
    assert odd_answer == answers[0]


def test_a_header_matched_before_is_checked_again_when_the_spec_or_settings_change_even_in_place():
    data = encode_delta(_tensors())
    adapter = _adapter("f32")
    assert _check(data, "f32", None)[0] == "f32"
    sha = hashlib.sha256(data).hexdigest()

    def check(adapter):
        return contents_check(io.BytesIO(data), size=len(data), sha256=sha, adapter=adapter)

    assert check(adapter)[0] == "f32"  # matched: an equal spec and equal settings
    name = next(iter(SHAPES))
    adapter.tensor_spec[name]["shape"] = [5, 33]  # the same dict, changed in place after it matched
    with pytest.raises(Rejection) as found:
        check(adapter)
    assert found.value.code == "spec_mismatch" and repr(name) in found.value.detail
    adapter = _adapter("f32")
    adapter.aggregation = {"max_norm": None, "strategy": "ffa_lora"}  # FFA deltas carry no lora_A
    with pytest.raises(Rejection) as found:
        check(adapter)
    assert found.value.code == "spec_mismatch" and "unexpected" in found.value.detail


def test_the_norm_of_values_all_alike_float32_sums_worst_case_is_within_1e_4(norm_path):
    # Float32 sums of squares err most where every square is the same (each addition rounds the same way).
    shapes = {"a.lora_A.weight": (512, 512), "b.lora_B.weight": (3, 5)}
    tensors = {name: torch.full(shape, 0.3) for name, shape in shapes.items()}
    adapter = SimpleNamespace(
        tensor_spec={name: {"shape": list(shape), "dtype": "F32"} for name, shape in shapes.items()},
        aggregation={"max_norm": None},
        dp={},
    )
    data = encode_delta(tensors)
    _, norm = contents_check(io.BytesIO(data), size=len(data), sha256=hashlib.sha256(data).hexdigest(), adapter=adapter)
    exact = math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))
    assert norm == pytest.approx(exact, rel=1e-12 if norm_path == "compiled" else 1e-4)


@pytest.mark.parametrize("encoding", ["f32", "f16", "int8"])
def test_an_update_the_agent_clips_to_the_manifests_bound_passes_the_servers_norm_check(encoding, norm_path):
    """The bound travels in the manifest's training setting (``max_norm``); the agent scales an update above it to
    ``CLIP_SHARE`` of it (edge_agent.delta.clip_to_bound) and the server, summing its own way over the decoded
    values of any encoding, finds it within. Unclipped, the same update is refused ``norm_too_large``."""
    started = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    trained = {name: t * 100 for name, t in _tensors().items()}
    bound = 0.5
    clipped, norm = clip_to_bound(trained, started, bound)
    assert norm > bound
    with pytest.raises(Rejection) as refused:
        _check(encode_delta(compute_delta(trained, started), encoding=encoding), encoding, None, max_norm=bound)
    assert refused.value.code == "norm_too_large"
    found = _check(encode_delta(compute_delta(clipped, started), encoding=encoding), encoding, None, max_norm=bound)
    assert found[1] <= bound and found[1] == pytest.approx(CLIP_SHARE * bound, rel=1e-2)
    within = {name: t * 0.5 for name, t in clipped.items()}
    assert clip_to_bound(within, started, bound)[0] is within  # within the bound: unchanged
    assert clip_to_bound(trained, started, None)[0] is trained  # no bound known: unchanged


@pytest.mark.django_db
def test_the_manifest_carries_the_adapters_norm_bound(adapter, make_user):

    assert training_config(adapter)["max_norm"] == 1000.0
    adapter_set_aggregation(adapter=adapter, actor=make_user("admin"), aggregation={"max_norm": 2.5})
    adapter.refresh_from_db()
    assert training_config(adapter)["max_norm"] == 2.5
