"""Feedback on the served model's answers (issue 52, "Feedback"): every answer of predict carries an id, the agent
keeps the inputs of its recent answers (bounded by count and age, private, on the device), and a user's label on
an answer, through the API, the CLI or a feedback file in the inbox, confirms or corrects it and becomes a labelled
sample. An unknown, expired or answered id, or a label the schema refuses, is refused with its reason and nothing
changes. Real files, real agent objects, no mocks."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import stat
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

from edge_agent.api import Agent, FeedbackError
from edge_agent.cli import inbox_for, main, take_inbox
from edge_agent.feedback import ANSWERS_FILE, MAX_FEEDBACK_BYTES, new_id
from edge_agent.identity import AgentState
from edge_agent.runtime import AgentConfig
from edge_agent.samples import SampleStore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inputs(digits, n: int, start: int = 0) -> np.ndarray:
    _, train, _ = digits
    return train["x"][start : start + n].clamp(0, 1).numpy()


def _store(home) -> SampleStore:
    return SampleStore(home / "samples")


def _answers(home) -> list[tuple]:
    """What the answers file holds, every row (compared whole where nothing may change)."""
    with closing(sqlite3.connect(home / ANSWERS_FILE)) as db:
        return (
            db.execute("SELECT * FROM answers ORDER BY seq").fetchall()
            + db.execute("SELECT * FROM feedback_counts").fetchall()
        )


def _size(home) -> int:
    """Bytes of the answers file, its write-ahead log checkpointed into it."""
    with closing(sqlite3.connect(home / ANSWERS_FILE)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return sum(path.stat().st_size for path in home.glob(f"{ANSWERS_FILE}*"))


def _other(label: int) -> int:
    return (label + 1) % 10


def test_every_answer_carries_an_unguessable_id_and_its_input_is_kept_privately(app_home, digits):
    agent = Agent(app_home)
    answer = agent.predict({"x": _inputs(digits, 5)})
    assert len(answer["ids"]) == len(set(answer["ids"])) == len(answer["labels"]) == 5
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{22}", i) for i in answer["ids"])  # 16 random bytes, URL-safe
    assert set(answer["ids"]).isdisjoint(agent.predict({"x": _inputs(digits, 5)})["ids"])  # the same inputs again
    for path in app_home.glob(f"{ANSWERS_FILE}*"):  # the database and its WAL files
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    feedback = agent.status()["feedback"]
    assert feedback == {"confirmed": 0, "corrected": 0, "correction_rate": None, "by_version": [],
                        "answers_kept": 10, "answers_keep": 1000, "answers_keep_days": 7.0}  # fmt: skip
    assert len(_store(app_home)) == 0  # predicting stores no sample


def test_feedback_by_id_confirms_or_corrects_and_the_input_becomes_a_sample_with_that_label(app_home, digits):
    agent, x = Agent(app_home), _inputs(digits, 3)
    answer = agent.predict({"x": x})
    ids, labels = answer["ids"], answer["labels"]

    confirmed = agent.feedback(ids[0], labels[0])
    assert confirmed == {"id": ids[0], "label": labels[0], "predicted": labels[0], "outcome": "confirmed"}
    stored = _store(app_home).load()
    assert stored["y"].tolist() == [labels[0]] and np.array_equal(stored["x"], x[:1])

    corrected = agent.feedback(ids[2], _other(labels[2]))
    assert corrected["outcome"] == "corrected" and corrected["predicted"] == labels[2]
    stored = _store(app_home).load()
    assert stored["y"].tolist() == [labels[0], _other(labels[2])] and np.array_equal(stored["x"], x[[0, 2]])

    feedback = Agent(app_home).status()["feedback"]  # counted on disk, seen by another agent object
    assert (feedback["confirmed"], feedback["corrected"], feedback["correction_rate"]) == (1, 1, 0.5)
    assert feedback["by_version"] == [
        {"adapter": "digits-lora", "version": 1, "serving": "shared", "confirmed": 1, "corrected": 1}
    ]
    assert feedback["answers_kept"] == 1  # the answered ones keep no input


def test_feedback_on_an_unknown_or_answered_id_or_with_a_refused_label_is_refused_and_changes_nothing(app_home, digits):
    agent = Agent(app_home)
    answer = agent.predict({"x": _inputs(digits, 2)})
    first, second = answer["ids"]
    agent.feedback(second, answer["labels"][1])
    before, samples = _answers(app_home), len(_store(app_home))
    refusals = [
        ((first[:-1] + ("A" if first[-1] != "A" else "B"), 1), "unknown answer id"),
        (("", 1), "is not an answer id"),
        ((None, 1), "is not an answer id"),
        ((second, answer["labels"][1]), "was already confirmed"),
        ((second, _other(answer["labels"][1])), "was already confirmed"),
        ((first, 10), "refused by the sample schema, nothing stored: field 'y' is 10.0, outside int64 [] in [0, 9]"),
        ((first, -1), "outside int64"),
        ((first, 2.5), "field 'y'"),
        ((first, True), "is not a number"),
        ((first, "3"), "is not a number"),
    ]
    for (answer_id, label), reason in refusals:
        with pytest.raises(FeedbackError) as refused:
            agent.feedback(answer_id, label)
        assert reason in str(refused.value), (answer_id, label, str(refused.value))
        assert _answers(app_home) == before and len(_store(app_home)) == samples
    with pytest.raises(FeedbackError, match="given twice"):  # several entries: whole or not at all
        agent.feedback_many([(first, 1), (first, 2)])
    with pytest.raises(FeedbackError, match="entry 1: .*was already confirmed"):
        agent.feedback_many([(first, 1), (second, 1)])
    assert _answers(app_home) == before and len(_store(app_home)) == samples
    assert agent.feedback(first, 3)["label"] == 3  # still open after all that


def test_an_answer_expires_with_age_and_the_setting_says_when(app_home, digits):
    assert main(["--home", str(app_home), "configure", "--answers-keep-days", "0.00001"]) == 0  # 0.86 s
    agent = Agent(app_home)
    old = agent.predict({"x": _inputs(digits, 2)})
    time.sleep(1.0)
    new = agent.predict({"x": _inputs(digits, 1, 2)})
    before = _answers(app_home)
    with pytest.raises(FeedbackError, match=r"expired: its input was dropped .* older than 1e-05 days"):
        agent.feedback(old["ids"][0], old["labels"][0])
    assert len(_store(app_home)) == 0 and _answers(app_home) == before
    with closing(sqlite3.connect(app_home / ANSWERS_FILE)) as db:  # the input itself is gone from the file
        assert db.execute("SELECT COUNT(*) FROM answers WHERE input IS NOT NULL").fetchone()[0] == 1
    assert agent.feedback(new["ids"][0], new["labels"][0])["outcome"] == "confirmed"


def test_the_kept_answers_stay_within_their_count_the_oldest_dropped_first(app_home, digits):
    assert main(["--home", str(app_home), "configure", "--answers-keep", "30"]) == 0
    agent, given = Agent(app_home), []
    for batch in range(36):
        given.append(agent.predict({"x": _inputs(digits, 20, 20 * (batch % 12))}))
        if batch == 11:
            size_early = _size(app_home)
    with closing(sqlite3.connect(app_home / ANSWERS_FILE)) as db:
        kept = dict(db.execute("SELECT state, COUNT(*) FROM answers GROUP BY state").fetchall())
        with_input = db.execute("SELECT COUNT(*) FROM answers WHERE input IS NOT NULL").fetchone()[0]
    assert kept == {"open": 30, "expired": 30} and with_input == 30  # and 30 marks of dropped ones
    assert _size(app_home) <= size_early * 1.1 and size_early < 200_000  # (SQLite reuses the freed pages)
    assert agent.status()["feedback"]["answers_kept"] == 30

    with pytest.raises(FeedbackError, match=r"expired: .* to keep only the newest 30 answers \(answers_keep\)"):
        agent.feedback(given[-2]["ids"][9], 1)  # the 31st newest
    with pytest.raises(FeedbackError, match="unknown answer id"):  # its mark is gone too
        agent.feedback(given[0]["ids"][0], 1)
    assert agent.feedback(given[-2]["ids"][10], 1)["id"] == given[-2]["ids"][10]  # the 30th newest

    one_batch = agent.predict({"x": _inputs(digits, 70, 300)})  # larger than the bound on its own
    with pytest.raises(FeedbackError, match="newest 30 answers"):
        agent.feedback(one_batch["ids"][39], 1)
    assert agent.feedback(one_batch["ids"][40], 1)["outcome"] in ("confirmed", "corrected")


def test_the_answer_bounds_are_settings_with_defaults(app_home, capsys):
    config = AgentConfig.load(app_home)
    assert (config.answers_keep, config.answers_keep_days) == (1000, 7.0)
    assert main(["--home", str(app_home), "configure", "--answers-keep", "50", "--answers-keep-days", "2.5"]) == 0
    assert json.loads(capsys.readouterr().out)["answers_keep"] == 50
    assert AgentConfig.load(app_home).answers_keep_days == 2.5
    assert Agent(app_home).status()["feedback"]["answers_keep"] == 50
    with pytest.raises(SystemExit, match="0 or more"):
        main(["--home", str(app_home), "configure", "--answers-keep", "-1"])
    with pytest.raises(SystemExit, match="above 0"):
        main(["--home", str(app_home), "configure", "--answers-keep-days", "0"])


def test_feedback_through_the_cli_and_the_counts_in_status(app_home, digits, capsys):
    AgentState(server="http://127.0.0.1:9", device_id="d", server_public_key="", cohort="c", status="active",
               websocket_path="/ws/agent/", heartbeat_interval=30).save(app_home)  # fmt: skip
    samples = app_home.parent / "ask.jsonl"
    samples.write_text("\n".join(json.dumps({"x": x.tolist()}) for x in _inputs(digits, 3)))
    assert main(["--home", str(app_home), "predict", str(samples)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3 and all(len(line["id"]) == 22 for line in lines)

    assert main(["--home", str(app_home), "feedback", lines[0]["id"], str(lines[0]["label"])]) == 0
    assert json.loads(capsys.readouterr().out)["outcome"] == "confirmed"
    assert main(["--home", str(app_home), "feedback", lines[1]["id"], str(_other(lines[1]["label"]))]) == 0
    assert json.loads(capsys.readouterr().out)["outcome"] == "corrected"
    assert _store(app_home).load()["y"].tolist() == [lines[0]["label"], _other(lines[1]["label"])]

    before = _answers(app_home)
    for argv, reason in (
        ([lines[0]["id"], "4"], "was already confirmed"),
        (["no-such-answer", "4"], "unknown answer id 'no-such-answer'"),
        ([lines[2]["id"], "ten"], "label 'ten' is not a number"),
        ([lines[2]["id"], "12"], "outside int64 [] in [0, 9]"),
    ):
        assert main(["--home", str(app_home), "feedback", *argv]) == 1
        said = capsys.readouterr()
        assert said.out == "" and "feedback refused, nothing changed: " in said.err and reason in said.err, said.err
    assert _answers(app_home) == before and len(_store(app_home)) == 2

    ran = subprocess.run(  # the command as a device runs it: its exit status and its reason
        [sys.executable, "-m", "edge_agent", "--home", str(app_home), "feedback", lines[1]["id"], "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert ran.returncode == 1 and "was already corrected" in ran.stderr, ran.stderr
    ran = subprocess.run(
        [sys.executable, "-m", "edge_agent", "--home", str(app_home), "feedback", lines[2]["id"], "7"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert ran.returncode == 0 and json.loads(ran.stdout)["label"] == 7, ran.stderr

    assert main(["--home", str(app_home), "status"]) == 0
    feedback = json.loads(capsys.readouterr().out)["feedback"]
    assert (feedback["confirmed"] + feedback["corrected"], feedback["answers_kept"]) == (3, 0)
    assert feedback == Agent(app_home).status()["feedback"]


def test_an_answer_id_never_starts_with_a_dash_and_the_cli_takes_one_after_a_double_dash(app_home, digits, capsys):
    """An id starting with '-' read as an option once failed this suite (1 in 64 ids did): ids avoid it now, and an
    older agent's id that has one is given after ``--``."""
    ids = [new_id() for _ in range(20_000)]  # without the rule 312 of them would start with '-'
    assert not [i for i in ids if i.startswith("-")] and {len(i) for i in ids} == {22}
    AgentState(server="http://127.0.0.1:9", device_id="d", server_public_key="", cohort="c", status="active",
               websocket_path="/ws/agent/", heartbeat_interval=30).save(app_home)  # fmt: skip
    answer = Agent(app_home).predict({"x": _inputs(digits, 1)})
    older = "-" + answer["ids"][0][1:]
    with closing(sqlite3.connect(app_home / ANSWERS_FILE)) as db, db:
        db.execute("UPDATE answers SET id = ? WHERE id = ?", (older, answer["ids"][0]))
    with pytest.raises(SystemExit):
        main(["--home", str(app_home), "feedback", older, "3"])
    assert "the following arguments are required: label" in capsys.readouterr().err
    assert main(["--home", str(app_home), "feedback", "--", older, "3"]) == 0
    assert json.loads(capsys.readouterr().out)["label"] == 3 and _store(app_home).load()["y"].tolist() == [3]


def _take(home) -> dict:
    """One interval of `edge-agent run`'s inbox work, as run does it."""
    outcomes = take_inbox(inbox_for(home, AgentConfig.load(home)), Agent(home))
    return {o["file"]: o.get("added", o.get("rejected")) for o in outcomes}


def test_a_feedback_file_in_the_inbox_becomes_samples_and_a_bad_one_is_rejected_whole_with_its_reason(app_home, digits):
    agent = Agent(app_home)
    answer = agent.predict({"x": _inputs(digits, 6)})
    ids, labels = answer["ids"], answer["labels"]
    inbox = inbox_for(app_home, AgentConfig.load(app_home))
    inbox.make()
    (inbox.root / "taps.feedback.jsonl").write_text(
        json.dumps({"id": ids[0], "label": labels[0]}) + "\n\n" + json.dumps({"id": ids[1], "label": _other(labels[1])})
    )
    (inbox.root / "more.feedback.json").write_text(json.dumps([{"id": ids[2], "label": 4}]))
    assert _take(app_home) == {"taps.feedback.jsonl": 2, "more.feedback.json": 1}
    assert _store(app_home).load()["y"].tolist() == [4, labels[0], _other(labels[1])]  # (files in name order)
    assert not any(inbox.root.glob("*.feedback.*")) and agent.status()["feedback"]["confirmed"] >= 1

    before, samples = _answers(app_home), len(_store(app_home))
    good = json.dumps({"id": ids[3], "label": 1})
    bad = {
        "mixed.feedback.jsonl": (good + "\n" + json.dumps({"id": ids[0], "label": 1}), "line 2: answer"),
        "unknown.feedback.jsonl": (good + "\n" + json.dumps({"id": "nobody", "label": 1}), "line 2: unknown answer"),
        "range.feedback.jsonl": (
            good + "\n" + json.dumps({"id": ids[4], "label": 11}),
            "line 2: refused by the sample",
        ),
        "twice.feedback.jsonl": (good + "\n" + good, "line 2: answer"),
        "broken.feedback.jsonl": (good + "\n{not json", "line 2: cannot be read"),
        "shape.feedback.json": (json.dumps({"id": ids[3], "label": 1}), "expected a list"),
        "keys.feedback.json": (json.dumps([{"id": ids[3], "label": 1, "x": 2}]), "entry 0: expected an object"),
        "label.feedback.json": (json.dumps([{"id": ids[3], "label": "1"}]), "entry 0: label '1' is not a number"),
        "empty.feedback.jsonl": ("\n\n", "holds no feedback"),
        "deep.feedback.json": ("[" * 100_000 + "]" * 100_000, "JSON nested 100000 levels deep"),
        "long.feedback.jsonl": (json.dumps({"id": ids[3], "label": 1, "pad": "x" * 5000}), "line 1 is longer than"),
    }
    for name, (text, _) in bad.items():
        (inbox.root / name).write_text(text)
    with open(inbox.root / "huge.feedback.jsonl", "w") as huge:  # beyond the bound: refused before it is read
        huge.write((good + "\n") * (MAX_FEEDBACK_BYTES // len(good) + 1))
    (inbox.root / "linked.feedback.jsonl").symlink_to(inbox.root.parent / ANSWERS_FILE)
    outcomes = _take(app_home)
    expected = {name: reason for name, (_, reason) in bad.items()} | {
        "huge.feedback.jsonl": "more than the 4.0 MiB a file may be; hand feedback over in several files",
        "linked.feedback.jsonl": "a symbolic link",
    }
    assert set(outcomes) == set(expected), outcomes
    for name, reason in expected.items():
        assert reason in outcomes[name], (name, outcomes[name])
        assert reason in (inbox.rejected / f"{name}.reason.txt").read_text()
        assert os.path.lexists(inbox.rejected / name) or name == "huge.feedback.jsonl"
    assert _answers(app_home) == before and len(_store(app_home)) == samples  # nothing of any of them

    (inbox.root / "retry.feedback.jsonl").write_text(good)  # the good entry of a refused file, dropped in again
    assert _take(app_home) == {"retry.feedback.jsonl": 1} and len(_store(app_home)) == samples + 1


def test_the_readme_documents_feedback_with_commands_the_agent_has():
    """The README's agent section names `edge-agent feedback` and the settings as the parser takes them."""
    from edge_agent.cli import build_parser

    readme = Path(ROOT, "README.md").read_text()
    commands = set(re.findall(r"^edge-agent ([a-z-]+)", readme, re.M))
    assert {"feedback", "predict", "ask", "add-samples", "status"} <= commands
    choices = build_parser()._subparsers._group_actions[0].choices
    assert commands <= set(choices), commands - set(choices)
    configure = choices["configure"]._option_string_actions
    documented = re.findall(r"`edge-agent\s+configure\s((?:--[a-z-]+\s\S+\s?)+)`", readme)
    assert any("--answers-keep-days" in flags for flags in documented)
    for flags in documented:
        assert set(re.findall(r"--[a-z-]+", flags)) <= set(configure), flags
    assert "--answers-keep N --answers-keep-days D" in readme
    assert "agent.feedback(" in readme and ".feedback.jsonl" in readme
    assert "`edge-agent configure --unlabeled-keep N`" in readme and "agent.ask(" in readme
    assert "agent.add_samples_counts(" in readme and "edge_agent/unlabeled.py" in readme


def test_a_text_input_is_kept_as_it_was_given_and_no_answer_is_kept_when_the_setting_says_none(tmp_path):
    """The kept input is the checked fields as the application gave them (text as text), so feedback stores the
    sample through the same path as add_samples; with answers_keep 0 nothing is kept and feedback says why."""
    from edge_agent.feedback import Answers

    answers, stored = Answers(tmp_path), []
    texts = np.asarray(["the pump hums", "ünïcödé \U0001f600"], dtype=object)
    numbers = np.arange(6, dtype=np.float32).reshape(2, 1, 3)
    ids = answers.record({"text": texts, "x": numbers}, [1, 0], {"adapter": "a", "version": 2, "serving": "personal"})
    outcomes = answers.answer([(ids[1], 0), (ids[0], 4)], lambda samples: stored.append(samples) or 2)
    assert [o["outcome"] for o in outcomes] == ["confirmed", "corrected"]
    (sample,) = stored
    assert sample["text"].tolist() == [texts[1], texts[0]] and sample["y"] == [0, 4]
    assert np.array_equal(sample["x"], numbers[[1, 0]]) and sample["x"].dtype == np.float32
    assert answers.status()["by_version"] == [
        {"adapter": "a", "version": 2, "serving": "personal", "confirmed": 1, "corrected": 1}
    ]

    none = Answers(tmp_path / "none", keep=0)
    (answer_id,) = none.record({"x": numbers[:1]}, [1], {})
    assert not none.path.exists() and none.status()["answers_kept"] == 0
    with pytest.raises(FeedbackError, match=r"keeps no answers \(answers_keep is 0\)"):
        none.answer([(answer_id, 1)], stored.append)


def test_an_agent_without_a_version_refuses_feedback_saying_why(tmp_path):
    from edge_agent.api import NotReady

    with pytest.raises(NotReady, match="no adapter installed yet"):
        Agent(tmp_path).feedback("any", 1)
    assert not (tmp_path / ANSWERS_FILE).exists()


def test_feedback_dropped_in_the_inbox_is_taken_by_the_agent_s_own_process_while_the_application_holds_its_answers(
    app_home, digits
):
    """The application's Agent keeps the answers file open (its write-ahead log); `edge-agent run`, another
    process, takes the feedback file; both see the same answers and counts."""
    agent = Agent(app_home)
    answer = agent.predict({"x": _inputs(digits, 4)})
    inbox = inbox_for(app_home, AgentConfig.load(app_home))
    inbox.make()
    entries = [{"id": i, "label": _other(label)} for i, label in zip(answer["ids"][:3], answer["labels"], strict=False)]
    (inbox.root / "taps.feedback.jsonl.part").write_text("\n".join(json.dumps(e) for e in entries))
    (inbox.root / "taps.feedback.jsonl.part").rename(inbox.root / "taps.feedback.jsonl")
    ran = subprocess.run(
        [sys.executable, "-m", "tests.edge_agent.take_inbox", str(app_home)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(ran.stdout.splitlines()[-1]) == [
        {"file": "taps.feedback.jsonl", "added": 3, "labelled": 3, "unlabeled": 0}
    ]
    assert agent.status()["feedback"]["corrected"] == 3 and len(_store(app_home)) == 3
    with pytest.raises(FeedbackError, match="was already corrected"):
        agent.feedback(answer["ids"][0], answer["labels"][0])
    assert agent.feedback(answer["ids"][3], answer["labels"][3])["outcome"] == "confirmed"
    assert agent.predict({"x": _inputs(digits, 1)})["ids"][0] not in answer["ids"]
