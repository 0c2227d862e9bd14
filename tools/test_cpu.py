"""CPU-seconds of test files, for judging the suite's cost on a machine that others load too.

``python tools/test_cpu.py tests/distributed/test_nodes.py [more files or pytest flags]`` runs pytest on
them in one child process (under ``nice -n 10``) with this file as a plugin, and prints the CPU-seconds
(user + system) of each test file: each test's, its fixtures' set-up included, counted in pytest's
process and in every child process it waited for (torchrun and its ranks, forked ranks), then the whole
run's, collection and imports included. Wall time on a loaded machine says little; CPU-seconds do not
depend on what else runs. Ray's actors are not children pytest waits for: their CPU is not counted.
``--tests N`` (first) also prints the N dearest tests by CPU-seconds, each by its node id with its wall
seconds (which count the Ray actors' work and a test's waits on timeouts), for finding what to make cheaper.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

LOG_ENV = "TEST_CPU_LOG"


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ARG001 (the hook's signature)
    """Each test's CPU-seconds, set-up and tear-down included, as one line of the log."""
    start, wall_start = _cpu(), time.monotonic()
    yield
    with open(os.environ[LOG_ENV], "a", encoding="utf-8") as log:
        log.write(json.dumps({"test": item.nodeid, "cpu_s": _cpu() - start,
                              "wall_s": time.monotonic() - wall_start}) + "\n")


def main(argv: list[str]) -> int:
    dearest = int(argv[1]) if argv[:1] == ["--tests"] else 0
    argv = argv[2:] if dearest else argv
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "cpu.jsonl"
        env = dict(os.environ, **{LOG_ENV: str(log)},
                   PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])))
        code = subprocess.call(["nice", "-n", "10", sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                                "-p", Path(__file__).stem, *argv], env=env)
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        rows = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()] if log.exists() else []
    per_file: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        per_file[row["test"].split("::")[0]].append(row["cpu_s"])
    for row in sorted(rows, key=lambda row: -row["cpu_s"])[:dearest]:
        print(f"{row['cpu_s']:8.1f} CPU-s {row['wall_s']:7.1f} wall-s  {row['test']}")
    for name, tests in sorted(per_file.items(), key=lambda item: -sum(item[1])):
        print(f"{sum(tests):8.1f} CPU-s  {len(tests):4d} tests  {name}")
    print(f"{usage.ru_utime + usage.ru_stime:8.1f} CPU-s  the whole run (collection and imports included), "
          f"pytest exit {code}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
