"""How many CPU threads each rank's torch runs: the cores this process may use that are not busy.

On a CPU, torch's default (one thread per core) is the worst choice on a machine that is doing other
work: OpenMP threads spin waiting for cores that another process holds, and a step can take 8× as long
as with one thread (the README's first command: 167 s with 2 threads, 21.7 s with 1, on a 2-core machine
under load). Too few threads only forgo part of the speed, so the choice leans low: the cores this
process may run on (its affinity), minus the cores busy now (the larger of a short sample of
``/proc/stat`` and the 1-minute load average, measured once per process), shared among the ranks that
run on this machine, at least one each. ``--threads`` overrides it, and so does ``OMP_NUM_THREADS``
where the user set it.

Torch-free (``os`` only): ``moetrain train`` chooses before it starts ranks, and the trainer of a lone
process before it builds anything.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

SAMPLE_S = 0.25
"""How long the busy cores are sampled (``/proc/stat``) before the choice."""


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    """Threads of each rank."""
    reason: str
    """Why, in a few words for the run's first line."""
    from_environment: bool = False
    """``OMP_NUM_THREADS`` set by the user: torch already runs that many (or what the program set since),
    so a process leaves its thread count as it is."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all cores, from the first line of ``/proc/stat``; None without it."""
    try:
        with open("/proc/stat") as stat:
            fields = [float(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


@functools.cache
def busy_cores(sample_s: float = SAMPLE_S) -> float:
    """Cores busy now: the larger of the last ``sample_s`` seconds' use of all cores (``/proc/stat``) and
    the 1-minute load average, which also remembers a job that pauses."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    before = _cpu_times()
    if before is None:
        return load
    time.sleep(sample_s)
    after = _cpu_times()
    if after is None or after[1] <= before[1]:
        return load
    share = (after[0] - before[0]) / (after[1] - before[1])
    return max(load, share * (os.cpu_count() or 1))


def choose_threads(requested: int | None, ranks: int = 1, cores: int | None = None,
                   busy: float | None = None) -> ThreadChoice:
    """Threads per rank for ``ranks`` ranks on this machine: ``requested`` when given, else the free cores
    (``cores`` usable minus ``busy``, measured when not given) shared among the ranks, at least one."""
    if requested is not None:
        return ThreadChoice(requested, f"--threads {requested}")
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return ThreadChoice(int(env), f"OMP_NUM_THREADS={env}", from_environment=True)
    cores = cores if cores is not None else usable_cores()
    busy = busy if busy is not None else busy_cores()
    free = max(1, int(cores - busy + 0.5))
    threads = max(1, free // ranks)
    sharing = f", {ranks} ranks" if ranks > 1 else ""
    return ThreadChoice(threads, f"{free} of {cores} cores free{sharing}")
