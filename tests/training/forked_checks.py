"""Run as a program by tests/training/test_delta_contents.py: what a Celery prefork worker does with the
contents check. The pool's parent imports the tasks, and with them this module's read buffer (made for the
main thread at import), then forks its children; each sets one torch thread (``fleet.celery``) and verifies
deltas while the other does. Here two children check their own files from disk again and again at the same
time; the answers (one list per child) are printed as JSON. A fresh interpreter, not the test's own process:
a process that ran torch on its OpenMP threads before the fork hangs in a child's first BLAS call, and a
worker's parent never runs torch."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import django
import torch

from edge_agent.delta import encode_delta

SHAPES = {f"layers.{i}.lora_{ab}.weight": [256, 256] for i in range(3) for ab in "AB"}  # 1.5 MiB: two reads
ROUNDS = 15


def _adapter() -> SimpleNamespace:
    spec = {name: {"shape": shape, "dtype": "F32"} for name, shape in SHAPES.items()}
    return SimpleNamespace(tensor_spec=spec, aggregation={"max_norm": None}, dp={})


def _write_files(folder: Path, count: int) -> list[tuple[str, str]]:
    files = []
    for seed in range(count):
        generator = torch.Generator().manual_seed(seed)
        data = encode_delta({name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()})
        path = folder / f"{seed}.safetensors"
        path.write_bytes(data)
        files.append((str(path), hashlib.sha256(data).hexdigest()))
    return files


def _child(files: list[tuple[str, str]], answers) -> None:
    # Imported in the parent before the fork (main): this only names it. Not at the top: the training package needs
    # Django set up first, which the program does under __main__.
    from training.federation.delta_contents import Rejection, contents_check

    torch.set_num_threads(1)  # as fleet.celery's worker_process_init

    found = []
    for _ in range(ROUNDS):
        for path, sha256 in files:
            try:
                with open(path, "rb") as handle:
                    size = os.path.getsize(path)
                    found.append(contents_check(handle, size=size, sha256=sha256, adapter=_adapter())[0])
            except Rejection as rejection:
                found.append(f"{rejection.code}: {rejection.detail}")
    answers.put(found)


def main(folder: str) -> None:
    torch.set_num_threads(1)  # writing the files starts no OpenMP threads to break the fork
    files = _write_files(Path(folder), 4)
    # The import is the moment the main thread's buffers are made, as in a worker's parent; after Django's setup.
    import training.federation.delta_contents  # noqa: F401

    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    children = [context.Process(target=_child, args=(files[half::2], answers)) for half in (0, 1)]
    for child in children:
        child.start()
    found = [answers.get(timeout=60) for _ in children]
    for child in children:
        child.join(timeout=30)
    print(json.dumps({"exitcodes": [child.exitcode for child in children], "answers": found}))


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleet.settings")
    django.setup()
    main(sys.argv[1])
