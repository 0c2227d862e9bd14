"""``benchmarks/gpu_suite.sh --dry-run``: the GPU slot's script rehearsed on the CPU, so that no GPU minute is
spent on a typo in a step's command. The quick steps run here whole (each benchmark at tiny sizes); the
training-step ones (step_speed, memory, simulator: minutes with a cold compile cache) have tests of their own
scripts (tests/benchmarks/test_step_speed.py) and run in the full rehearsal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import ROOT

QUICK_STEPS = ("preflight", "peers", "rl_generation", "rl_switch")


def _suite(tmp_path: Path, *steps: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "RESULTS": str(tmp_path)}
    env.pop("OUT", None)  # the device tool's return folder: a rehearsal packs nothing
    return subprocess.run(["bash", str(ROOT / "benchmarks/gpu_suite.sh"), "--dry-run", *steps], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_quick_steps_rehearse_on_the_cpu_and_record_where_they_ran(tmp_path: Path) -> None:
    suite = _suite(tmp_path, *QUICK_STEPS)
    assert suite.returncode == 0, suite.stdout + suite.stderr
    summary = suite.stdout.split("=== summary", 1)[1].splitlines()[1:]
    assert [line.split(":")[0] for line in summary] == list(QUICK_STEPS)
    failed = [line for line in summary if ": exit 0 after" not in line]
    assert not failed, f"{failed}\n" + "\n".join((tmp_path / "gpu_logs" / f"{line.split(':')[0]}.log").read_text()
                                               for line in failed)
    # results are named by the device they ran on (here the CPU), with command, commit and machine
    records = sorted(p.name for p in tmp_path.glob("*.json"))
    assert records == ["moe_layer_peers_cpu.json", "rl_generation_cpu.json", "rl_switch_cpu.json"]
    for name in records:
        record = json.loads((tmp_path / name).read_text())
        assert record["command"] and record["commit"] and record["machine"]["device"] == "cpu", name


def test_an_unknown_step_is_named_with_the_steps_there_are(tmp_path: Path) -> None:
    suite = _suite(tmp_path, "step_sped")
    assert suite.returncode == 2
    assert suite.stdout.splitlines()[-1] == ("unknown step step_sped; steps: preflight tests step_speed peers memory "
                                             "simulator rl_generation rl_switch memory_swap")
