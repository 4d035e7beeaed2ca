"""The inbox against what anything able to write into it may drop there: a folder linked in, a FIFO, a bomb, JSON
nested a hundred thousand deep, a label folder that is no number, a file that gets the agent killed. Whatever an
entry does stays with that entry (moved to rejected/ with its reason), and a good file dropped beside them is
stored within one interval, before and after the agent starts again. Real files, real agent code, no mocks."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np

from edge_agent.api import Agent
from edge_agent.cli import inbox_for
from edge_agent.inbox import STOPPED, Inbox
from edge_agent.runtime import AgentConfig
from edge_agent.samples import SampleStore
from tests.edge_agent import hostile_files as hostile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _interval(home, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """One interval of the inbox in a new agent process (``tests.edge_agent.take_inbox``)."""
    return subprocess.run(
        [sys.executable, "-m", "tests.edge_agent.take_inbox", str(home), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def _outcomes(ran: subprocess.CompletedProcess) -> dict:
    assert ran.returncode == 0, ran.stderr[-3000:]
    return {o["file"]: o.get("added", o.get("rejected")) for o in json.loads(ran.stdout.splitlines()[-1])}


def _drop_bad_files(inbox, outside, tag: str) -> dict[str, str]:
    """One of each kind of bad entry, named with ``tag``; returns each name with what its reason says."""
    linked = hostile.image_folder(outside / f"photos-{tag}")
    (inbox / f"linked-folder-{tag}").symlink_to(linked, target_is_directory=True)
    (inbox / f"zero-{tag}.jsonl").symlink_to("/dev/zero")
    hostile.fifo(inbox / f"pipe-{tag}.npz")
    hostile.npz_bomb(inbox / f"bomb-{tag}.npz", count=300_000)
    hostile.deep_json_line(inbox / f"deep-{tag}.jsonl")
    hostile.huge_photo_folder(inbox / f"huge-photo-{tag}", 30000, 30000)
    hostile.image_folder(inbox / f"labels-{tag}", labels=("²",))
    return {
        f"linked-folder-{tag}": "a symbolic link",
        f"zero-{tag}.jsonl": "a symbolic link",
        f"pipe-{tag}.npz": "a FIFO",
        f"bomb-{tag}.npz": "unpack to",
        f"deep-{tag}.jsonl": "JSON nested 100001 levels deep",
        f"huge-photo-{tag}": "megapixels",
        f"labels-{tag}": "ASCII digits",
    }


def _refused_as_expected(outcomes: dict, expected: dict[str, str]) -> None:
    assert set(outcomes) == set(expected), outcomes
    for name, fragment in expected.items():
        assert fragment in outcomes[name], (name, outcomes[name])


def test_a_folder_linked_into_the_inbox_is_refused_unfollowed_and_the_files_after_it_are_taken(app_home, tmp_path):
    """It wedged the inbox for good: rmtree refuses a link, the error escaped the file's handling, the link stayed
    in .taking/ and its samples were stored again at every interval."""
    inbox = Inbox(app_home)
    inbox.make()
    (inbox.root / "a-linked-folder").symlink_to(hostile.image_folder(tmp_path / "photos"), target_is_directory=True)
    hostile.good_npz(inbox.root / "b-good.npz")
    agent = Agent(app_home)

    outcomes = {o["file"]: o.get("added", o.get("rejected")) for o in inbox.take(agent.add_file)}
    assert outcomes["b-good.npz"] == 20
    assert "a symbolic link" in outcomes["a-linked-folder"]
    assert (inbox.rejected / "a-linked-folder").is_symlink()  # moved as a link: the folder it names is untouched
    assert "never follows a link" in (inbox.rejected / "a-linked-folder.reason.txt").read_text()
    assert sorted(p.name for p in (tmp_path / "photos").iterdir()) == ["3", "7"]
    assert not any(inbox.taking.iterdir())
    assert inbox.take(agent.add_file) == [] and len(SampleStore(app_home / "samples")) == 20


def test_a_fifo_in_the_inbox_is_refused_without_waiting_for_a_writer(app_home):
    """A FIFO blocked intake, and training behind it, until something wrote to it."""
    inbox = Inbox(app_home)
    inbox.make()
    hostile.fifo(inbox.root / "a-pipe.npz")
    hostile.good_npz(inbox.root / "b-good.npz")
    outcomes = _outcomes(_interval(app_home, timeout=30))
    assert outcomes["b-good.npz"] == 20
    assert "a FIFO (named pipe); the agent reads regular files and folders only" in outcomes["a-pipe.npz"]
    assert (inbox.rejected / "a-pipe.npz.reason.txt").exists()


def test_a_file_being_taken_when_the_agent_was_killed_is_refused_at_the_next_start_not_taken_again(app_home):
    """A file that got the agent killed stayed in .taking/ and was taken first at every start: a crash loop."""
    inbox = Inbox(app_home)
    inbox.make()
    for name in ("a-good.npz", "b-kills.npz", "c-good.npz"):
        hostile.good_npz(inbox.root / name)
    killed = _interval(app_home, "--die-on", "b-kills.npz")
    assert killed.returncode == -9, killed.stderr
    assert [p.name for p in inbox.taking.iterdir()] == ["b-kills.npz"]  # claimed one at a time: only it

    outcomes = _outcomes(_interval(app_home))
    assert outcomes == {"b-kills.npz": STOPPED, "c-good.npz": 20}
    assert (inbox.rejected / "b-kills.npz").exists() and not any(inbox.taking.iterdir())
    assert len(SampleStore(app_home / "samples")) == 40
    assert _outcomes(_interval(app_home)) == {}


def test_after_any_bad_files_a_good_file_is_stored_within_one_interval_before_and_after_a_restart(app_home, tmp_path):
    inbox = Inbox(app_home)
    inbox.make()
    bad = _drop_bad_files(inbox.root, tmp_path, "1")
    hostile.good_npz(inbox.root / "good-1.npz", seed=1)
    first = _outcomes(_interval(app_home))
    assert first.pop("good-1.npz") == 20
    _refused_as_expected(first, bad)
    assert not any(inbox.taking.iterdir()) and sorted(p.name for p in inbox.root.iterdir()) == [".taking", "rejected"]

    # The agent starts again (a new process on the same home), with the same kinds of bad files waiting again.
    bad = _drop_bad_files(inbox.root, tmp_path, "2")
    hostile.good_npz(inbox.root / "good-2.npz", seed=2)
    second = _outcomes(_interval(app_home))
    assert second.pop("good-2.npz") == 20
    _refused_as_expected(second, bad)
    assert all((inbox.rejected / f"{name}.reason.txt").exists() for name in bad)
    assert len(SampleStore(app_home / "samples")) == 40
    assert _outcomes(_interval(app_home)) == {}


def test_a_file_name_with_a_newline_cannot_forge_a_line_in_the_agent_log(app_home, caplog):
    inbox = Inbox(app_home)
    inbox.make()
    forged = "x.npz\n2026-01-01 00:00:00,000 [agent] inbox: stored 500 samples from trusted.npz"
    (inbox.root / forged).write_bytes(b"not a zip")
    hostile.good_npz(inbox.root / "\x1b[2Jgood.npz")
    with caplog.at_level(logging.INFO, logger="edge_agent.inbox"):
        outcomes = inbox.take(Agent(app_home).add_file)
    assert {o["file"] for o in outcomes} == {forged, "\x1b[2Jgood.npz"}
    lines = [record.getMessage() for record in caplog.records]
    assert not any("\n" in line or "\x1b" in line for line in lines), lines
    assert any("x.npz\\n2026-01-01" in line and "refused" in line for line in lines), lines
    assert any(line.endswith("from \\x1b[2Jgood.npz") for line in lines), lines
    assert "\n" not in (inbox.rejected / f"{forged}.reason.txt").read_text().rstrip("\n")


def test_rejected_keeps_at_most_its_bounds_the_oldest_removed_first_with_their_reasons(app_home):
    """rejected/ kept a full copy of every refused file with nothing to bound it."""
    inbox = Inbox(app_home, keep_files=3, keep_bytes=10_000)
    inbox.make()
    agent = Agent(app_home)
    for index in range(5):  # one take each, so each is refused after the one before
        (inbox.root / f"bad-{index}.csv").write_text("p0\n" + "0\n" * 100)
        inbox.take(agent.add_file)
    assert sorted(p.name for p in inbox.rejected.iterdir()) == [
        f"bad-{i}.csv{suffix}" for i in (2, 3, 4) for suffix in ("", ".reason.txt")
    ]

    (inbox.root / "big.csv").write_text("p0\n" + "0\n" * 10_000)  # 20 KB alone: more than the bound
    inbox.take(agent.add_file)
    names = sorted(p.name for p in inbox.rejected.iterdir())
    assert "big.csv" not in names and "big.csv.reason.txt" in names
    assert "not kept: 20,003 bytes" in (inbox.rejected / "big.csv.reason.txt").read_text()
    assert len([n for n in names if not n.endswith(".reason.txt")]) == 2 and len(names) == 5

    for index in range(3):  # 4,000 bytes each: the bound holds two of them beside nothing else
        (inbox.root / f"mid-{index}.csv").write_text("p0\n" + "0\n" * 2000)
        inbox.take(agent.add_file)
    assert sorted(p.name for p in inbox.rejected.iterdir()) == [
        f"mid-{i}.csv{suffix}" for i in (1, 2) for suffix in ("", ".reason.txt")
    ]


def test_the_rejected_bounds_are_settings_with_defaults(app_home):
    inbox = inbox_for(app_home, AgentConfig.load(app_home))
    assert (inbox.keep_files, inbox.keep_bytes) == (100, 128 * 2**20)
    configured = subprocess.run(
        [sys.executable, "-m", "edge_agent", "--home", str(app_home), "configure",
         "--rejected-keep-files", "7", "--rejected-keep-mib", "1.5"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert configured.returncode == 0, configured.stderr
    inbox = inbox_for(app_home, AgentConfig.load(app_home))
    assert (inbox.keep_files, inbox.keep_bytes) == (7, int(1.5 * 2**20))
    assert np.isclose(json.loads(configured.stdout)["rejected_keep_mib"], 1.5)
