"""``moetrain profile --rl-out FILE --rl-job rl.yaml`` (``moetrain.rl.role_probe``): the role CPU probe of the job
an rl.yaml describes, written into the rates file's ``role_cpu`` that ``moetrain simulate --rl`` shares over the
cores. The probes themselves are ``rates.role_cpu`` and ``rates.overlap_cpu`` (tests/rl/test_rl_role_cpu.py); here
they are stand-ins, so what is checked is the job they are given and what reaches the file."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import yaml

from moetrain.cli import main
from moetrain.errors import UserError
from moetrain.planner.generation import HostCosts
from moetrain.planner.rl_cores import RankCPU, RoleCPU
from moetrain.planner.rl_rates import ProbedRankCPU, ProbedRoleCPU, RLRates, load_rl_rates
from moetrain.planner.rl_step import SyncRates
from moetrain.rl import rates, role_probe
from moetrain.rl.spec import resolve_rl_spec

JOB = {"model": "tiny-pangu", "sft": {"steps": 0},
       "rl": {"task": "sort", "prompts_per_step": 4, "grpo": {"group_size": 4}, "max_new_tokens": 8},
       "trainer": {"training": {"steps": 6, "micro_batch": 4}, "parallel": {"dp": 2}, "run": {"quiet": True}},
       "stalesync": {"staleness": 1, "placement": "disaggregated"}, "rollout": {"replicas": 2}}


def _fake_probes(monkeypatch) -> list:
    seen = []

    def fake_role_cpu(job):
        seen.append(("role_cpu", job))
        return rates.RoleCPUProbe((4, 6), ((1.0,) * 4, (1.5,) * 4), RoleCPU((0.3, 0.5), (0.4, 0.6)))

    def fake_overlap(decoders, trainers, work, tries):
        seen.append(("overlap", decoders, trainers, work, tries))
        return rates.OverlapCPU({rates.DECODE: 0.01, rates.TRAIN: 0.2}, {rates.DECODE: 0.01, rates.TRAIN: 0.3})

    monkeypatch.setattr(role_probe, "role_cpu", fake_role_cpu)
    monkeypatch.setattr(role_probe, "overlap_cpu", fake_overlap)
    return seen


def test_the_probe_measures_the_job_the_spec_describes(monkeypatch):
    seen = _fake_probes(monkeypatch)
    probed = role_probe.probe_job_cpu(resolve_rl_spec([JOB], ["rl.yaml"]), tries=3)
    (_, job), (_, decoders, trainers, work, tries) = seen
    assert (job.replicas, job.ranks_per_replica, list(job.roles.trainer_group)) == (2, 1, [2, 3])
    assert job.stale.staleness == 1 and job.spec.training.steps == 6  # role_cpu runs it at k = 0 itself
    assert job.initial is None  # no warm-up, no start_from: the ranks build the policy from the seed
    # each replica decodes half of the 16 samples; a trainer micro-batch is 4 rows of the trained length
    assert (decoders, trainers, tries) == (2, 2, 3)
    assert work == rates.MixedWork(job.model_cfg.num_layers, 8, 4, job.spec.training.seq_len)
    assert probed == ProbedRoleCPU(RoleCPU((0.3, 0.5), (0.4, 0.6), (1.0, pytest.approx(1.5))), float(os.cpu_count()))


def test_the_probe_refuses_a_job_that_is_not_disaggregated():
    colocated = {**JOB, "stalesync": {"staleness": 1, "placement": "colocated"}, "rollout": {}}
    with pytest.raises(UserError, match=r"^--rl-job: the role CPU probe measures a disaggregated StaleSync job on "
                                        r"this machine \(stalesync: \{placement: disaggregated, staleness: K\}, "
                                        r"engine local\); give such a job$"):
        role_probe.probe_job_cpu(resolve_rl_spec([colocated], ["rl.yaml"]), tries=1)


def test_profile_writes_the_probed_cpu_that_simulate_then_shares(tmp_path, monkeypatch, capsys):
    """The CLI route end to end, the probes stood in for: ``profile --rl-job`` puts them in ``--rl-out``'s
    role_cpu, and ``simulate --rl --rl-rates`` prices the job at k = 1 from them: 0.3, 0.5, 0.4 × 1.5, 0.6 × 1.5
    CPU-seconds on 2 cores by processor sharing, 1.3 s (tests/planner/test_rl_rates_file.py has the steps)."""
    from moetrain.train import calibrate

    job = tmp_path / "rl.yaml"
    job.write_text(yaml.safe_dump(JOB))
    calibration = SimpleNamespace(save=lambda path: None)
    monkeypatch.setattr(calibrate, "profile_calibration", lambda *a: SimpleNamespace(
        calibration=calibration, model=None, efficiencies={}, cluster=SimpleNamespace(device="cpu"), arch="cpu",
        link=None))
    host_rates = RLRates(HostCosts(host_is_device=True), SyncRates(2e9, 1e9, 5e8), "stand-in")
    monkeypatch.setattr(rates, "measure_rl_rates", lambda model, repeats: host_rates)
    monkeypatch.setattr(role_probe, "probe_job_cpu", lambda spec, tries: ProbedRoleCPU(
        RoleCPU((0.3, 0.5), (0.4, 0.6), (1.0, 1.5)), 2.0))
    out = tmp_path / "rates.yaml"
    assert main(["profile", "--device", "cpu", "--repeats", "1", "--out", str(tmp_path / "cal.yaml"),
                 "--rl-out", str(out), "--rl-job", str(job)]) == 0
    assert ("role CPU per step, roles apart: replicas 0.3, 0.5 s, trainer ranks 0.4, 0.6 s; overlapped ×1.00 and "
            "×1.50; 2 cores") in capsys.readouterr().out
    assert load_rl_rates(out).role_cpu == ProbedRoleCPU(RoleCPU((0.3, 0.5), (0.4, 0.6), (1.0, 1.5)), 2.0)
    assert main(["simulate", "--rl", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "4",
                 "--rollout-devices", "2", "--placement", "disaggregated", "--staleness", "1", "--prompts", "4",
                 "--group-size", "4", "--prompt-len", "7", "--response-len", "8", "--dtype", "fp32",
                 "--rl-rates", str(out), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["predictions"]
    assert row["step_model"] == "processor sharing" and row["step_s"] == pytest.approx(1.3)


def test_rl_job_needs_rl_out_and_a_readable_job(tmp_path, capsys):
    assert main(["profile", "--device", "cpu", "--rl-job", str(tmp_path / "rl.yaml")]) == 2
    assert capsys.readouterr().err == ("moetrain profile: error: --rl-job needs --rl-out (the rates file its probed "
                                       "CPU-seconds go into)\n")
    missing = tmp_path / "rl.yaml"
    assert main(["profile", "--device", "cpu", "--rl-out", str(tmp_path / "r.yaml"), "--rl-job", str(missing)]) == 2
    assert capsys.readouterr().err == (f"moetrain profile: error: --rl-job {missing} does not exist; give a YAML "
                                       "file with model, sft, rl, trainer, generation, rollout, stalesync\n")


@pytest.mark.parametrize(("change", "message"), [
    ({"stalesync": {"staleness": 1, "placement": "colocated"}, "rollout": {},
      "trainer": {**JOB["trainer"], "training": {"steps": 4, "micro_batch": 4}}},
     "the rank CPU probe needs a job of more than 4 steps (got 4); give the job more steps"),
    ({"trainer": {**JOB["trainer"], "training": {"steps": 4, "micro_batch": 4}}},
     "the role CPU probe needs a job of more than 4 steps (got 4); give the job more steps"),
    ({"stalesync": {"staleness": 1, "placement": "disaggregated", "reward_worker": True}},
     "the role CPU probe measures one-rank replicas beside the trainer group, with no reward or reference worker; "
     "probe such a job"),
])
def test_a_job_the_probe_cannot_measure_is_refused_before_any_probe(tmp_path, monkeypatch, capsys, change, message):
    from moetrain.train import calibrate

    def no_calibration(*args):
        raise AssertionError("the job is refused before the calibration's minutes")

    monkeypatch.setattr(calibrate, "profile_calibration", no_calibration)
    job = tmp_path / "rl.yaml"
    job.write_text(yaml.safe_dump({**JOB, **change}))
    assert main(["profile", "--device", "cpu", "--out", str(tmp_path / "cal.yaml"), "--rl-out",
                 str(tmp_path / "r.yaml"), "--rl-job", str(job)]) == 2
    assert capsys.readouterr().err == f"moetrain profile: error: {message}\n"


COLOCATED = {**JOB, "stalesync": {"staleness": 1, "placement": "colocated"}, "rollout": {}}


def _stand_in_calibration(monkeypatch) -> None:
    from moetrain.train import calibrate

    calibration = SimpleNamespace(save=lambda path: None)
    monkeypatch.setattr(calibrate, "profile_calibration", lambda *a: SimpleNamespace(
        calibration=calibration, model=None, efficiencies={}, cluster=SimpleNamespace(device="cpu"), arch="cpu",
        link=None))
    monkeypatch.setattr(rates, "measure_rl_rates", lambda model, repeats: RLRates(
        HostCosts(host_is_device=True), SyncRates(2e9, 1e9, 5e8), "stand-in"))


def test_profile_probes_one_job_of_each_placement_into_its_section(tmp_path, monkeypatch, capsys):
    """``--rl-job`` twice: the disaggregated job's roles into role_cpu, the colocated job's ranks into rank_cpu
    (the probes stood in for), each by the probe of its placement."""
    _stand_in_calibration(monkeypatch)
    probed = []
    monkeypatch.setattr(role_probe, "probe_job_cpu", lambda spec, tries: probed.append("roles") or ProbedRoleCPU(
        RoleCPU((0.3, 0.5), (0.4, 0.6)), 2.0))
    monkeypatch.setattr(role_probe, "probe_colocated_cpu", lambda spec: probed.append(
        ("ranks", spec.stalesync.placement, spec.trainer.world_size)) or ProbedRankCPU(RankCPU((0.9, 0.8), 1), 2.0))
    jobs = [tmp_path / "disaggregated.yaml", tmp_path / "colocated.yaml"]
    jobs[0].write_text(yaml.safe_dump(JOB))
    jobs[1].write_text(yaml.safe_dump(COLOCATED))
    out = tmp_path / "rates.yaml"
    assert main(["profile", "--device", "cpu", "--repeats", "1", "--out", str(tmp_path / "cal.yaml"), "--rl-out",
                 str(out), "--rl-job", str(jobs[0]), "--rl-job", str(jobs[1])]) == 0
    assert probed == ["roles", ("ranks", "colocated", 2)]
    assert "rank CPU per step, colocated at k = 1: ranks 0.9, 0.8 s; 2 cores" in capsys.readouterr().out
    written = load_rl_rates(out)
    assert written.role_cpu == ProbedRoleCPU(RoleCPU((0.3, 0.5), (0.4, 0.6)), 2.0)
    assert written.rank_cpu == ProbedRankCPU(RankCPU((0.9, 0.8), 1), 2.0)
    assert written.measured_on == (f"stand-in; role cpu of --rl-job {jobs[0]}; rank cpu of --rl-job {jobs[1]}")


def test_two_jobs_of_one_placement_are_refused(tmp_path, monkeypatch, capsys):
    from moetrain.train import calibrate

    def no_calibration(*args):
        raise AssertionError("the jobs are refused before the calibration's minutes")

    monkeypatch.setattr(calibrate, "profile_calibration", no_calibration)
    job = tmp_path / "colocated.yaml"
    job.write_text(yaml.safe_dump(COLOCATED))
    assert main(["profile", "--device", "cpu", "--out", str(tmp_path / "cal.yaml"), "--rl-out",
                 str(tmp_path / "r.yaml"), "--rl-job", str(job), "--rl-job", str(job)]) == 2
    assert capsys.readouterr().err == ("moetrain profile: error: --rl-job: give at most one disaggregated and one "
                                       "colocated job (a rates file holds one probe of each)\n")


def test_the_rank_probe_differences_two_runs_of_the_job(monkeypatch):
    """``rates.rank_cpu`` runs the colocated job as it is (its k kept) for 4 steps and for its 6, and takes each
    rank's (long − short) / 2: ranks of 1.0 and 1.2 CPU-s, then 2.0 and 2.6 CPU-s: 0.5 and 0.7 per step."""
    runs = []

    def fake_spawn(fn, world_size, spec):
        runs.append((fn, world_size, spec.trainer.training.steps, spec.stalesync.staleness))
        cpu = {4: (1.0, 1.2), 6: (2.0, 2.6)}[spec.trainer.training.steps]
        return [SimpleNamespace(cpu_s=c) for c in cpu]

    monkeypatch.setattr(rates, "spawn", fake_spawn)
    probe = rates.rank_cpu(resolve_rl_spec([COLOCATED], ["rl.yaml"]))
    assert runs == [(rates.colocated_with_cpu, 2, 4, 1), (rates.colocated_with_cpu, 2, 6, 1)]
    assert probe.steps == (4, 6) and probe.cpu_s == ((1.0, 1.2), (2.0, 2.6))
    assert probe.rank_cpu == RankCPU((pytest.approx(0.5), pytest.approx(0.7)), 1)
