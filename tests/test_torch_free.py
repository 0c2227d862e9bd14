"""Configs, cost formulas, the planner and the balance/memory policies import no torch, so they run
anywhere in milliseconds; the runtime imports them, never the other way round."""

import subprocess
import sys

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


def test_planning_side_imports_no_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in TORCH_FREE) + (
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_lists_every_command():
    from moetrain.cli import COMMANDS, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(COMMANDS)
