"""The agent as the device's application uses it: hand it samples, get the device's own model back.

    from edge_agent.api import Agent

    agent = Agent()                              # the agent's home (~/.fleet-agent or FLEET_AGENT_HOME)
    agent.add_samples({"x": images, "y": labels})  # checked against the family's schema, then stored
    agent.add_samples({"x": images})             # without labels: kept apart, unlabeled (edge_agent.unlabeled)
    agent.predict({"x": images})                 # {"ids": [...], "labels": [...], "probabilities": [[...]], ...}
    agent.ask(5)                                 # the unlabeled samples whose labels would help most, as answers
    agent.feedback(answer_id, 7)                 # a user confirms or corrects an answer: a labelled sample
    model = agent.model()                        # the served torch module, ready for inference (eval mode)
    agent.status()                               # versions, personal model, samples (and how many more it waits for)

The served model is the personal one where the device's validation says it helps, else the shared version
(``edge_agent.personal``). ``edge-agent run`` trains in its own process or thread and writes new models to
disk; the next ``predict`` notices and builds the new model in the background while it keeps answering with
the one it has, so a training pass never makes a prediction wait longer than the swap of a reference.

Every answer carries an id; the agent keeps the inputs of its recent answers, so feedback on an answer (the
label a user confirmed or corrected it to) becomes a labelled sample (``edge_agent.feedback``). ``ask`` puts the
served model's least sure unlabeled samples to the device's users the same way: its answers take feedback as
predict's do, and the sample labelled leaves the unlabeled store.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from edge_agent.assignments import AdapterStore, build_model
from edge_agent.families import get_family
from edge_agent.families.common import LABEL
from edge_agent.feedback import Answers, FeedbackError, is_feedback_file, read_feedback
from edge_agent.identity import default_home
from edge_agent.personal import PersonalSettings, PersonalStore, derive
from edge_agent.power import TrainingPolicy
from edge_agent.runtime import AgentConfig
from edge_agent.sample_files import SampleError, check, encode, read_samples_split
from edge_agent.sample_formats import read_fields
from edge_agent.samples import SampleStore
from edge_agent.unlabeled import UnlabeledStore, row_keys


def samples_status(home: Path, samples: SampleStore) -> dict:
    """The samples the device holds against its training policy's sample rule (``TrainingPolicy.samples_status``):
    how many are new and how many more new ones it waits for before it trains."""
    policy = TrainingPolicy(**AgentConfig.load(home).policy)
    return policy.samples_status(stored=len(samples), new=samples.new_count())


__all__ = ["Agent", "AskError", "FeedbackError", "NotReady", "Stored", "samples_status"]


class Stored(int):
    """How many samples a call stored (an int, as it always was), and of them how many ``labelled`` and how many
    ``unlabeled``."""

    labelled: int
    unlabeled: int

    def __new__(cls, labelled: int = 0, unlabeled: int = 0) -> Stored:
        stored = super().__new__(cls, labelled + unlabeled)
        stored.labelled, stored.unlabeled = int(labelled), int(unlabeled)
        return stored

    def counts(self) -> dict[str, int]:
        return {"labelled": self.labelled, "unlabeled": self.unlabeled}


class AskError(ValueError):
    """``ask`` cannot put questions: a count that is not one, or answers that are not kept (``answers_keep``)."""


ASK_BATCH = 256  # unlabeled samples through the model at a time


class NotReady(RuntimeError):
    """No adapter is installed yet: the family (and so the sample schema and the model) is not known."""


NOT_INSTALLED = (
    "no adapter installed yet: the agent must receive its first assignment, which names the family and so what a "
    "sample is. Run `edge-agent run` on an approved device until `edge-agent status` shows a version installed; "
    "files dropped in the inbox meanwhile wait there and are taken then"
)


class Agent:
    def __init__(self, home: Path | str | None = None):
        self.home = Path(home) if home is not None else default_home()
        self.adapters = AdapterStore(self.home)
        self.personal = PersonalStore(self.home)
        self.samples = SampleStore(self.home / "samples")
        self._lock = threading.Lock()
        self._served: tuple[tuple, torch.nn.Module, dict] | None = None  # (stamp, model, what it is)
        self._building: threading.Thread | None = None
        self._recent: Answers | None = None

    def _current(self) -> dict:
        current = self.adapters.state().get("current")
        if not current or not current.get("training"):
            raise NotReady(NOT_INSTALLED)
        return current

    def _family(self):
        training = self._current()["training"]
        family = get_family(training["family"])
        if hasattr(family, "attach"):  # its samples are encoded with files of the base (a tokenizer)
            family.attach(self.adapters.base_path(self.adapters.state()["base_model_sha256"]))
        return family, training.get("family_config", {})

    def schema(self) -> dict[str, str]:
        """The fields a sample needs, each described (``{"x": "float32 [1, 8, 8] in [0, 1]", ...}``)."""
        family, config = self._family()
        return {name: field.describe() for name, field in family.sample_fields(config).items()}

    @property
    def unlabeled(self) -> UnlabeledStore:
        """The unlabeled samples, bounded as the settings say now (``unlabeled_keep``)."""
        return UnlabeledStore.of(self.home, AgentConfig.load(self.home))

    def add_samples(self, samples: dict) -> Stored:
        """Store samples (field -> one value per sample); returns how many (``Stored``: an int, with how many were
        ``labelled`` and how many ``unlabeled``). A batch with ``y`` is labelled; one without is unlabeled (its
        inputs checked as predict's are) and goes to the unlabeled store (``edge_agent.unlabeled``), at most
        ``unlabeled_keep`` of them kept. A batch that does not fit the schema raises ``SampleError`` and stores
        nothing."""
        family, config = self._family()
        fields = family.sample_fields(config)
        if isinstance(samples, dict) and LABEL not in samples:
            return self._store(None, encode(family, config, check(fields, samples, labelled=False)))
        return self._store(encode(family, config, check(fields, samples)), None)

    def add_samples_counts(self, samples: dict) -> dict[str, int]:
        """``add_samples``, saying how many were stored of each kind: ``{"labelled": n, "unlabeled": m}``."""
        return self.add_samples(samples).counts()

    def _store(self, labelled: dict | None, unlabeled: dict | None) -> Stored:
        """Store both parts of a batch or file, or neither: the unlabeled part is held to its store first (the
        setting, its fields); the labelled part is written, then the unlabeled one, and should that fail the
        labelled shard is removed again. (A power cut between the two writes keeps the labelled part only.)"""
        store = self.unlabeled
        if unlabeled is not None:
            refused = store.refusal(unlabeled)
            if refused:
                raise SampleError(refused)
        stored_labelled = 0
        if labelled is not None:
            before = len(self.samples)
            stored_labelled = self.samples.append(labelled) - before
        if unlabeled is None:
            return Stored(stored_labelled, 0)
        written = self.samples._shards()[-1][2] if stored_labelled else None
        try:
            store.append(unlabeled)
        except BaseException:
            if written is not None:
                written.unlink(missing_ok=True)
            raise
        return Stored(stored_labelled, min(len(next(iter(unlabeled.values()))), store.keep))

    def feedback(self, answer_id: str, label: int) -> dict:
        """A user's word on an answer ``predict`` or ``ask`` gave (by its id): ``label`` equal to the predicted one
        confirms it, another corrects it; either way the answer's kept input with ``label`` is stored as a sample
        through ``add_samples``'s checks (every check of the schema applies). Returns ``{"id", "label",
        "predicted", "outcome": "confirmed" | "corrected"}``. An unknown, expired or already answered id, or a
        label the schema refuses, raises ``FeedbackError`` with the reason, and nothing changes."""
        return self.feedback_many([(answer_id, label)])[0]

    def feedback_many(self, entries: list[tuple[str, int]], *, places: list[str] | None = None) -> list[dict]:
        """Feedback on several answers, ``(id, label)`` each, taken whole or refused whole (``feedback``). The
        sample an answer of ``ask`` was about leaves the unlabeled store before its labelled copy is stored."""
        family, config = self._family()  # (NotReady before anything else)
        store = self.unlabeled
        asked = store.asked()
        keys = [asked[answer_id] for answer_id, _ in entries if isinstance(answer_id, str) and answer_id in asked]

        def add(samples: dict) -> int:
            arrays = self._labelled(family, config, samples)  # (a label the schema refuses: nothing changed)
            store.discard(keys)  # a user's label wins: never used unlabeled again
            return self._store(arrays, None)

        return self._answers().answer(entries, add, places=places)

    def _labelled(self, family, config: dict, samples: dict) -> dict[str, np.ndarray]:
        """The kept inputs of answers with their labels, checked and encoded as ``add_samples`` does. The answers
        of ``ask`` keep the inputs as the store holds them (the model's inputs, a text family's tokens): only
        their label is checked then."""
        fields = family.sample_fields(config)
        if set(samples) == set(fields):
            return encode(family, config, check(fields, samples))
        label = check({LABEL: fields[LABEL]}, {LABEL: samples[LABEL]})[LABEL]
        return {**{key: np.asarray(value) for key, value in samples.items() if key != LABEL}, LABEL: label}

    def feedback_file(self, path: Path | str) -> Stored:
        """The feedback of a file (``*.feedback.jsonl`` or ``*.feedback.json``, ``edge_agent.feedback``), whole
        or not at all; returns how many samples it stored (all labelled)."""
        self._family()
        entries, places = read_feedback(Path(path))
        return Stored(len(self.feedback_many(entries, places=places)), 0)

    def take_file(self, path: Path | str) -> Stored:
        """What the inbox does with an entry: a feedback file's feedback, any other file's samples."""
        return self.feedback_file(path) if is_feedback_file(Path(path)) else self.add_file(path)

    def _answers(self) -> Answers:
        """The recent answers, bounded as the settings say now (one ``Answers`` while they stay the same: it
        keeps its file open)."""
        config = AgentConfig.load(self.home)
        with self._lock:
            answers = self._recent
            if answers is None or (answers.keep, answers.keep_days) != (config.answers_keep, config.answers_keep_days):
                if answers is not None:
                    answers.close()
                self._recent = answers = Answers.of(self.home, config)
        return answers

    def add_file(self, path: Path | str) -> Stored:
        """Store the samples of a file or image folder (``edge_agent.sample_files``); returns how many
        (``Stored``). Its samples without a label go to the unlabeled store; a file that mixes both kinds is
        stored whole or, when any sample of either kind does not fit, not at all."""
        family, config = self._family()
        labelled, unlabeled = read_samples_split(Path(path), family, config)
        return self._store(labelled, unlabeled)

    # The served model -------------------------------------------------------------------------------

    def _stamp(self) -> tuple:
        def mtime(path: Path) -> int:
            try:
                return path.stat().st_mtime_ns
            except FileNotFoundError:
                return 0

        return mtime(self.adapters.state_path), mtime(self.personal.state_path)

    def _build(self, stamp: tuple) -> tuple[tuple, torch.nn.Module, dict]:
        state = self.adapters.state()
        current = state.get("current") or {}
        if not current.get("training"):
            raise NotReady(NOT_INSTALLED)
        personal = self.personal.state()
        tensors, serving = None, "shared"
        mine = personal.get("serving") == "personal" and personal.get("adapter") == current["adapter"]
        if mine:
            tensors = self.personal.tensors()
            serving = "personal" if tensors is not None else "shared"
            if tensors is not None and personal.get("method") == "private_modules":  # on the installed body
                settings = PersonalSettings.from_training(current["training"])
                tensors = derive(load_file(current["path"]), tensors, settings)
        if tensors is None:
            tensors = load_file(current["path"])
        model = build_model(current["training"], tensors, self.adapters.base_path(state["base_model_sha256"]))
        about = {"serving": serving, "adapter": current["adapter"], "version": current["version"],
                 "method": personal.get("method", "none")}  # fmt: skip
        if serving == "personal" and personal.get("earlier_version"):  # too small to judge: an earlier version
            about["earlier_version"] = personal["earlier_version"]  # (edge_agent.small_devices)
        return stamp, model, about

    def _refresh(self) -> None:
        try:
            built = self._build(self._stamp())
        except Exception:  # a model being written is read again at the next call
            return
        with self._lock:
            self._served = built

    def served(self) -> tuple[torch.nn.Module, dict]:
        """The model to use now and what it is; a newer one on disk is built in the background."""
        stamp = self._stamp()
        with self._lock:
            served = self._served
        if served is None:
            built = self._build(stamp)
            with self._lock:
                self._served = served = built
        elif served[0] != stamp and (self._building is None or not self._building.is_alive()):
            self._building = threading.Thread(target=self._refresh, name="edge-agent-model", daemon=True)
            self._building.start()
        return served[1], served[2]

    def model(self) -> torch.nn.Module:
        """The served model (personal or shared) as a torch module in eval mode. Do not train it in place."""
        return self.served()[0]

    def predict(self, inputs: dict) -> dict:
        """Predictions for ``inputs`` (the schema's fields without ``y``; or a path to a file of them), each with
        an id (``ids``) that ``feedback`` takes: the inputs of the recent answers are kept on the device for it."""
        family, config = self._family()
        fields = family.sample_fields(config)
        raw = read_fields(Path(inputs), family, fields, labelled=False) if isinstance(inputs, str | Path) else inputs
        checked = check(fields, raw, labelled=False)
        arrays = encode(family, config, checked)
        model, about = self.served()
        batch = {key: torch.as_tensor(np.ascontiguousarray(value)) for key, value in arrays.items() if key != LABEL}
        with torch.no_grad():
            probabilities = torch.softmax(model(**batch), dim=-1)
        labels = probabilities.argmax(-1).tolist()
        return {
            "ids": self._answers().record(checked, labels, about),
            "labels": labels,
            "probabilities": [[round(p, 6) for p in row] for row in probabilities.tolist()],
            **about,
        }

    def ask(self, k: int) -> dict:
        """The ``k`` unlabeled samples whose labels would help most, put as questions: the served model's least
        sure (the smallest margin between its two most probable labels), spread over the labels it predicts
        (each label's least sure in turn, the label whose least sure is least sure first), one of equal samples,
        none that an earlier ``ask`` put and whose answer is still open. Each is recorded as an answer, as
        ``predict``'s are, so a user's label goes through ``feedback`` (and the command and the inbox) and
        becomes a labelled sample, and the sample leaves the unlabeled store. Returns ``{"ids", "labels",
        "probabilities", "margins", "inputs": {field: array}, "serving", ...}``, fewer than ``k`` when fewer
        are unlabeled. ``AskError`` when ``k`` is not a count from 1 to ``answers_keep``."""
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise AskError(f"ask takes a count of questions, 1 or more, not {k!r}")
        family, config = self._family()
        answers = self._answers()
        if answers.keep == 0:
            raise AskError("the agent keeps no answers (answers_keep is 0), so a question could take no answer")
        if k > answers.keep:
            raise AskError(f"at most {answers.keep} questions at once (answers_keep): the older would expire at once")
        store = self.unlabeled
        data = store.load()
        model, about = self.served()
        empty = {"ids": [], "labels": [], "probabilities": [], "margins": [], "inputs": {}, **about}
        if not data:
            return empty
        asked = store.asked()
        still_open = answers.open_ids(list(asked))
        busy = {asked[answer_id] for answer_id in still_open}
        keys, seen, candidates = row_keys(data), set(), []
        for index, key in enumerate(keys):
            if key not in busy and key not in seen:
                seen.add(key)
                candidates.append(index)
        if not candidates:
            return empty
        rows = []
        with torch.no_grad():
            for start in range(0, len(candidates), ASK_BATCH):
                chosen = candidates[start : start + ASK_BATCH]
                batch = {key: torch.as_tensor(np.ascontiguousarray(value[chosen])) for key, value in data.items()}
                rows.append(torch.softmax(model(**batch), dim=-1))
        probabilities = torch.cat(rows)
        top = probabilities.topk(min(2, probabilities.shape[1]), dim=-1).values
        margins = (top[:, 0] - top[:, 1]) if top.shape[1] > 1 else torch.ones(len(top))
        order = least_sure_by_label(probabilities.argmax(-1).tolist(), margins.tolist())[:k]
        picked = [candidates[i] for i in order]
        inputs = {key: value[picked] for key, value in data.items()}
        labels = [int(probabilities[i].argmax()) for i in order]
        ids = answers.record(inputs, labels, about)
        store.note_asked({answer_id: keys[i] for answer_id, i in zip(ids, picked, strict=True)}, keep_only=still_open)
        return {
            "ids": ids,
            "labels": labels,
            "probabilities": [[round(p, 6) for p in probabilities[i].tolist()] for i in order],
            "margins": [round(float(margins[i]), 6) for i in order],
            "inputs": inputs,
            **about,
        }

    def status(self) -> dict:
        """What the application may want to show: the installed version, the personal model, the samples:
        stored, new (no pass trained on them yet), and how many more new ones the agent waits for before it trains
        (``samples_status``), the unlabeled samples against their bound, and the feedback: answers confirmed and
        corrected (``Answers.status``)."""
        current = self.adapters.state().get("current")
        return {
            "installed": {k: current.get(k) for k in ("adapter", "version", "sha256")} if current else None,
            "personal": {k: v for k, v in self.personal.state().items() if k not in ("file", "saved")},
            "samples": samples_status(self.home, self.samples),
            "unlabeled": self.unlabeled.status(),
            "feedback": self._answers().status(),
        }


def least_sure_by_label(labels: list[int], margins: list[float]) -> list[int]:
    """Indices in the order ``ask`` puts them: round by round, one of each predicted label, each label's least sure
    (smallest margin; the earlier of equal ones) first; within a round, the labels by the margin of their first."""
    groups: dict[int, list[int]] = {}
    for index in sorted(range(len(labels)), key=lambda i: (margins[i], i)):
        groups.setdefault(labels[index], []).append(index)
    ordered = list(groups.values())  # (in the order of each label's least sure)
    return [group[turn] for turn in range(max(map(len, ordered), default=0)) for group in ordered if turn < len(group)]
