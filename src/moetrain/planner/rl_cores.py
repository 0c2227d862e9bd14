"""A disaggregated RL step whose processes share fewer CPU cores than there are processes: R rollout
replicas beside a trainer group of T ranks on one C-core CPU (C < R + T), priced from the CPU time each
process spends per step when it runs alone.

CPU time is work: a process that waits in a gloo receive or a collective takes none (gloo blocks, it
does not spin), and time-slicing on a busy machine stretches a process's wall time but not its CPU time.
So each process's CPU-seconds per step, measured where the roles do not overlap (StaleSync at k = 0: the
replicas generate, then the trainer ranks train, never more processes at once than cores), is the
work the overlapped step (k ≥ 1) has to fit into the cores. ``moetrain.rl.rates.role_cpu`` measures it.

In the steady state of k ≥ 1 every step is one round of a two-stage pipeline: the replicas generate
batch s + 1 while the trainer trains step s, and neither starts its next round before the other has
handed over (the batch one way, the weights the other). Within a round the kernel shares the cores
between the runnable processes (processor sharing, as Linux's fair scheduler does): all n at
min(1, C / n) of a core until the smallest work is done, then the n − 1 left at min(1, C / (n − 1)), and
so on (``processor_sharing_time``). That lies between the two bounds of the round: no process runs on
more than one core (the largest work), and the cores do at most C seconds of work per second (the total
over C); it meets the total over C when the works are alike and n ≥ C, the largest work when C ≥ n.

A process's work is not quite the same CPU time overlapped as apart: processes time-sliced on one core
evict each other's caches, and a core's other hardware thread may be busy. ``RoleCPU.overlap`` carries
each role's works by that factor, measured on the job's own kinds of work (``moetrain.rl.rates.overlap_cpu``:
the CPU time of a decode step and of a training micro-batch, each kind on its own, then all at once).

The weight sync's copies and checks and the batch's hand-over are CPU work of the processes that do
them, so they are in the measured figures; what stays out is the latency of a hand-over that no process
spends CPU on (a loopback message: tens of µs).

A colocated job (RL Fusion, colocated StaleSync) on such a CPU is the same physics with one kind of
process: every rank generates and trains, and its N ranks share the C cores whatever k is (at k = 0 all
ranks run each phase at once; at k ≥ 1 each rank's generating thread runs beside its training thread). Its
ranks' CPU-seconds per step (``RankCPU``, probed by ``moetrain.rl.rates.rank_cpu`` on the job itself) are
shared by the same processor sharing (``colocated_cpu_step``): N equal works w on C < N cores take N·w / C.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moetrain.errors import UserError


@dataclass(frozen=True)
class RoleCPU:
    """CPU-seconds per step of each process of a disaggregated job, each measured while it runs alone
    (``moetrain.rl.rates.role_cpu``)."""

    rollout_s: tuple[float, ...]
    """One per rollout replica (a replica of one process): its generation, scoring and weight receive."""
    trainer_s: tuple[float, ...]
    """One per trainer rank: its step (forward, backward, gradient all-reduce, optimizer), the batch's
    hand-over and the packing of the weight push."""
    overlap: tuple[float, float] = (1.0, 1.0)
    """(rollout, trainer): what a process's work costs in CPU time when the roles overlap over what it
    costs apart (measured, ``moetrain.rl.rates.overlap_cpu``): processes time-sliced on a core evict each
    other's caches; 1: no such cost."""

    @property
    def processes(self) -> tuple[float, ...]:
        """Every process's CPU-seconds per step with the roles overlapped: replicas first, then trainer ranks."""
        rollout, trainer = self.overlap
        return tuple(w * rollout for w in self.rollout_s) + tuple(w * trainer for w in self.trainer_s)

    @property
    def total_s(self) -> float:
        """The CPU work of one step over every process."""
        return sum(self.processes)


def processor_sharing_time(works: Sequence[float], cores: float) -> float:
    """Seconds until every process is done when processes of ``works`` CPU-seconds each share ``cores``
    cores' worth of compute by processor sharing, each at most one core: with n still running, each runs
    at min(1, cores / n), so the smallest remaining work ends first and its share goes to the others."""
    if cores <= 0:
        raise UserError(f"processes need cores to run on (got {cores}); give a positive core count")
    remaining = sorted(w for w in works if w > 0)
    elapsed, done = 0.0, 0.0  # done: the CPU-seconds every process still running has had so far
    for i, work in enumerate(remaining):
        rate = min(1.0, cores / (len(remaining) - i))
        elapsed += (work - done) / rate
        done = work
    return elapsed


def shared_cpu_step(work: RoleCPU, cores: float) -> float:
    """The steady step of a disaggregated job at k ≥ 1 on one CPU of ``cores`` cores: one pipeline round,
    every process's CPU-seconds per step shared by processor sharing (``processor_sharing_time``)."""
    return processor_sharing_time(work.processes, cores)


def cpu_bounds(work: RoleCPU, cores: float) -> tuple[float, float]:
    """The two bounds of a round (no step is shorter than either): the largest process's work (one core at
    most) and the total work over the cores."""
    return max(work.processes), work.total_s / cores


@dataclass(frozen=True)
class RankCPU:
    """CPU-seconds per step of each rank of a colocated job, probed on the job as it runs
    (``moetrain.rl.rates.rank_cpu``): its generation, training, reshard and gathers together."""

    rank_s: tuple[float, ...]
    """One per rank, by rank."""
    staleness: int
    """The k the probe ran at: its works price the colocated jobs of that kind (k = 0, or every k ≥ 1)."""


def colocated_cpu_step(work: RankCPU, cores: float) -> float:
    """The step of a colocated job on one CPU of ``cores`` cores: every rank's CPU-seconds per step shared by
    processor sharing (``processor_sharing_time``); with more ranks than cores, the total over the cores
    when the works are alike."""
    return processor_sharing_time(work.rank_s, cores)
