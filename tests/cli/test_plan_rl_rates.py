"""``moetrain plan --rl --rl-rates``: the plan prices every job with the rates ``moetrain simulate --rl`` prices
it with (the host costs, the weight sync's rates and, for a disaggregated job at k ≥ 1 whose processes are the
probe's, the probed CPU-seconds per process shared over the probed cores), so that simulate's price of plan's
winner is plan's; the jobs the probe cannot price are left out and named; bad input is one line, exit 2."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.planner.generation import HostCosts
from moetrain.planner.rl_cores import RoleCPU
from moetrain.planner.rl_rates import ProbedRoleCPU, RLRates
from moetrain.planner.rl_step import SyncRates
from refusals import refused

RATES = RLRates(HostCosts(layer_forward_us=800.0, sample_ns_per_logit=30.0, host_is_device=True,
                          engine_step_us=500.0, engine_row_us=30.0),
                SyncRates(2e9, 1e9, 5e8), "by hand")
WORKLOAD = ["--model", "tiny-pangu", "--cluster", "cpu", "--devices", "4", "--prompts", "4", "--group-size", "2",
            "--prompt-len", "10", "--response-len", "6", "--dtype", "fp32"]

# One rollout replica beside a trainer group of 3 ranks, probed on a 3-core machine (3, not this VM's 2, so a
# plan that took the cores from anywhere but the file would price another step). Overlapped, the trainer's works
# cost 1.5 times their CPU time: 0.01 | 0.03, 0.03, 0.045. All four run at 3/4 of a core until the replica's 0.01
# is done (0.01 / 0.75 s), the three trainer ranks then at a whole core each until their 0.03 (0.02 s), the last
# alone until its 0.045 (0.015 s).
LIGHT = ProbedRoleCPU(RoleCPU(rollout_s=(0.01,), trainer_s=(0.02, 0.02, 0.03), overlap=(1.0, 1.5)), cores=3.0)
LIGHT_STEP = 0.01 / 0.75 + 0.02 + 0.015
# The same job ten times heavier: its step is ten times as long (every rate scales), 0.4833 s, slower than
# the best job the phases price.
HEAVY = ProbedRoleCPU(RoleCPU(rollout_s=(0.1,), trainer_s=(0.2, 0.2, 0.3), overlap=(1.0, 1.5)), cores=3.0)
HEAVY_STEP = 10 * LIGHT_STEP
PROBED_SPLIT = (1, 1)  # (rollout devices, devices per replica) of the probed job: one one-rank replica


def _json(argv: list[str], capsys) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _plan(tmp_path: Path, capsys, rates: RLRates, *extra: str) -> dict:
    path = tmp_path / "rates.yaml"
    rates.save(path)
    return _json(["plan", "--rl", *WORKLOAD, "--max-staleness", "2", "--rl-rates", str(path), "--top", "100",
                  "--json", "--out", str(tmp_path / "rl.yaml"), *extra], capsys)


def _key(row: dict) -> tuple:
    """The plan's order: the step, then the smaller k, colocated, fewer rollout devices, smaller replicas."""
    return (row["step_s"], row["staleness"], row["placement"] != "colocated", row["rollout_devices"],
            row["gen_devices_per_replica"])


def _split(row: dict) -> tuple[int, int]:
    return row["rollout_devices"], row["gen_devices_per_replica"]


def _overlapped(row: dict) -> bool:
    return row["placement"] == "disaggregated" and row["staleness"] >= 1


def _expected(phases: list[dict], probed_step: float) -> list[dict]:
    """The ranking with the probe, from the ranking without it: the probed job at k ≥ 1 at its hand-computed
    step, the other disaggregated jobs at k ≥ 1 left out, the rest as the phases price them."""
    probed = [row | {"step_s": probed_step, "step_model": "processor sharing"} for row in phases
              if _overlapped(row) and _split(row) == PROBED_SPLIT]
    return sorted(probed + [row for row in phases if not _overlapped(row)], key=_key)


def _simulated(tmp_path: Path, capsys, row: dict) -> dict:
    """``moetrain simulate --rl`` of one plan row: its placement, split, generation layout, k and trainer."""
    t = row["trainer"]
    layout = ["--tp", str(t["tp"]), "--pp", str(t["pp"]), "--vpp", str(t["vpp"]), "--ep", str(t["ep"]), "--etp",
              str(t["etp"]), "--cp", str(t["cp"]), "--zero", str(t["zero"]), "--micro-batch", str(t["micro_batch"]),
              "--recompute", t["recompute"], "--a2a", t["a2a"], "--overlap" if t["overlap"] else "--no-overlap",
              "--sp" if t["sp"] else "--no-sp"]
    split = ["--rollout-devices", str(row["rollout_devices"])] if row["placement"] == "disaggregated" else []
    result = _json(["simulate", "--rl", *WORKLOAD, *layout, *split, "--placement", row["placement"], "--gen-ep",
                    str(row["gen_devices_per_replica"]), "--staleness", str(row["staleness"]), "--rl-rates",
                    str(tmp_path / "rates.yaml"), "--json"], capsys)
    (prediction,) = result["predictions"]
    return prediction


def _phases(tmp_path: Path, capsys) -> list[dict]:
    """Every job of the workload ranked with the measured host and sync rates and no probe."""
    rows = _plan(tmp_path, capsys, RATES)["top"]
    assert all(row["step_model"] == "phases" for row in rows)
    return rows


def test_the_probed_cpu_changes_the_winner(tmp_path, capsys):
    """Without the probe the best job is not one replica beside three trainer ranks; with a light probe of that
    job, it wins at its processor-sharing step, and the other overlapped disaggregated jobs are named."""
    phases = _phases(tmp_path, capsys)
    assert _split(phases[0]) != PROBED_SPLIT or not _overlapped(phases[0])
    expected = _expected(phases, LIGHT_STEP)
    assert _split(expected[0]) == PROBED_SPLIT and expected[0]["staleness"] == 1
    assert expected[0]["step_s"] < phases[0]["step_s"]  # the probe, not the left-out jobs, changes the winner
    plan = _plan(tmp_path, capsys, replace(RATES, role_cpu=LIGHT))
    rows = plan["top"]
    assert [(r["placement"], _split(r), r["staleness"], r["step_model"]) for r in rows] == \
        [(r["placement"], _split(r), r["staleness"], r["step_model"]) for r in expected]
    assert [r["step_s"] for r in rows] == pytest.approx([r["step_s"] for r in expected], rel=1e-12)
    assert rows[0]["step_s"] == pytest.approx(LIGHT_STEP, rel=1e-12) and rows[0]["shared_cores"] == 3.0
    # the k ≥ 1 jobs the probe does not price, each named once
    named = [f"{r['rollout_devices']} generate / {r['train_devices']} train ({r['replicas']} × gen-ep "
             f"{r['gen_devices_per_replica']})" for r in phases
             if _overlapped(r) and r["staleness"] == 1 and _split(r) != PROBED_SPLIT]
    assert named and sorted(plan["unprobed"]) == sorted(named)


@pytest.mark.parametrize(("probe", "probed_step", "step_model"), [(LIGHT, LIGHT_STEP, "processor sharing"),
                                                                  (HEAVY, HEAVY_STEP, "phases")])
def test_simulate_prices_the_plans_winner_as_the_plan_does(tmp_path, capsys, probe, probed_step, step_model):
    """A light probe: the probed job wins and simulate shares the same works over the same cores. A heavy one:
    the probed job loses to a job the phases price, and simulate, given the same rates, prices that the same."""
    expected = _expected(_phases(tmp_path, capsys), probed_step)[0]
    plan = _plan(tmp_path, capsys, replace(RATES, role_cpu=probe))
    winner = plan["top"][0]
    assert (winner["placement"], _split(winner), winner["staleness"], winner["step_model"]) == \
        (expected["placement"], _split(expected), expected["staleness"], step_model)
    assert winner["step_s"] == pytest.approx(expected["step_s"], rel=1e-12)
    simulated = _simulated(tmp_path, capsys, winner)
    assert simulated["step_model"] == step_model
    assert simulated["step_s"] == pytest.approx(winner["step_s"], rel=1e-9)
    assert simulated["phases_s"] == pytest.approx(winner["phases_s"], rel=1e-9)


def test_the_text_names_the_step_model_and_the_jobs_left_out(tmp_path, capsys):
    path = tmp_path / "rates.yaml"
    replace(RATES, role_cpu=LIGHT).save(path)
    out = tmp_path / "rl.yaml"
    assert main(["plan", "--rl", *WORKLOAD, "--max-staleness", "1", "--rl-rates", str(path), "--top", "2", "--out",
                 str(out)]) == 0
    text = capsys.readouterr().out
    first = next(line for line in text.splitlines() if line.startswith(" 1 "))
    assert first.split()[:9] == ["1", "1", "generate", "/", "3", "train", "1", "×", "gen-ep"]
    assert "processor sharing" in first
    assert (f"not priced by {path}'s role_cpu (its processes are another job's), left out at k ≥ 1: ") in text
    assert "probe such a job with `moetrain profile --rl-out FILE --rl-job rl.yaml` to rank it" in text
    assert (f"step {LIGHT_STEP:.4g} s: processor sharing of the probed CPU-seconds per process over 3 cores "
            "(rollout 0.01 × 1; trainer 0.02, 0.02, 0.03 × 1.5), not the phases") in text
    assert ("# step model: processor sharing of the probed CPU-seconds per process over 3 cores "
            "(planner.rl_cores; --rl-rates' role_cpu)") in out.read_text()


def test_a_plan_without_rates_file_is_as_before(tmp_path, capsys):
    """No --rl-rates: no host or sync rates, no probe; every row says the phases priced it, none is left out for
    a probe."""
    plan = _json(["plan", "--rl", *WORKLOAD, "--max-staleness", "1", "--top", "100", "--json", "--out",
                  str(tmp_path / "rl.yaml")], capsys)
    assert plan["unprobed"] == [] and all(r["step_model"] == "phases" and r["shared_cores"] is None
                                          for r in plan["top"])


def test_bad_rates_for_a_plan_are_one_line(tmp_path, capsys):
    argv = ["plan", "--rl", *WORKLOAD, "--out", str(tmp_path / "rl.yaml"), "--rl-rates"]
    missing = tmp_path / "missing.yaml"
    refused(capsys, [*argv, str(missing)], f"RL rates file {str(missing)!r} does not exist; write one with "
            "`moetrain profile --rl-out FILE`")
    folder = tmp_path / "a-folder"
    folder.mkdir()
    refused(capsys, [*argv, str(folder)], f"RL rates file {str(folder)!r} is a folder, not a file; write one with "
            "`moetrain profile --rl-out FILE`")
    path = tmp_path / "rates.yaml"
    replace(RATES, role_cpu=LIGHT).save(path)
    path.write_text(path.read_text().replace("cores: 3.0", "cores: -3"))
    refused(capsys, [*argv, str(path)], f"{path}: role_cpu.cores must be the probed machine's positive core count "
            "(got -3); probe the job again with `moetrain profile --rl-out FILE --rl-job rl.yaml`")
    assert not (tmp_path / "rl.yaml").exists()


def test_simulate_refuses_a_probe_of_one_rank_replicas_for_a_larger_replica(tmp_path, capsys):
    """The probe measures one-rank replicas: a replica of 2 devices has the probe's process count (2 generating
    devices) but not its processes, so simulate refuses it and plan leaves it out, by the same rule."""
    path = tmp_path / "rates.yaml"
    replace(RATES, role_cpu=ProbedRoleCPU(RoleCPU((0.1, 0.1), (0.2, 0.2)), 2.0)).save(path)
    refused(capsys, ["simulate", "--rl", *WORKLOAD, "--ep", "2", "--placement", "disaggregated", "--rollout-devices",
                     "2", "--gen-ep", "2", "--staleness", "1", "--rl-rates", str(path)],
            "CPU-seconds of one-rank rollout replicas do not price replicas of 2 devices: use --gen-ep 1 with this "
            "probe")
    plan = _plan(tmp_path, capsys, replace(RATES, role_cpu=ProbedRoleCPU(RoleCPU((0.1, 0.1), (0.2, 0.2)), 2.0)))
    assert "2 generate / 2 train (1 × gen-ep 2)" in plan["unprobed"]
    assert "2 generate / 2 train (2 × gen-ep 1)" not in plan["unprobed"]
