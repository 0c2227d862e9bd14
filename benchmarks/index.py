"""Print every result's provenance, to check the tables of benchmarks/README.md after a rerun.

    python benchmarks/index.py   # one line per result: name | commit | machine | command

Reads ``command``, ``commit`` and ``machine`` from each JSON result (a JSONL routing trace: its first line's
``provenance``), as ``_record.py`` writes them. Needs no torch. That the README names every script and
result, and only files that exist, is checked by ``tests/test_results_index.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"


def provenance(path: Path) -> dict:
    """The command, commit and machine a result records; an empty dict for a plot or a log."""
    if path.suffix == ".json":
        return json.loads(path.read_text())
    if path.suffix == ".jsonl":
        return json.loads(path.read_text().splitlines()[0])["provenance"]
    return {}


def machine_name(machine: dict | str | None) -> str:
    """``CPU, 2 threads`` or the GPU's name (older GPU records hold the name as a string)."""
    if isinstance(machine, str) or machine is None:
        return machine or "?"
    device = machine.get("device", "?")
    if device != "cpu":
        return device
    threads = machine.get("threads")
    return f"CPU, {threads} thread{'' if threads == 1 else 's'}"


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    for path in sorted(RESULTS.rglob("*")):
        record = provenance(path) if path.is_file() else {}
        if record:
            print(f"{path.relative_to(RESULTS)} | {record.get('commit')} | {machine_name(record.get('machine'))} | "
                  f"{record.get('command')}")


if __name__ == "__main__":
    main()
