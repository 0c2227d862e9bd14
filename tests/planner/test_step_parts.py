"""The simulated step told by what spends it: a layer pass's parts add up to its compute, the busiest
stage's parts count its own dense and MoE layers, and on one device the parts, the host's wait and the
optimizer add up to the step, as ``benchmarks/planner_step_check.py`` sets them against a measured step."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from moetrain.config import load_cluster_config, load_model_config
from moetrain.costs.params import mlp_params
from moetrain.planner.calibration import Efficiency
from moetrain.planner.compute import ExpertShard, expert_compute_time, gemm_time
from moetrain.planner.costmodel import evaluate
from moetrain.planner.layer_costs import layer_costs
from moetrain.planner.strategy import Strategies
from moetrain.planner.workload import Workload
from scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SMALL = load_model_config(str(ROOT / "benchmarks" / "data" / "pangu-shaped-small.yaml"))  # 1 dense + 3 MoE layers
EFF = Efficiency(gemm_max=0.7, gemm_overhead_us=10.0, moe_overhead_us=200.0, attention=0.5, memory=0.9,
                 host_layer_us=0.0, host_optimizer_ms=30.0, step_overhead_ms=0.0)


def _layouts(pp: int = 1, micro_batch: int = 2, recompute: tuple[float, ...] = (0.0,)) -> Strategies:
    n = len(recompute)

    def col(value: float | bool) -> np.ndarray:
        return np.full(n, value)

    return Strategies(tp=col(1), sp=col(False), pp=col(pp), vpp=col(1), ep=col(1), etp=col(1), cp=col(1), dp=col(1),
                      zero=col(1), micro_batch=col(micro_batch), recompute=np.array(recompute), a2a=col(0),
                      overlap=col(False))


def _workload(precision: str = "bf16", cluster: str = "h200-sxm-141gb") -> Workload:
    return Workload(SMALL, load_cluster_config(cluster), seq_len=1024, global_batch=8, precision=precision)


@pytest.mark.parametrize("precision,cluster", [("bf16", "h200-sxm-141gb"), ("fp8", "h100-sxm-80gb")])
@pytest.mark.parametrize("moe_layer", [True, False])
def test_layer_parts_add_up_to_the_layer_compute(precision: str, cluster: str, moe_layer: bool) -> None:
    # none, selective, full, and full on half the layers (the selective set on the others)
    layouts = _layouts(recompute=(0.0, 1.0, 2.0, 1.5))
    layer = layer_costs(_workload(precision, cluster), layouts, EFF, moe_layer=moe_layer, num_micro=4)
    np.testing.assert_allclose(layer.parts.total, layer.compute, rtol=1e-12)
    if precision == "fp8":
        assert np.all(np.asarray(layer.parts.fp8_casts) > 0)


def test_the_busiest_stage_counts_its_dense_and_moe_layers_by_hand() -> None:
    """One device holds 1 dense and 3 MoE layers: each part is its layers' forward, twice that for the
    backward, priced by the per-part formulas directly (the breakdown once counted all 4 as MoE layers)."""
    w, layouts = _workload(), _layouts()
    costs = evaluate(w, layouts, EFF)
    num_micro = 8 / 2
    tokens = 2 * 1024
    expert_fwd = expert_compute_time(tokens * SMALL.moe.router.top_k, SMALL, w.cluster, EFF,
                                     ExpertShard(num_local_experts=SMALL.moe.num_experts, etp=1))
    dense_fwd = gemm_time(2.0 * mlp_params(SMALL, SMALL.dense_ffn_hidden) * tokens, 3, w.cluster, EFF)
    assert float(costs.compute.experts_s[0]) == pytest.approx(num_micro * 3 * 3.0 * float(expert_fwd), rel=1e-12)
    assert float(costs.compute.dense_ffn_s[0]) == pytest.approx(num_micro * 1 * 3.0 * float(dense_fwd), rel=1e-12)
    # the fixed cost of each MoE pass: forward, and twice in the backward
    assert float(costs.compute.moe_fixed_s[0]) == pytest.approx(num_micro * 3 * 3.0 * 200e-6, rel=1e-12)


def test_on_one_device_the_parts_the_host_and_the_optimizer_add_up_to_the_step() -> None:
    w = _workload()
    for layouts in (_layouts(recompute=(0.0,)), _layouts(recompute=(2.0,)), _layouts(micro_batch=8)):
        costs = evaluate(w, layouts, replace(EFF, host_layer_us=20_000.0))  # a host floor under every pass
        c = costs.compute
        parts = sum(float(getattr(c, f"{name}_s")[0]) for name in (
            "attention", "router", "experts", "shared_experts", "dense_ffn", "elementwise", "moe_fixed",
            "fp8_casts", "embed", "head", "mtp"))
        assert float(costs.host_wait_s[0]) > 0.0
        total = parts + float(costs.host_wait_s[0]) + float(costs.optimizer_device_s[0])
        assert total == pytest.approx(float(costs.step_time_s[0]), rel=1e-12)


def test_of_two_stages_the_busiest_holds_its_own_layers_and_ends() -> None:
    """pp 2 over 4 layers: the first stage holds the dense layer, a MoE layer and the embedding, the last
    two MoE layers and the head, and is the busier one."""
    w = _workload()
    costs = evaluate(w, _layouts(pp=2), EFF)
    c, num_micro = costs.compute, 4.0
    layer = layer_costs(w, _layouts(pp=2), EFF, moe_layer=True, num_micro=num_micro)
    assert float(c.experts_s[0]) == pytest.approx(num_micro * 2 * float(np.asarray(layer.parts.experts)[0]))
    assert float(c.dense_ffn_s[0]) == 0.0 and float(c.embed_s[0]) == 0.0
    assert float(c.head_s[0]) > 0.0


def _step_check_script():
    return load_script("benchmarks/planner_step_check.py")


def test_the_check_sets_each_term_against_its_kernels_and_both_sides_add_up() -> None:
    # the optimizer priced at 0.07 s, 0.02 s of it beyond the device formula and booked as the host's wait
    simulated = {"step_time_s": 1.0, "attention_core_s": 0.1, "optimizer_s": 0.07, "optimizer_device_s": 0.05,
                 "host_wait_s": 0.06,
                 "compute_s": {"attention": 0.25, "router": 0.01, "experts": 0.3, "shared_experts": 0.05,
                               "dense_ffn": 0.04, "elementwise": 0.1, "head": 0.02, "moe_fixed": 0.01,
                               "embed": 0.005}}
    kinds_ms = {"grouped_gemm": 280.0, "attention": 300.0, "gemm": 200.0, "elementwise": 90.0, "copy": 5.0,
                "optimizer": 60.0}
    rows = {r["term"]: r for r in _step_check_script().compare_terms(simulated, 1.2, kinds_ms)}
    assert rows["fused attention core"]["simulated_s"] == pytest.approx(0.1)
    assert rows["fused attention core"]["measured_s"] == pytest.approx(0.3)
    # projections (0.25 − 0.1), router, shared experts, dense FFN, head
    assert rows["dense GEMMs"]["simulated_s"] == pytest.approx(0.15 + 0.01 + 0.05 + 0.04 + 0.02)
    assert rows["element-wise"]["measured_s"] == pytest.approx(0.095)
    assert rows["optimizer"]["simulated_s"] == pytest.approx(0.07)
    # the layers' host wait (0.06 − the optimizer's 0.02) and the MoE fixed cost
    assert rows["device idle (host-bound)"]["simulated_s"] == pytest.approx(0.04 + 0.01)
    assert rows["device idle (host-bound)"]["measured_s"] == pytest.approx(1.2 - 0.935)
    assert sum(r["simulated_s"] for r in rows.values()) == pytest.approx(1.0)
    assert sum(r["measured_s"] for r in rows.values()) == pytest.approx(1.2)
    # experts, core, dense GEMMs, element-wise (with the embedding), optimizer, idle: the rest is "other"
    other = 1.0 - (0.3 + 0.1 + 0.27 + 0.105 + 0.07 + 0.05)
    assert rows["other (communication, bubble, MTP)"]["simulated_s"] == pytest.approx(other)


def test_timed_steps_leave_out_the_first_and_those_that_compiled() -> None:
    timed = _step_check_script().timed_steps
    row = {"steps_s": [30.0, 0.5, 12.0, 0.5, 0.4], "compiled_steps": [True, False, True, False, False]}
    assert timed(row, skip=2) == [1, 3, 4]
    # a record that does not say which steps compiled: its first ``skip`` are left out
    assert timed({"steps_s": [30.0, 12.0, 1.3, 0.5, 0.4]}, skip=3) == [3, 4]


def test_the_timed_steps_split_by_the_document_mask() -> None:
    row = {"steps_s": [30.0, 0.51, 0.42, 0.50, 0.52], "compiled_steps": [True, False, False, False, False]}
    split = _step_check_script().steps_by_mask(row, 2, [False, True, False, True, True, False], 0.40)
    assert split["plain"] == {"steps": [2], "steps_s": [0.42], "median_s": 0.42, "simulated_s": 0.40,
                              "error_pct": pytest.approx((0.40 - 0.42) / 0.42 * 100)}
    assert split["masked"] == {"steps": [1, 3, 4], "steps_s": [0.51, 0.50, 0.52], "median_s": 0.51}
    assert split["profiled_step_masked"] is False


def test_the_h200_steps_under_the_document_mask_are_read_again_from_the_corpus() -> None:
    """The H200's step_speed record (7b5f6aa) predates ``masked_steps``: its batches are read again. Steps 0 and 4
    hold no document boundary; in both of its variants step 4 is the fast one (0.423 and 0.422 s against
    0.51-0.55 s for the masked steps after compiling)."""
    row = {"steps_s": [0.0] * 6, "micro_batch": 8}
    masked = _step_check_script().masked_steps(row, str(ROOT / "benchmarks" / "data" / "pangu-shaped-small.yaml"),
                                               4096, 8)
    assert masked == [False, True, True, True, False, True, True]
