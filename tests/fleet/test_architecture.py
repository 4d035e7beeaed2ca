"""The layers hold in the code, not only in the import contracts (pyproject.toml, checked by ``make lint``):
an import between top-level packages made inside a function hides a dependency from both the reader and
import-linter's static view only if nobody says why. Each such import carries a comment (on its line or the
line above) saying why it must be lazy (docs/architecture.md, "Layers")."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"core", "accounts", "devices", "training", "frontend", "demo", "fleet", "edge_agent"}


def _lazy_cross_imports(path: Path, own: str | None = None) -> list[tuple[int, str]]:
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    own = own or path.relative_to(ROOT).parts[0]
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if in_function and isinstance(child, ast.Import | ast.ImportFrom) and not getattr(child, "level", 0):
                names = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or ""]
                if any(name.split(".")[0] in PACKAGES - {own} for name in names):
                    line, above = lines[child.lineno - 1], lines[child.lineno - 2].strip()
                    if "#" not in line and not above.startswith("#"):
                        found.append((child.lineno, line.strip()))
            visit(child, inside)

    visit(tree, False)
    return found


def test_no_import_between_packages_inside_a_function_without_a_reason():
    unexplained = [
        f"{path.relative_to(ROOT)}:{lineno}: {line}"
        for package in sorted(PACKAGES)
        for path in sorted((ROOT / package).rglob("*.py"))
        if "migrations" not in path.parts
        for lineno, line in _lazy_cross_imports(path)
    ]
    assert not unexplained, "say why each must be lazy, or import it at the top:\n" + "\n".join(unexplained)


def test_the_check_finds_an_unexplained_lazy_import(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text("def f():\n    from training.models import Delta\n\n    return Delta\n")
    assert _lazy_cross_imports(module, own="devices") == [(2, "from training.models import Delta")]
    assert _lazy_cross_imports(module, own="training") == []  # within its own package
    module.write_text(
        "def f():\n    # the models are not ready when this module is imported\n    from training.models import Delta\n"
    )
    assert _lazy_cross_imports(module, own="devices") == []


def test_every_module_and_name_the_architecture_map_cites_exists():
    """docs/architecture.md names modules (``training.federation.intake``) and their functions or classes
    (``lifecycle.rollout_tick``, ``devices.socket_hooks.training_side()``): each must still be there."""
    import importlib
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    cited = set(re.findall(r"`((?:" + "|".join(PACKAGES) + r")(?:\.\w+)+)(?:\(\))?`", text))
    assert len(cited) > 20
    missing = []
    for dotted in sorted(cited):
        parts = dotted.split(".")
        for split in range(len(parts), 0, -1):
            try:
                target = importlib.import_module(".".join(parts[:split]))
            except ImportError:
                continue
            try:
                for attribute in parts[split:]:
                    target = getattr(target, attribute)
            except AttributeError:
                missing.append(dotted)
            break
        else:
            missing.append(dotted)
    assert not missing, f"docs/architecture.md cites what is not there: {missing}"
    for path in re.findall(r"`((?:" + "|".join(PACKAGES) + r"|tests|docs)/[\w/.]+)`", text):
        assert (ROOT / path.split("*")[0]).exists() or list(ROOT.glob(path)), path
