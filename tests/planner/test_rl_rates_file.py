"""The RL step's measured host rates as a file (``planner.rl_rates``): ``moetrain profile --rl-out`` writes
it, ``moetrain simulate --rl --rl-rates`` prices generation's host work and the weight sync with it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.errors import UserError
from moetrain.planner.generation import HostCosts
from moetrain.planner.rl_cores import RoleCPU, shared_cpu_step
from moetrain.planner.rl_rates import ProbedRoleCPU, RLRates, load_rl_rates
from moetrain.planner.rl_step import SyncRates

RATES = RLRates(HostCosts(layer_forward_us=800.0, sample_ns_per_logit=30.0, host_is_device=True,
                          engine_step_us=500.0, engine_row_us=30.0),
                SyncRates(2e9, 1e9, 5e8), "by hand")
SIMULATE = ["simulate", "--rl", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "2", "--prompt-len", "10",
            "--response-len", "6", "--prompts", "4", "--group-size", "2", "--dtype", "fp32", "--json"]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_rates_file_round_trip(tmp_path, suffix):
    path = tmp_path / f"rates{suffix}"
    RATES.save(path)
    assert load_rl_rates(path) == RATES


def test_a_bad_rates_file_is_refused(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_rl_rates(tmp_path / "missing.yaml")
    path = tmp_path / "bad.yaml"
    path.write_text("host: {layer_forward_us: 1.0, warp_speed: 9}\nsync: {copy_bytes_per_s: 1, crc_bytes_per_s: 1}\n")
    with pytest.raises(UserError, match="'host' must be a mapping"):
        load_rl_rates(path)


def test_simulate_rl_prices_the_sync_with_the_measured_rates(tmp_path, capsys):
    path = tmp_path / "rates.yaml"
    RATES.save(path)
    assert main(SIMULATE) == 0
    without = {p["placement"]: p for p in json.loads(capsys.readouterr().out)["predictions"]}
    assert main([*SIMULATE, "--rl-rates", str(path)]) == 0
    with_rates = {p["placement"]: p for p in json.loads(capsys.readouterr().out)["predictions"]}
    # colocated on 2 devices: each packs and writes its whole model at the measured 0.5 GB/s
    assert with_rates["colocated"]["phases_s"]["reshard_s"] > without["colocated"]["phases_s"]["reshard_s"]
    assert all(with_rates[k]["step_s"] > without[k]["step_s"] for k in without)
    assert main([*SIMULATE, "--rl-rates", str(tmp_path / "missing.yaml")]) == 2
    assert "profile --rl-out" in capsys.readouterr().err


# --- the probed CPU-seconds per process (``role_cpu``: ``moetrain profile --rl-out FILE --rl-job rl.yaml``) ---

PROBED = ProbedRoleCPU(RoleCPU(rollout_s=(0.3, 0.5), trainer_s=(0.4, 0.6), overlap=(1.0, 1.5)), cores=2.0)
DISAGGREGATED = ["simulate", "--rl", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "4", "--rollout-devices",
                 "2", "--prompt-len", "10", "--response-len", "6", "--prompts", "4", "--group-size", "2", "--dtype",
                 "fp32", "--staleness", "1", "--json"]


def _rows(argv: list[str], capsys) -> dict:
    assert main(argv) == 0
    return {p["placement"]: p for p in json.loads(capsys.readouterr().out)["predictions"]}


def test_the_probed_cpu_round_trips_and_old_files_load_without_it(tmp_path):
    path = tmp_path / "rates.yaml"
    probed = replace(RATES, role_cpu=PROBED)
    probed.save(path)
    assert load_rl_rates(path) == probed
    RATES.save(path)  # a file from before the field: no role_cpu section at all
    assert "role_cpu" not in path.read_text()
    assert load_rl_rates(path).role_cpu is None


def test_simulate_shares_the_probed_cpu_over_the_cores(tmp_path, capsys):
    """Processes of 0.3, 0.5 (replicas) and 0.4 × 1.5, 0.6 × 1.5 (trainer ranks, overlapped) CPU-seconds per step
    on 2 cores: all four at half a core until 0.3 is done (0.6 s), three at 2/3 until 0.5 (0.3 s), two at a
    whole core until 0.6 (0.1 s), the last alone until 0.9 (0.3 s): 1.3 s."""
    path = tmp_path / "rates.yaml"
    replace(RATES, role_cpu=PROBED).save(path)
    rows = _rows([*DISAGGREGATED, "--rl-rates", str(path)], capsys)
    assert rows["disaggregated"]["step_s"] == pytest.approx(1.3)
    assert shared_cpu_step(PROBED.work, PROBED.cores) == pytest.approx(1.3)
    assert rows["disaggregated"]["step_model"] == "processor sharing"
    assert rows["disaggregated"]["shared_cores"] == 2.0
    # the colocated placement shares no pipeline round: priced by its phases, as without the field
    RATES.save(tmp_path / "old.yaml")
    old = _rows([*DISAGGREGATED, "--rl-rates", str(tmp_path / "old.yaml")], capsys)
    assert rows["colocated"] == old["colocated"] and old["colocated"]["step_model"] == "phases"
    assert old["disaggregated"]["step_model"] == "phases" and old["disaggregated"]["step_s"] != pytest.approx(1.3)
    # k = 0: the roles take turns, the phases add up whatever the file holds
    serial = _rows([*DISAGGREGATED[:-2], "0", "--json", "--rl-rates", str(path)], capsys)
    assert serial["disaggregated"]["step_model"] == "phases"
    assert main([*DISAGGREGATED[:-1], "--rl-rates", str(path)]) == 0
    text = capsys.readouterr().out
    assert ("step model: processor sharing of the probed CPU-seconds per process over 2 cores (planner.rl_cores; "
            "--rl-rates' role_cpu)") in text
    assert "step model: the priced phases below" in text


BAD_ROLE_CPU = [
    ("rollout_s: 0.3", "role_cpu.rollout_s must be a list of positive CPU-seconds per step, one per rollout replica "
                       "(got 0.3); probe the job again with `moetrain profile --rl-out FILE --rl-job rl.yaml`"),
    ("rollout_s: [0.3, -0.5]", "role_cpu.rollout_s must be a list of positive CPU-seconds per step, one per rollout "
                               "replica (got [0.3, -0.5]); probe the job again with `moetrain profile --rl-out FILE "
                               "--rl-job rl.yaml`"),
    ("trainer_s: []", "role_cpu.trainer_s must be a list of positive CPU-seconds per step, one per trainer rank "
                      "(got []); probe the job again with `moetrain profile --rl-out FILE --rl-job rl.yaml`"),
    ("overlap: [1.2]", "role_cpu.overlap must be two positive factors, [rollout, trainer] (got [1.2]); probe the "
                       "job again with `moetrain profile --rl-out FILE --rl-job rl.yaml`"),
    ("cores: -2", "role_cpu.cores must be the probed machine's positive core count (got -2); probe the job again "
                  "with `moetrain profile --rl-out FILE --rl-job rl.yaml`"),
    ("speed: 3", "'role_cpu' must be a mapping of ['rollout_s', 'trainer_s', 'overlap', 'cores'], as `moetrain "
                 "profile --rl-out FILE --rl-job rl.yaml` writes it"),
]


@pytest.mark.parametrize(("change", "message"), BAD_ROLE_CPU)
def test_a_bad_role_cpu_section_is_one_line_and_exit_2(tmp_path, capsys, change, message):
    section = {"rollout_s": "[0.3, 0.5]", "trainer_s": "[0.4, 0.6]", "overlap": "[1.0, 1.5]", "cores": "2"}
    key, value = change.split(": ", 1)
    section[key] = value
    path = tmp_path / "rates.yaml"
    RATES.save(path)
    path.write_text(path.read_text() + "role_cpu: {" + ", ".join(f"{k}: {v}" for k, v in section.items()) + "}\n")
    assert main([*DISAGGREGATED, "--rl-rates", str(path)]) == 2
    assert capsys.readouterr().err == f"moetrain simulate: error: {path}: {message}\n"


def test_other_bad_rates_are_one_line_and_exit_2(tmp_path, capsys):
    missing = tmp_path / "missing.yaml"
    assert main([*DISAGGREGATED, "--rl-rates", str(missing)]) == 2
    assert capsys.readouterr().err == (f"moetrain simulate: error: RL rates file {str(missing)!r} does not exist; "
                                       "write one with `moetrain profile --rl-out FILE`\n")
    path = tmp_path / "rates.yaml"
    RATES.save(path)
    # YAML reads 2.0e9 (no sign on the exponent) as a string: refused here, not deep in the pricing
    path.write_text(path.read_text().replace("copy_bytes_per_s: 2000000000.0", "copy_bytes_per_s: 2.0e9"))
    assert main([*DISAGGREGATED, "--rl-rates", str(path)]) == 2
    assert capsys.readouterr().err == (f"moetrain simulate: error: {path}: sync.copy_bytes_per_s must be a number ≥ 0 "
                                       "(got '2.0e9'); write exponents with a sign (2.0e+9) or measure again with "
                                       "`moetrain profile --rl-out`\n")
    replace(RATES, role_cpu=PROBED).save(path)  # 2 replicas and 2 trainer ranks, priced on 3 processes
    assert main([*DISAGGREGATED[:7], "3", *DISAGGREGATED[8:], "--placement", "disaggregated", "--rl-rates",
                 str(path)]) == 2
    assert capsys.readouterr().err == ("moetrain simulate: error: CPU-seconds of 2 rollout and 2 trainer processes do "
                                       "not match the layout's 2 and 1; probe this layout's job (`moetrain profile "
                                       "--rl-out FILE --rl-job rl.yaml`)\n")


def test_the_cli_route_gives_rl_scales_recorded_prediction(tmp_path, capsys):
    """benchmarks/rl_scale.py prices its runs through the Python API (its generation phase needs
    ``decode_running_share``, which no flag sets); its step at k = 1 is the probed works shared over the cores
    alone, so the same works in a rates file give its recorded step through ``simulate --rl``."""
    record = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/rl_scale_cpu.json").read_text())
    for row in record["rows"]:
        replicas, probed = row["replicas"], row["role_cpu"]
        apart = probed["apart_per_step_s"]
        work = RoleCPU(tuple(apart[:replicas]), tuple(apart[replicas:]), tuple(probed["overlap_factors"]))
        path = tmp_path / f"rates_{replicas}.yaml"
        replace(RATES, role_cpu=ProbedRoleCPU(work, probed["cores"])).save(path)
        rows = _rows(["simulate", "--rl", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", str(row["ranks"]),
                      "--rollout-devices", str(replicas), "--placement", "disaggregated", "--staleness", "1",
                      "--prompts", "16", "--group-size", "8", "--prompt-len", "13", "--response-len",
                      str(row["response_len"]), "--micro-batch", "64", "--dtype", "fp32", "--rl-rates", str(path),
                      "--json"], capsys)
        assert rows["disaggregated"]["step_s"] == pytest.approx(row["predicted_step_s"], rel=1e-9)
