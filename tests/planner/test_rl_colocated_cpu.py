"""A colocated RL job whose ranks outnumber a CPU's cores (``rl_cores.colocated_cpu_step``): its ranks' probed
CPU-seconds per step shared over the cores by processor sharing, in ``price_rl_step``, the rates file, the
search and ``moetrain plan --rl``. Every expected value is worked out by hand in the comments; GPU clusters are
held to the figures of main (6e9a8a5), where no colocated job had a probe."""

from __future__ import annotations

import json

import pytest
import yaml

from moetrain.cli import main
from moetrain.config import ParallelConfig, load_cluster_config, load_model_config
from moetrain.errors import UserError
from moetrain.planner.calibration import calibration_from_dict, load_calibration
from moetrain.planner.generation import HostCosts
from moetrain.planner.rl_cores import RankCPU, RoleCPU, colocated_cpu_step
from moetrain.planner.rl_rates import ProbedRankCPU, ProbedRoleCPU, RLRates, load_rl_rates
from moetrain.planner.rl_search import UNPROBED_COLOCATED, RLSearchOptions, search_rl
from moetrain.planner.rl_step import SHARED_CPU_MODEL, RLLayout, RLWorkload, SyncRates, price_rl_step

CPU = load_cluster_config("cpu").for_ranks(4)  # as the CLI builds it for 4 ranks
WORKLOAD = RLWorkload(load_model_config("tiny-pangu"), CPU, 16, 8, 13, 16, "fp32")
"""docs/rl_plan.md's CPU example (benchmarks/rl_plan_check.py's workload)."""
QUIET_PROBE = ProbedRoleCPU(RoleCPU((0.4289, 0.4454), (0.9707, 0.9590), (1.0625, 1.0382)), 2.0)
"""The 2 generate / 2 train job's probe of rl_plan_check_cpu_quiet.json at 440934e (rounded). On 2 cores its processes
0.4557, 0.4732, 1.0078, 0.9956 CPU-s: 4 at half a core until 0.4557 (0.9114 s), 3 at 2/3 for 0.0175 more
(0.0263 s), 2 at a core for 0.5224 (0.5224 s), the last 0.0122: 1.4723 s."""
DISAGGREGATED_STEP = 1.4723


def _colocated(k: int = 1, gen_ep: int = 1, work: RankCPU | None = None) -> RLLayout:
    layout = RLLayout("colocated", 4, ParallelConfig(ep=4, dp=4, micro_batch=8), gen_ep, staleness=k)
    return layout if work is None else ProbedRankCPU(work, 2.0).on(layout)


def test_equal_ranks_on_half_the_cores_take_twice_their_work():
    # 4 ranks of 0.9 CPU-s on 2 cores: each at half a core, all done at 1.8 s = 4 × 0.9 / 2
    assert colocated_cpu_step(RankCPU((0.9,) * 4, 1), 2.0) == pytest.approx(1.8)
    # as many cores as ranks: a core each, the work itself
    assert colocated_cpu_step(RankCPU((0.9,) * 4, 1), 4.0) == pytest.approx(0.9)


def test_unequal_ranks_share_what_the_done_ones_leave():
    # 0.2, 0.4, 0.6, 1.0 on 2 cores: 4 at 1/2 until 0.2 (0.4 s); 3 at 2/3 for 0.2 more (0.3 s); 2 at a core for
    # 0.2 more (0.2 s); the last 0.4 alone (0.4 s): 1.3 s, above both bounds (total 2.2 / 2 = 1.1, largest 1.0)
    assert colocated_cpu_step(RankCPU((1.0, 0.2, 0.6, 0.4), 0), 2.0) == pytest.approx(1.3)


@pytest.mark.parametrize("k", [0, 1])
def test_a_probed_colocated_step_is_its_ranks_shared_not_its_phases(k):
    priced = price_rl_step(WORKLOAD, _colocated(k, work=RankCPU((1.0, 0.2, 0.6, 0.4), k)), load_calibration(None))
    phases = price_rl_step(WORKLOAD, _colocated(k), load_calibration(None))
    assert (priced.step_s, priced.step_model) == (pytest.approx(1.3), SHARED_CPU_MODEL)
    assert phases.step_model == "phases" and phases.step_s != pytest.approx(1.3)
    assert priced.phases == phases.phases  # the phases are still reported beside the shared step
    assert priced.tokens_per_s == pytest.approx(16 * 8 * (13 + 16) / 1.3)


@pytest.mark.parametrize(("layout", "message"), [
    (RLLayout("colocated", 2, ParallelConfig(ep=2, dp=2, micro_batch=8), 1, staleness=1),
     "CPU-seconds of 4 colocated ranks do not match the layout's 2; probe this layout's job (`moetrain profile "
     "--rl-out FILE --rl-job rl.yaml`)"),
    (_colocated(0, gen_ep=2), "CPU-seconds of ranks generating on a whole model do not price replicas of 2 devices: "
     "use --gen-ep 1 with this probe"),
    (_colocated(0), "CPU-seconds probed at k = 1 do not price a colocated job at k = 0 (the phases take turns); "
     "probe this layout's job (`moetrain profile --rl-out FILE --rl-job rl.yaml`)"),
])
def test_a_probe_of_other_ranks_is_refused(layout, message):
    layout = ProbedRankCPU(RankCPU((0.5,) * 4, 1), 2.0).on(layout)
    with pytest.raises(UserError) as err:
        price_rl_step(WORKLOAD, layout, load_calibration(None))
    assert str(err.value) == message


def test_the_probe_leaves_a_disaggregated_layout_alone():
    layout = RLLayout("disaggregated", 4, ParallelConfig(ep=2, dp=2, micro_batch=8), 1, 2, 1)
    assert ProbedRankCPU(RankCPU((0.5,) * 4, 1), 2.0).on(layout) is layout


@pytest.mark.parametrize(("rank_s", "winner"), [
    # 4 × 0.97 on 2 cores: 1.94 s (what the quiet check measured colocated: 1.937 s) > 1.4723 s disaggregated
    (0.97, "disaggregated"),
    # 4 × 0.5 on 2 cores: 1.0 s < 1.4723 s
    (0.5, "colocated"),
])
def test_the_plan_ranks_first_the_job_the_works_say_is_faster(rank_s, winner):
    options = RLSearchOptions(probed_cpu=QUIET_PROBE, probed_ranks=ProbedRankCPU(RankCPU((rank_s,) * 4, 1), 2.0))
    result = search_rl(WORKLOAD, 4, load_calibration(None), options=options)
    best = {p: next(c for c in result.ranked if c.layout.placement == p) for p in ("colocated", "disaggregated")}
    assert best["colocated"].step_s == pytest.approx(4 * rank_s / 2)
    assert best["colocated"].prediction.step_model == SHARED_CPU_MODEL
    assert best["disaggregated"].step_s == pytest.approx(DISAGGREGATED_STEP, abs=1e-4)
    assert result.winner.layout.placement == winner
    # colocated k = 0 (4 × gen-ep 1) and gen-ep 2, 4 are another job's ranks: left out and named
    assert result.unprobed_colocated == ["4 × gen-ep 1, k = 0", "2 × gen-ep 2, k = 0", "1 × gen-ep 4, k = 0"]
    assert result.left_out[UNPROBED_COLOCATED] == 3
    assert all(c.prediction.step_model == SHARED_CPU_MODEL for c in result.ranked if c.layout.placement == "colocated")


# main (6e9a8a5): search_rl of tiny-qwen3, 32 prompts × 8, 64 + 128 tokens on 8 × h100-sxm-80gb, default calibration
MAIN_GPU = [("disaggregated", 4, 1, 1, 1.6921540470199714), ("disaggregated", 4, 1, 2, 1.6921540470199714),
            ("disaggregated", 2, 1, 1, 1.6929442708470819), ("disaggregated", 2, 1, 2, 1.6929442708470819),
            ("disaggregated", 1, 1, 1, 1.6945431355751328), ("disaggregated", 1, 1, 2, 1.6945431355751328),
            ("disaggregated", 4, 2, 1, 1.6984786345066842), ("disaggregated", 4, 2, 2, 1.6984786345066842),
            ("disaggregated", 4, 4, 1, 1.6985689282500407), ("disaggregated", 4, 4, 2, 1.6985689282500407),
            ("disaggregated", 2, 2, 1, 1.6994988056774618), ("disaggregated", 2, 2, 2, 1.6994988056774618),
            ("colocated", 0, 1, 0, 1.851557398669497), ("colocated", 0, 1, 1, 1.851557398669497),
            ("colocated", 0, 1, 2, 1.851557398669497), ("colocated", 0, 8, 0, 1.8577630528718891),
            ("colocated", 0, 2, 0, 1.8577758331387864), ("colocated", 0, 4, 0, 1.857813050373431),
            ("disaggregated", 2, 1, 0, 1.9620187651345948), ("disaggregated", 2, 2, 0, 1.9685732999649748),
            ("disaggregated", 4, 1, 0, 2.0113406949915587), ("disaggregated", 4, 2, 0, 2.0176652824782715),
            ("disaggregated", 4, 4, 0, 2.017755576221628), ("disaggregated", 1, 1, 0, 2.073272586881149)]


# the shipped fit of main (6e9a8a5) for Hopper, held here so that a refit does not move the figures above
MAIN_FIT = calibration_from_dict({"global": {
    "gemm_max": 0.6918692521025811, "gemm_overhead_us": 2.4302905784092355, "moe_overhead_us": 1583.3054921437367,
    "attention": 0.25025195259291283, "memory": 0.61510289717073, "fp8_gain": 1.9999999999999998,
    "bus_intra": 0.9627025237538334, "bus_inter": 0.9999999999999999, "grad_overlap": 0.030616568685825865,
    "tp_overlap": 0.014590098275127448}, "per_arch": {"hopper": {"gemm_max": 0.6330761250411283}}}, "main's fit")


def test_gpu_clusters_price_as_on_main():
    w = RLWorkload(load_model_config("tiny-qwen3"), load_cluster_config("h100-sxm-80gb"), 32, 8, 64, 128)
    result = search_rl(w, 8, MAIN_FIT)
    rows = [(c.layout.placement, c.layout.rollout_devices, c.layout.gen_devices_per_replica, c.staleness, c.step_s)
            for c in result.ranked]
    assert rows == MAIN_GPU  # exactly, every row: the colocated probe changes nothing where no rank_cpu is given
    assert {c.prediction.step_model for c in result.ranked} == {"phases"} and not result.unprobed_colocated
    assert not any(line.startswith("caution") for line in result.why)  # a GPU is no shared host


def test_a_winner_priced_by_its_phases_on_a_shared_cpu_says_its_ranking_may_not_hold():
    # rl_plan_check_cpu_quiet.json (e4ef840): the phases' winner ran 3.73 s, the probed disaggregated job 1.41 s
    unprobed = search_rl(WORKLOAD, 4, load_calibration(None))
    assert unprobed.winner.prediction.step_model == "phases"
    assert unprobed.why[-1] == (
        "caution: priced by its phases, which do not see 4 ranks share 2 cores; measured steps there run longer, "
        "by more for some jobs than others (docs/rl_plan.md), so this ranking may not hold: probe a job of each "
        "placement (`moetrain profile --rl-out FILE --rl-job rl.yaml`, the flag once for each) and plan again "
        "with --rl-rates FILE")
    probed = search_rl(WORKLOAD, 4, load_calibration(None), options=RLSearchOptions(
        probed_cpu=QUIET_PROBE, probed_ranks=ProbedRankCPU(RankCPU((0.97,) * 4, 1), 2.0)))
    assert probed.winner.prediction.step_model == SHARED_CPU_MODEL
    assert not any(line.startswith("caution") for line in probed.why)


RATES = RLRates(HostCosts(host_is_device=True), SyncRates(2e9, 1e9, 5e8), "by hand",
                rank_cpu=ProbedRankCPU(RankCPU((0.97, 0.96, 0.98, 0.95), 1), 2.0))


def test_the_rank_cpu_round_trips_and_bad_sections_are_one_line(tmp_path):
    path = tmp_path / "rates.yaml"
    RATES.save(path)
    assert load_rl_rates(path) == RATES
    data = RATES.to_dict()
    for section, message in [
        ({"rank_s": [0.9], "cores": 2}, "'rank_cpu' must be a mapping of ['rank_s', 'staleness', 'cores'], as "
         "`moetrain profile --rl-out FILE --rl-job rl.yaml` writes it for a colocated job"),
        ({"rank_s": [0.9, -1], "staleness": 1, "cores": 2}, "rank_cpu.rank_s must be a list of positive CPU-seconds "
         "per step, one per colocated rank (got [0.9, -1]); probe the job again with `moetrain profile --rl-out FILE "
         "--rl-job rl.yaml`"),
        ({"rank_s": [0.9], "staleness": 0.5, "cores": 2}, "rank_cpu.staleness must be the probed job's k, an integer "
         "≥ 0 (got 0.5); probe the job again with `moetrain profile --rl-out FILE --rl-job rl.yaml`"),
        ({"rank_s": [0.9], "staleness": 1, "cores": 0}, "rank_cpu.cores must be the probed machine's positive core "
         "count (got 0); probe the job again with `moetrain profile --rl-out FILE --rl-job rl.yaml`"),
    ]:
        path.write_text(yaml.safe_dump({**data, "rank_cpu": section}))
        with pytest.raises(UserError) as err:
            load_rl_rates(path)
        assert str(err.value) == f"{path}: {message}"


PLAN = ["plan", "--rl", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "4", "--prompts", "16",
        "--group-size", "8", "--prompt-len", "13", "--response-len", "16", "--dtype", "fp32", "--top", "100"]


def test_plan_names_the_model_of_every_row_and_the_colocated_jobs_left_out(tmp_path, capsys):
    rates = tmp_path / "rates.yaml"
    RATES.save(rates)
    out = tmp_path / "rl.yaml"
    assert main([*PLAN, "--rl-rates", str(rates), "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    colocated = [r for r in result["top"] if r["placement"] == "colocated"]
    # 4 ranks of 0.97, 0.96, 0.98, 0.95 CPU-s on 2 cores: 4 at half a core until 0.95 (1.9 s), 3 at 2/3 for
    # 0.01 (0.015 s), 2 at a core for 0.01 (0.01 s), the last 0.01: 1.935 s, at k = 1 and 2
    assert [(r["staleness"], r["step_model"], r["shared_cores"]) for r in colocated] == [
        (1, SHARED_CPU_MODEL, 2.0), (2, SHARED_CPU_MODEL, 2.0)]
    assert [r["step_s"] for r in colocated] == [pytest.approx(1.935)] * 2
    assert result["unprobed_colocated"] == ["4 × gen-ep 1, k = 0", "2 × gen-ep 2, k = 0", "1 × gen-ep 4, k = 0"]
    assert main([*PLAN, "--rl-rates", str(rates), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert (f"not priced by {rates}'s rank_cpu (its ranks are another colocated job's), left out: colocated 4 × "
            "gen-ep 1, k = 0; 2 × gen-ep 2, k = 0; 1 × gen-ep 4, k = 0; probe such a job with `moetrain profile "
            "--rl-out FILE --rl-job rl.yaml` to rank it") in text
    row = next(line for line in text.splitlines() if "colocated: all 4" in line)
    assert "processor sharing" in row


SIMULATE = ["simulate", "--rl", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "4", "--placement",
            "colocated", "--prompts", "16", "--group-size", "8", "--prompt-len", "13", "--response-len", "16",
            "--dtype", "fp32", "--micro-batch", "8", "--json"]


def test_simulate_prices_a_probed_colocated_step_by_its_ranks(tmp_path, capsys):
    """``simulate --rl --rl-rates`` with a ``rank_cpu`` section: the colocated step at the probe's kind of k is
    its ranks shared over the probed cores (1.935 s, worked out in the plan test above), not its phases; at
    the other kind of k the probe is another job's, and the command refuses it in one line."""
    rates = tmp_path / "rates.yaml"
    RATES.save(rates)
    assert main([*SIMULATE, "--staleness", "1", "--rl-rates", str(rates)]) == 0
    (row,) = json.loads(capsys.readouterr().out)["predictions"]
    assert (row["step_model"], row["shared_cores"], row["step_s"]) == (SHARED_CPU_MODEL, 2.0, pytest.approx(1.935))
    assert main([*SIMULATE, "--staleness", "0", "--rl-rates", str(rates)]) == 2
    assert capsys.readouterr().err == (
        "moetrain simulate: error: CPU-seconds probed at k = 1 do not price a colocated job at k = 0 (the phases "
        "take turns); probe this layout's job (`moetrain profile --rl-out FILE --rl-job rl.yaml`)\n")
