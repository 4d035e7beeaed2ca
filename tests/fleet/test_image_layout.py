"""The production image holds every package the project installs: a package added to pyproject.toml (as
``core`` and ``demo`` were) and not copied into the image breaks the image at start, not any other test."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_dockerfile_copies_every_package_of_the_project():
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (ROOT / "Dockerfile").read_text(), flags=re.M))
    assert packages <= copied, f"not copied into the image: {sorted(packages - copied)}"
    assert all((ROOT / name / "__init__.py").exists() for name in packages)


def test_the_dockerfile_copies_what_the_build_reads_and_a_compiler_for_the_compiled_loops():
    text = (ROOT / "Dockerfile").read_text()
    (files,) = re.findall(r"^COPY ((?:[\w.]+ )+)\./$", text, flags=re.M)
    assert {"pyproject.toml", "setup.py", "README.md"} <= set(files.split())
    # setup.py's extension is optional: without gcc the image would build, and its workers sum with numpy.
    assert re.search(r"apt-get install [^\n]*\bgcc\b[\s\S]*pip install '\.\[server", text)
