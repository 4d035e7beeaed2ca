"""Sample files and batches that are wrong in ways the schema check alone did not see: refused with a reason that
says what, nothing of them stored, and the next file taken (``add-samples``, ``Agent.add_samples``, the bounded
reader of ``edge_agent.sample_bounds``). Real files on disk, the real agent, no mocks."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from edge_agent import bounded_json
from edge_agent.api import Agent
from edge_agent.enroll import post_json
from edge_agent.protocol import MAX_MESSAGE_BYTES, decode
from edge_agent.sample_files import SampleError, read_samples
from edge_agent.samples import SampleStore
from tests.edge_agent import hostile_files as hostile

DEEP = "[" * 100_000 + "]" * 100_000


def _stored(home) -> int:
    return len(SampleStore(home / "samples"))


def test_add_samples_goes_on_past_bad_files_says_which_and_why_and_exits_non_zero(app_home, tmp_path):
    """It died with a traceback on deep JSON, a decompression-bomb PNG or a label folder that is no ASCII number,
    and never took the files after it; it hung on a FIFO."""
    bad = {
        hostile.deep_json_line(tmp_path / "deep.jsonl"): "JSON nested 100001 levels deep; at most 64",
        hostile.huge_photo_folder(tmp_path / "bomb-photo", 30000, 30000): "megapixels",
        hostile.image_folder(tmp_path / "arabic-digit", labels=("٣",)): "ASCII digits",
        hostile.image_folder(tmp_path / "superscript", labels=("²",)): "ASCII digits",
        hostile.fifo(tmp_path / "pipe.npz"): "a FIFO",
    }
    good = hostile.good_npz(tmp_path / "good.npz")
    ran = subprocess.run(
        [sys.executable, "-m", "edge_agent", "--home", str(app_home), "add-samples", *map(str, bad), str(good)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr
    assert ran.stdout.splitlines() == [f"{good}: 20 samples stored (20 labelled, 0 unlabeled)"]
    lines = ran.stderr.splitlines()
    for path, why in bad.items():
        said = [line for line in lines if line.startswith(f"{path}: refused, nothing stored: ")]
        assert len(said) == 1 and why in said[0], (path, lines)
    assert lines[-1].startswith("5 of 6 refused: ")
    assert _stored(app_home) == 20


def test_a_csv_with_a_utf8_byte_order_mark_and_y_first_is_read(app_home, tmp_path):
    """Excel's "CSV UTF-8" starts with a byte order mark: its first column was read as '\\ufeffy', not 'y'."""
    samples = hostile.good_samples(5)
    header = "y," + ",".join(f"p{i}" for i in range(64))
    rows = [f"{y}," + ",".join(f"{v:.4f}" for v in x.ravel()) for x, y in zip(samples["x"], samples["y"], strict=True)]
    (tmp_path / "excel.csv").write_text("\r\n".join([header, *rows]) + "\r\n", encoding="utf-8-sig")
    assert Agent(app_home).add_file(tmp_path / "excel.csv") == 5
    stored = SampleStore(app_home / "samples").load()
    assert stored["y"].tolist() == samples["y"].tolist()
    assert np.allclose(stored["x"], samples["x"], atol=1e-4)


@pytest.mark.parametrize(
    ("field", "values", "message"),
    [
        (
            "y",
            np.array([True, False, True]),
            "field 'y' must hold numbers \\(int64 \\[\\] in \\[0, 9\\]\\), not booleans",
        ),
        ("y", ["1", "2", "3"], "field 'y' must hold numbers .*, not text"),
        ("y", np.array([1, 2, 3], dtype=np.complex64), "not complex numbers"),
        ("y", [1, None, 3], "field 'y' must hold numbers"),
        ("x", np.full((3, 1, 8, 8), 0.5 + 0.5j), "field 'x' must hold numbers .*, not complex numbers"),
        ("x", np.zeros((3, 1, 8, 8), dtype=bool), "field 'x' must hold numbers .*, not booleans"),
        ("x", np.full((3, 1, 8, 8), "0.5"), "field 'x' must hold numbers .*, not text"),
        ("x", np.full((3, 1, 8, 8), 1e300), "sample 0: field 'x' holds \\[inf"),  # finite as float64, not float32
    ],
)
def test_labels_and_inputs_of_the_wrong_kind_are_refused_and_nothing_is_stored(app_home, field, values, message):
    """Boolean and string labels were stored, and complex inputs with their imaginary part dropped."""
    samples = {"x": np.zeros((3, 1, 8, 8), dtype=np.float32), "y": [1, 2, 3], field: values}
    with pytest.raises(SampleError, match=message):
        Agent(app_home).add_samples(samples)
    assert _stored(app_home) == 0


def test_a_jsonl_label_written_as_true_or_a_string_is_refused(app_home, tmp_path):
    x = [0.5] * 64
    for label, kind in ((True, "booleans"), ("3", "text")):
        path = tmp_path / "labels.jsonl"
        path.write_text(json.dumps({"x": x, "y": 1}) + "\n" + json.dumps({"x": x, "y": label}) + "\n")
        with pytest.raises(SampleError, match=f"sample 1: field 'y' must hold numbers .*, not {kind}"):
            Agent(app_home).add_file(path)
    assert _stored(app_home) == 0


class _Answer(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_POST(self):  # noqa: N802  (http.server's name)
        # Read the request first: a socket closed with unread bytes is reset, and the client sees that instead.
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


class _answering:
    """A real HTTP server on a free local port that answers every POST with ``body``."""

    def __init__(self, body: bytes):
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Answer", (_Answer,), {"body": body}))

    def __enter__(self) -> str:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_json_nested_too_deep_is_refused_with_its_depth_not_a_recursion_error(app_home, tmp_path):
    """A sample line, a .json file, a server message, a server's reply: each a clear ValueError saying how deep."""
    with pytest.raises(SampleError, match="line 1 cannot be read \\(JSONTooDeep: JSON nested 100001 levels deep"):
        Agent(app_home).add_file(hostile.deep_json_line(tmp_path / "deep.jsonl"))
    (tmp_path / "deep.json").write_text(DEEP)
    with pytest.raises(SampleError, match="JSON nested 100000 levels deep; at most 64 are accepted"):
        Agent(app_home).add_file(tmp_path / "deep.json")
    with pytest.raises(ValueError, match="JSON nested 100001 levels deep"):
        decode('{"type": "command", "args": ' + "[" * 100_000 + "]" * 100_000 + "}", limit=MAX_MESSAGE_BYTES * 10)
    with _answering(DEEP.encode()) as url, pytest.raises(ValueError, match="JSON nested 100000 levels deep"):
        post_json(url, {"hello": 1})  # (what enroll posts through)
    nested_64 = "[" * 64 + "]" * 64
    assert bounded_json.json_depth(nested_64) == 64 and bounded_json.loads(nested_64) is not None
    assert bounded_json.loads('{"a": "[[[[' + "[" * 100 + '"}') == {"a": "[[[[" + "[" * 100}  # in a string: text
    assert _stored(app_home) == 0


def test_what_a_file_declares_is_held_to_the_bounds_before_memory_is_taken(app_home, tmp_path, digits):
    family = digits[0]
    read = lambda path: read_samples(path, family, {})  # noqa: E731
    with pytest.raises(SampleError, match="field 'x' holds 1000000000 samples; at most 100000"):
        read(hostile.npz_declaring(tmp_path / "declares.npz", count=10**9))
    with pytest.raises(SampleError, match="its arrays unpack to 75.5 MiB; at most 64.0 MiB"):
        read(hostile.npz_bomb(tmp_path / "bomb.npz", count=300_000))
    with pytest.raises(SampleError, match="x.npy declares \\[10, 1, 8, 8\\] float64 \\(5,120 bytes\\) and holds 64"):
        read(hostile.npz_declaring(tmp_path / "cut-short.npz", count=10))
    with pytest.raises(
        SampleError, match="more than the 16.8 megapixels an image may have \\(resize it first\\) \\(5000 x 5000\\)"
    ):
        read(hostile.huge_photo_folder(tmp_path / "photos", 5000, 5000))  # under Pillow's own bound (89 MP)
    (tmp_path / "big.json").write_bytes(b"[" + b" " * (4 * 2**20) + b"]")
    with pytest.raises(SampleError, match="more than the 4.0 MiB a file may be; write larger sets as JSON lines"):
        read(tmp_path / "big.json")

    np.savez(tmp_path / "float64.npz", x=np.full((5, 64), 0.25), y=np.arange(5))  # decoded as float32, no copy
    assert read(tmp_path / "float64.npz")["x"].dtype == np.float32
    fortran = np.asfortranarray(np.random.default_rng(0).random((5, 1, 8, 8)).astype(np.float32))
    np.savez(tmp_path / "fortran.npz", x=fortran, y=np.arange(5))
    assert np.array_equal(read(tmp_path / "fortran.npz")["x"], fortran)


def test_only_regular_files_and_folders_are_read_never_through_a_link(app_home, tmp_path):
    good = hostile.good_npz(tmp_path / "good.npz")
    (tmp_path / "link.npz").symlink_to(good)
    (tmp_path / "null.csv").symlink_to("/dev/null")
    photos = hostile.image_folder(tmp_path / "photos")
    (photos / "7" / "linked.png").symlink_to(photos / "3" / "one.png")
    agent = Agent(app_home)
    for path in (tmp_path / "link.npz", tmp_path / "null.csv", photos):
        with pytest.raises(SampleError, match="a symbolic link; the agent reads regular files and folders only"):
            agent.add_file(path)
    with pytest.raises(SampleError, match="a character device; the agent reads regular files and folders only"):
        agent.add_file("/dev/null")
    assert _stored(app_home) == 0 and agent.add_file(good) == 20
