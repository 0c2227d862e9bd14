"""Every figure in benchmarks/results/ says where it came from, and the CPU ones can be made again.

Each JSON result carries ``command``, ``commit`` and ``machine`` (an object) at the top, each JSONL
result (routing traces) on its first line under ``provenance``; ``benchmarks/regenerate_cpu.sh`` reruns
every result that was not measured on a GPU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = BENCHMARKS / "results"
GPU = re.compile(r"(^gpu_|_gpu|_cuda|_(?:gb|[abh])\d{3}(?:_|$))")  # a GPU's tag: _h100, _h200, _b200 ...
# GPU records written before the machine was an object (a device name), kept as measured: GPU results
# are rerun on a GPU machine only (benchmarks/gpu_suite.sh).
MACHINE_AS_NAME = {"memory_gpu_seq8192.json"}
# The same benchmark at an older commit, kept as the "before" its docs compare with (not regenerated).
HISTORICAL = {"planner_screen_vs_timeline_3a11047.json"}


def _records() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir() if p.suffix in (".json", ".jsonl"))


@pytest.mark.parametrize("path", _records(), ids=lambda p: p.name)
def test_every_result_records_command_commit_and_machine(path: Path) -> None:
    if path.suffix == ".jsonl":
        record = json.loads(path.read_text().splitlines()[0])["provenance"]
    else:
        record = json.loads(path.read_text())
    assert isinstance(record["command"], str) and record["command"]
    assert re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", record["commit"]), record["commit"]
    if path.name not in MACHINE_AS_NAME:
        assert isinstance(record["machine"], dict) and record["machine"].get("platform")


def test_one_script_regenerates_every_cpu_result() -> None:
    script = (BENCHMARKS / "regenerate_cpu.sh").read_text()
    benchmarks = re.findall(r"^run (\w+)\.py", script, flags=re.MULTILINE)
    # a result is named in the script, or its name starts with the benchmark that writes it by default (or
    # is what ``writer`` says that benchmark writes)
    writer = {"memory_cpu": "memory_policy"}
    missing = [p.name for p in _records()
               if not GPU.search(p.stem) and p.name not in HISTORICAL and p.name not in script
               and not any(writer.get(p.stem, p.stem).startswith(b) for b in benchmarks)]
    assert missing == []
