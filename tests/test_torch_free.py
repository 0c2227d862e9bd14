"""Configs, cost formulas, the planner and the balance/memory policies import no torch, so they run
anywhere in milliseconds; the runtime imports them, never the other way round."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "moetrain"

TORCH_FREE = [
    "moetrain.cli",
    "moetrain.config",
    "moetrain.costs.params",
    "moetrain.costs.flops",
    "moetrain.costs.activations",
    "moetrain.planner.search",
    "moetrain.planner.timeline",
    "moetrain.planner.validation",
    "moetrain.memory.policy",
    "moetrain.balance.placement",
    "moetrain.balance.solver",
    "moetrain.balance.replay",
    "moetrain.schedules",
]
# The planning side: packages whose every module must stay off torch, the command line and the runtime.
PLANNING_PACKAGES = ("planner", "costs", "config", "balance")
RUNTIME = ("moetrain.cli", "moetrain.distributed", "moetrain.models", "moetrain.train", "torch")


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_planning_side_imports_no_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in TORCH_FREE) + (
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    assert _run(code) == "[]"


def test_importing_the_planner_costs_and_config_loads_no_torch():
    code = "import moetrain.planner, moetrain.costs, moetrain.config, sys; print('torch' in sys.modules)"
    assert _run(code) == "False"
    # Every module of the planning packages, not only their __init__.
    modules = sorted(f"moetrain.{'.'.join(p.relative_to(SRC).with_suffix('').parts)}"
                     for package in PLANNING_PACKAGES for p in (SRC / package).rglob("*.py") if p.name != "__init__.py")
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('torch' in sys.modules)"
    assert _run(code) == "False"


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, those inside functions too; ``from moetrain import x``
    counts as importing ``moetrain.x``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import; the checks below read absolute names"
            found.append((node.lineno, node.module or ""))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


@pytest.mark.parametrize("package", PLANNING_PACKAGES)
def test_planning_packages_import_no_cli_runtime_or_torch(package: str):
    offending = [f"{path.relative_to(SRC)}:{line} imports {module}"
                 for path in sorted((SRC / package).rglob("*.py"))
                 for line, module in _imported_modules(path)
                 if any(module == bad or module.startswith(bad + ".") for bad in RUNTIME)]
    assert offending == []


def test_the_import_reader_sees_what_it_must_refuse(tmp_path: Path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch.nn\nfrom moetrain import cli\n\ndef f():\n    from moetrain.train.optim import x\n")
    assert [m for _, m in _imported_modules(sample)] == ["torch.nn", "moetrain", "moetrain.cli", "moetrain.train.optim",
                                                         "moetrain.train.optim.x"]


def test_cli_lists_every_command():
    from moetrain.cli import COMMANDS, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(COMMANDS)
