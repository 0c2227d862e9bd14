"""Every name the scripts under benchmarks/ and tools/ import from moetrain exists.

The scripts are not imported by the suite, so a module moved inside the package (``train.host_memory`` became
``runtime_base.host_memory``) would break one silently until somebody runs it for a result. This reads each
script's imports without running it and resolves each against the package as it is.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("tools/*.py")])


def _imported(script: Path) -> list[tuple[str, str | None, int]]:
    """(module, name or None for a plain ``import``, line) of each moetrain import in ``script``."""
    found = []
    for node in ast.walk(ast.parse(script.read_text(), filename=str(script))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("moetrain"):
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names if alias.name.startswith("moetrain")]
    return found


def _missing(module: str, name: str | None) -> str | None:
    """Why ``from module import name`` (or ``import module``) would fail, or None."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a parent package is gone too
        spec = None
    if spec is None:
        return f"no module {module}"
    if name is None or name == "*":
        return None
    parent = importlib.import_module(module)
    if hasattr(parent, name):
        return None
    if hasattr(parent, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None:
        return None  # a submodule not imported by its package
    return f"{module} has no {name}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_scripts_moetrain_imports_resolve(script: Path) -> None:
    broken = [f"line {line}: {why}" for module, name, line in _imported(script)
              if (why := _missing(module, name)) is not None]
    assert not broken, f"{script.relative_to(ROOT)}: " + "; ".join(broken)


def test_a_moved_module_is_reported(tmp_path: Path) -> None:
    script = tmp_path / "old.py"
    script.write_text("from moetrain.train.host_memory import keep_freed_host_memory\n"
                      "from moetrain.runtime_base.host_memory import no_such_function\n")
    assert [_missing(m, n) for m, n, _ in _imported(script)] == [
        "no module moetrain.train.host_memory", "moetrain.runtime_base.host_memory has no no_such_function"]
