"""What a refused sample file costs the agent's process: at most 200 MB above idle, whatever the file declares or
unpacks to, for any file up to the size limit (``edge_agent.sample_bounds``). Measured on the process's own
resident size (``tests.edge_agent.peak_rss``), reading real files on disk through ``Agent.add_file``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from edge_agent.sample_bounds import MAX_FILE_BYTES, MAX_JSON_BYTES, MAX_SAMPLES
from tests.edge_agent import hostile_files as hostile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT_MB = 200


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    photos = folder / "photos"
    (photos / "3").mkdir(parents=True)
    hostile.png(photos / "3" / "169-megapixels.png", 13000, 13000)
    (folder / "zero.jsonl").symlink_to("/dev/zero")
    made = [
        hostile.npz_declaring(folder / "declares-a-billion.npz", count=10**9),
        hostile.npz_bomb(folder / "bomb.npz"),
        hostile.zip_directory_bomb(folder / "five-million-entries.npz"),
        photos,
        hostile.long_json_line(folder / "one-long-line.jsonl", MAX_FILE_BYTES - 4 * hostile.MIB),
        hostile.deep_json_line(folder / "deep.jsonl"),
        hostile.empty_lists_json(folder / "empty-lists.json", MAX_JSON_BYTES),
        hostile.csv_rows(folder / "one-row-too-many.csv", MAX_SAMPLES + 1),
        folder / "zero.jsonl",
    ]
    yield made
    for path in made:  # hundreds of megabytes: not left for the session's end
        if path.is_file() and not path.is_symlink():
            path.unlink()


def test_reading_any_refused_file_takes_at_most_200_mb_above_idle(app_home, files, tmp_path):
    warm = tmp_path / "warm"
    warm.mkdir()
    warmups = [
        hostile.good_npz(warm / "good.npz"),
        hostile.jsonl(warm / "good.jsonl", hostile.good_samples(5)),
        hostile.image_folder(warm / "photos"),
    ]
    ran = subprocess.run(
        [sys.executable, "-m", "tests.edge_agent.peak_rss", str(app_home), *map(str, warmups), "--", *map(str, files)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    measured = [json.loads(line) for line in ran.stdout.splitlines()]
    print("\n".join(json.dumps(m) for m in measured))
    assert [m["file"] for m in measured] == [p.name for p in files]
    over = [m for m in measured if m["outcome"].startswith(("stored", "MemoryError"))]
    over += [m for m in measured if m["peak_above_idle_mib"] * 2**20 > LIMIT_MB * 10**6]
    assert not over, over
