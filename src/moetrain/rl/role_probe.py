"""The role CPU probe of a job as ``moetrain rl`` would run it: ``moetrain profile --rl-out FILE --rl-job rl.yaml``.

``moetrain simulate --rl`` prices a disaggregated job at k ≥ 1 on one CPU from each process's CPU-seconds per
step (``planner.rl_cores``), which only this machine can tell: the shipped ``cpu`` preset is another
machine's. This module measures them for the job an rl.yaml describes, the way ``benchmarks/rl_scale.py``
does through the Python API: the warm-up the run would do (its weights decide how long the answers are), then
the job's roles apart at k = 0 (``rates.role_cpu``: two runs, each rank's CPU time differenced per step) and
what a call costs overlapped over apart (``rates.overlap_cpu``, on the job's decode rows and micro-batch).

A colocated job (RL Fusion or colocated StaleSync) is priced the same way from each rank's CPU-seconds per step
(``rates.rank_cpu``: the job run as it is, twice, each rank's CPU time differenced per step): its ranks have no
roles to keep apart, and every phase of it shares the cores.
"""

from __future__ import annotations

import os

import torch

from moetrain.errors import UserError
from moetrain.planner.rl_cores import RoleCPU
from moetrain.planner.rl_rates import ProbedRankCPU, ProbedRoleCPU
from moetrain.rl.rates import MixedWork, check_probe_steps, check_role_cpu_job, overlap_cpu, rank_cpu, role_cpu
from moetrain.rl.run import build_rl_run, pipeline_weights, stalesync_job
from moetrain.rl.spec import RLRunSpec


def probe_job_cpu(spec: RLRunSpec, tries: int) -> ProbedRoleCPU:
    """Each process's CPU-seconds per step of ``spec``'s disaggregated StaleSync job, its roles apart, carried
    to the roles overlapped (each overlap figure the lowest of ``tries``), and this machine's cores."""
    if not spec.disaggregated:
        raise UserError("--rl-job: the role CPU probe measures a disaggregated StaleSync job on this machine "
                        "(stalesync: {placement: disaggregated, staleness: K}, engine local); give such a job")
    check_probed_job(spec)
    torch.set_num_threads(1)  # as every rank of the run: the forked ranks inherit it
    run = build_rl_run(spec)
    job = stalesync_job(run, pipeline_weights(run))  # the weights the ranks would start from, as rl.launch makes them
    work = role_cpu(job).role_cpu
    training = run.grpo.training
    mixed = MixedWork(run.model_cfg.num_layers, spec.samples_per_step // job.replicas, training.micro_batch,
                      training.seq_len)
    overlap = overlap_cpu(job.replicas, len(job.roles.trainer_group), mixed, tries)
    return ProbedRoleCPU(RoleCPU(work.rollout_s, work.trainer_s, overlap.factors), float(os.cpu_count() or 1))


def probe_colocated_cpu(spec: RLRunSpec) -> ProbedRankCPU:
    """Each rank's CPU-seconds per step of ``spec``'s colocated job (RL Fusion, or colocated StaleSync) as it
    runs at its k (``rates.rank_cpu``), and this machine's cores."""
    check_probed_job(spec)
    torch.set_num_threads(1)  # as every rank of the run: the forked ranks inherit it
    return ProbedRankCPU(rank_cpu(spec).rank_cpu, float(os.cpu_count() or 1))


def probe_cpu(spec: RLRunSpec, tries: int) -> ProbedRoleCPU | ProbedRankCPU:
    """The probe of ``spec``'s placement: a disaggregated job's roles apart, a colocated job's ranks as it runs."""
    return probe_job_cpu(spec, tries) if spec.disaggregated else probe_colocated_cpu(spec)


def check_probed_job(spec: RLRunSpec) -> None:
    """Refuse, before anything is measured, a job the probe cannot measure."""
    if spec.engine != "local":
        raise UserError("--rl-job: the CPU probe measures a job on this machine's ranks (engine local); give such "
                        "a job")
    if not spec.disaggregated:
        check_probe_steps("rank", spec.trainer.training.steps)
        return
    check_role_cpu_job(spec.roles, spec.trainer.training.steps)

