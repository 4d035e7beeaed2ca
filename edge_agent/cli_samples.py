"""The ``edge-agent`` commands an application uses beside the running agent (``edge_agent.cli``): samples in
(``add-samples``), the served model's answers out (``predict``, and ``ask`` for the unlabeled samples whose labels
would help most), and its users' word on those answers back (``feedback``). Each is a thin shell over
``edge_agent.api.Agent``: what it prints, and exit status 1 with the reason where the agent refuses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from edge_agent import bounded_json
from edge_agent.api import Agent, NotReady
from edge_agent.feedback import FeedbackError
from edge_agent.sample_files import SampleError
from edge_agent.visible_text import visible


def cmd_add_samples(args) -> int:
    """Every path in turn: a bad one is reported (which, and why) and the next one taken; the exit status is 1
    when any was refused."""
    agent, failed = Agent(args.home), []
    for path in args.paths:
        try:
            added = agent.add_file(path)
        except NotReady as error:
            print(error, file=sys.stderr)
            return 1
        except Exception as error:  # whatever one file does, the others are still taken
            reason = str(error) if isinstance(error, ValueError | OSError) else f"{type(error).__name__}: {error}"
            print(f"{visible(path)}: refused, nothing stored: {visible(reason)}", file=sys.stderr)
            failed.append(path)
            continue
        print(f"{visible(path)}: {added} samples stored ({added.labelled} labelled, {added.unlabeled} unlabeled)")
    if failed:
        print(f"{len(failed)} of {len(args.paths)} refused: {', '.join(visible(p) for p in failed)}", file=sys.stderr)
    return 1 if failed else 0


def cmd_predict(args) -> int:
    agent = Agent(args.home)
    try:
        if args.file and args.file != "-":
            answer = agent.predict(Path(args.file))
        else:
            records = [bounded_json.loads(line) for line in sys.stdin if line.strip()]
            if not records or not all(isinstance(r, dict) for r in records):
                raise SampleError("no samples on standard input (one JSON object a line)")
            answer = agent.predict({name: [r.get(name) for r in records] for name in records[0]})
    except (NotReady, SampleError, OSError) as error:
        print(f"cannot predict: {error}", file=sys.stderr)
        return 1
    except ValueError as error:  # not JSON, or nested too deep
        print(f"cannot predict: standard input is not JSON lines ({error})", file=sys.stderr)
        return 1
    about = {k: answer[k] for k in ("serving", "adapter", "version", "method")}
    for answer_id, label, probabilities in zip(answer["ids"], answer["labels"], answer["probabilities"], strict=True):
        print(json.dumps({"id": answer_id, "label": label, "probabilities": probabilities, **about}))
    return 0


def cmd_ask(args) -> int:
    """The ``count`` questions of ``Agent.ask``, one JSON line each, as ``predict`` prints its answers, with the
    sample's inputs (``inputs``) for the application to show."""
    try:
        asked = Agent(args.home).ask(args.count)
    except (NotReady, ValueError, OSError) as error:  # (AskError is a ValueError)
        print(f"cannot ask: {error}", file=sys.stderr)
        return 1
    if not asked["ids"]:
        print("nothing to ask: no unlabeled sample that is not asked already with its answer open", file=sys.stderr)
    about = {k: asked[k] for k in ("serving", "adapter", "version", "method")}
    for index, answer_id in enumerate(asked["ids"]):
        inputs = {key: value[index].tolist() for key, value in asked["inputs"].items()}
        print(json.dumps({"id": answer_id, "label": asked["labels"][index],
                          "probabilities": asked["probabilities"][index], "margin": asked["margins"][index],
                          "inputs": inputs, **about}))  # fmt: skip
    return 0


def _label_number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise FeedbackError(f"label {visible(text)!r} is not a number") from None


def cmd_feedback(args) -> int:
    """A user's word on one answer of ``predict``: exit 0 with what became of it, or 1 with why it was refused
    (and nothing changed)."""
    try:
        outcome = Agent(args.home).feedback(args.id, _label_number(args.label))
    except (NotReady, FeedbackError) as error:
        print(f"feedback refused, nothing changed: {visible(error)}", file=sys.stderr)
        return 1
    print(json.dumps(outcome))
    return 0
