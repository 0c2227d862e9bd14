"""The role CPU probe (``moetrain.rl.rates.role_cpu``): each process's CPU-seconds per step of a disaggregated
StaleSync job with its roles apart (k = 0), from two runs of different lengths, which
``planner.rl_cores`` then shares over the CPU's cores."""

from __future__ import annotations

import pytest
from test_rl_stalesync import _setup

from moetrain.errors import UserError
from moetrain.rl import rates
from moetrain.rl.config import StaleSyncOptions
from moetrain.rl.stalesync import StaleSyncJob


def _job(steps: int, replicas: int = 1, **kwargs) -> StaleSyncJob:
    model, options, spec = _setup(steps)
    spec = spec.model_copy(update={"parallel": spec.parallel.model_copy(update={"dp": 2})})
    return StaleSyncJob(spec, options, StaleSyncOptions(staleness=1), model.cfg, model.state_dict(),
                        replicas=replicas, **kwargs)


def test_a_step_costs_the_difference_of_two_runs_with_the_roles_apart(monkeypatch):
    """Two replicas beside two trainer ranks: a fake run whose ranks spend 1 CPU-s to start and end and
    0.25, 0.30, 0.20, 0.40 per step gives those per step, from runs of 4 and 10 steps at k = 0."""
    seen = []

    def fake_run(job: StaleSyncJob) -> list[float]:
        seen.append((job.stale.staleness, job.spec.training.steps, job.replicas))
        return [1.0 + per_step * job.spec.training.steps for per_step in (0.25, 0.30, 0.20, 0.40)]

    monkeypatch.setattr(rates, "run_cpu_seconds", fake_run)
    probe = rates.role_cpu(_job(10, replicas=2))
    assert seen == [(0, 4, 2), (0, 10, 2)]
    assert probe.steps == (4, 10)
    assert probe.cpu_s == ((2.0, 2.2, 1.8, 2.6), (3.5, 4.0, 3.0, 5.0))
    assert probe.role_cpu.rollout_s == pytest.approx((0.25, 0.30))
    assert probe.role_cpu.trainer_s == pytest.approx((0.20, 0.40))


def test_overlap_factors_are_cpu_overlapped_over_apart(monkeypatch):
    """Two decoders and two trainers: apart a decode step costs 10 ms of CPU and a micro-batch 200 ms;
    overlapped 12 and 230 ms (medians over each kind's processes, the lowest of the tries): ×1.2 and ×1.15."""
    runs = {(2, 0): [[(rates.DECODE, 0.02, 0.010), (rates.DECODE, 0.02, 0.011)],
                     [(rates.DECODE, 0.02, 0.013), (rates.DECODE, 0.02, 0.012)]],
            (0, 2): [[(rates.TRAIN, 0.3, 0.20), (rates.TRAIN, 0.3, 0.20)],
                     [(rates.TRAIN, 0.3, 0.21), (rates.TRAIN, 0.3, 0.22)]],
            (2, 2): [[(rates.DECODE, 0.04, 0.012), (rates.DECODE, 0.04, 0.0125), (rates.TRAIN, 0.6, 0.23),
                      (rates.TRAIN, 0.6, 0.24)],
                     [(rates.DECODE, 0.04, 0.013), (rates.DECODE, 0.04, 0.0135), (rates.TRAIN, 0.6, 0.25),
                      (rates.TRAIN, 0.6, 0.21)]]}
    calls = {key: iter(value) for key, value in runs.items()}
    monkeypatch.setattr(rates, "_mixed_times", lambda decoders, trainers, work: next(calls[decoders, trainers]))
    probe = rates.overlap_cpu(2, 2, rates.MixedWork(4, 64, 64, 20), tries=2)
    # apart: medians 0.0105 and 0.0125 → 0.0105; 0.20 and 0.215 → 0.20. Together: decode medians 0.01225 and
    # 0.01325 → 0.01225; train 0.235 and 0.23 → 0.23
    assert probe.apart_s == {rates.DECODE: pytest.approx(0.0105), rates.TRAIN: pytest.approx(0.20)}
    assert probe.together_s == {rates.DECODE: pytest.approx(0.01225), rates.TRAIN: pytest.approx(0.23)}
    assert probe.factors == (pytest.approx(0.01225 / 0.0105), pytest.approx(1.15))


def test_the_probe_refuses_jobs_it_cannot_split():
    with pytest.raises(UserError, match=r"^the role CPU probe needs a job of more than 4 steps \(got 4\); give the "
                                        r"job more steps$"):
        rates.role_cpu(_job(4))
    with pytest.raises(UserError, match=r"^the role CPU probe measures one-rank replicas beside the trainer group, "
                                        r"with no reward or reference worker; probe such a job$"):
        rates.role_cpu(_job(10, ranks_per_replica=2))


def test_each_rank_process_counts_its_own_cpu_and_more_steps_cost_more():
    """A real run: every rank reports the CPU-seconds of its own process (from its fork on, so the parent's
    work is not in it), and a run of more steps costs every process more: what the probe's difference
    rests on."""
    parent = rates.process_cpu_seconds()  # this process imported torch and built models: seconds of CPU
    # 1 against 8 steps: about 0.5 CPU-s more per rank; 1 against 3 (0.1-0.2 s) inverted once under a loaded
    # suite, where a rank's start-up varies by as much
    short, long = rates.run_cpu_seconds(_job(1)), rates.run_cpu_seconds(_job(8))
    assert len(short) == len(long) == 3  # one replica, two trainer ranks
    assert all(cpu > 0 for cpu in short)
    assert all(few < more for few, more in zip(short, long, strict=True))
    assert max(long) < parent  # a forked rank's count starts at zero, not at the parent's
