"""Model-form rules of the cost model: which stack hides which traffic, under which compute, and how ZeRO-3
composes with a pipeline; the head-dimension law of fused attention."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from moetrain.config import load_cluster_config, load_model_config
from moetrain.planner.calibration import Efficiency
from moetrain.planner.compute import attention_speed_factor, attention_time
from moetrain.planner.costmodel import evaluate
from moetrain.planner.strategy import Strategies
from moetrain.planner.workload import Workload


def _layout(tp: int = 1, pp: int = 1, dp: int = 8, zero: int = 1, micro_batch: int = 1) -> Strategies:
    def one(value: int | bool) -> np.ndarray:
        return np.array([value])

    return Strategies(tp=one(tp), sp=one(tp > 1), pp=one(pp), vpp=one(1), ep=one(1), etp=one(1), cp=one(1),
                      dp=one(dp), zero=one(zero), micro_batch=one(micro_batch), recompute=one(0), a2a=one(0),
                      overlap=one(False))


def _workload(**kwargs: object) -> Workload:
    return Workload(load_model_config("tiny-qwen3"), load_cluster_config("h100-sxm-80gb"), 256, 64, **kwargs)


def test_head_dim_law_is_one_at_128_and_grows_with_head_dim() -> None:
    factors = attention_speed_factor(np.array([64.0, 128.0, 192.0, 256.0]))
    assert factors[1] == pytest.approx(1.0)
    assert np.all(np.diff(factors) > 0)
    # d/(d + 50) normalised at 128: 64 → 0.79, 256 → 1.16 (FlashAttention-3 head-dim ratios).
    assert factors[0] == pytest.approx((64 / 114) / (128 / 178))
    assert factors[3] == pytest.approx((256 / 306) / (128 / 178))


def test_blackwell_attention_pays_its_non_matmul_work_at_twice_the_tensor_core_rate() -> None:
    # d0 = 100 on Blackwell, still normalised at head dim 128 on Hopper (d0 = 50): 128 → 0.78, 64 → 0.54
    factors = attention_speed_factor(np.array([64.0, 128.0]), "blackwell")
    assert factors[0] == pytest.approx((64 / 164) / (128 / 178))
    assert factors[1] == pytest.approx((128 / 228) / (128 / 178))


def test_ampere_runs_fused_attention_at_flashattention2s_share_of_its_peak() -> None:
    # FlashAttention-2: 50-73 % of an A100's peak (Dao 2023), 35 % of an H100's (FlashAttention-3 paper);
    # the midpoint over 35 %: 0.615 / 0.35 = 1.757; the head-dim law as on Hopper (d0 = 50).
    assert attention_speed_factor(128.0, "ampere") == pytest.approx(1.7571428571)
    assert attention_speed_factor(64.0, "ampere") == pytest.approx((64 / 114) / (128 / 178) * 1.7571428571)
    eff = replace(Efficiency(), attention=0.25)
    a100 = load_cluster_config("a100-sxm-80gb")
    assert attention_time(1e15, a100, eff) == pytest.approx(1e15 / (312e12 * 0.25 * 1.7571428571))
    # Hopper and Blackwell keep their share; an unknown device class (Ascend) too.
    assert attention_speed_factor(128.0, "hopper") == pytest.approx(1.0)
    assert attention_speed_factor(128.0, "ascend") == pytest.approx(1.0)


def test_attention_time_reads_the_clusters_architecture() -> None:
    eff = replace(Efficiency(), attention=0.25)
    flops = 1e15
    h100, b200 = load_cluster_config("h100-sxm-80gb"), load_cluster_config("b200")
    assert attention_time(flops, h100, eff) == pytest.approx(flops / (989.4e12 * 0.25))
    assert attention_time(flops, b200, eff, head_dim=64) == pytest.approx(
        flops / (2250e12 * 0.25 * (64 / 164) / (128 / 178)))


def test_tp_overlap_only_in_stacks_that_overlap() -> None:
    eff = replace(Efficiency(), tp_overlap=0.6)
    layout = _layout(tp=4, dp=2)
    # (without the asynchronous input-gradient collectives, which test_validation_physics prices)
    modern = evaluate(_workload(async_tp_input_grad=False), layout, eff)
    synchronous = evaluate(_workload(overlap_tp_comm=False, async_tp_input_grad=False), layout, eff)
    assert modern.pipeline.tp_comm_s[0] > 0
    assert modern.pipeline.tp_exposed_s[0] == pytest.approx(0.4 * modern.pipeline.tp_comm_s[0])
    assert synchronous.pipeline.tp_exposed_s[0] == pytest.approx(synchronous.pipeline.tp_comm_s[0])
    assert synchronous.step_time_s[0] > modern.step_time_s[0]


def test_dp_traffic_hides_under_the_pass_that_produces_it() -> None:
    # Slow links so that the traffic outgrows its window.
    w = _workload()
    w = replace(w, cluster=w.cluster.model_copy(update={"intra_node_gbps": 0.05, "inter_node_gbps": 0.05}))
    layout = _layout(dp=8, zero=1, micro_batch=4)
    none = evaluate(w, layout, replace(Efficiency(), grad_overlap=0.0))
    full = evaluate(w, layout, replace(Efficiency(), grad_overlap=1.0))
    off = evaluate(replace(w, overlap_grad_comm=False), layout, replace(Efficiency(), grad_overlap=1.0))
    assert none.dp.exposed_s[0] == pytest.approx(none.dp.comm_s[0])
    assert off.dp.exposed_s[0] == pytest.approx(off.dp.comm_s[0])
    # Reduce-scatter under the last backward, all-gather under the first forward: at most one micro-batch of
    # fwd+bwd compute hides anything, and only when the traffic exceeds it is something exposed.
    hidden = full.dp.comm_s[0] - full.dp.exposed_s[0]
    assert 0 < hidden <= full.pipeline.stage_time_s[0] * (1 + 1e-9)
    assert full.dp.exposed_s[0] > 0


def test_zero3_under_a_pipeline_keeps_the_stage_gathered() -> None:
    w = _workload()
    z3_pipe = evaluate(w, _layout(pp=2, dp=4, zero=3), Efficiency())
    z1_pipe = evaluate(w, _layout(pp=2, dp=4, zero=1), Efficiency())
    z3_flat = evaluate(w, _layout(pp=1, dp=8, zero=3), Efficiency())
    z1_flat = evaluate(w, _layout(pp=1, dp=8, zero=1), Efficiency())
    # FSDP2 with PP: weights and gradients of the stage stay unsharded across the micro-batches, and the
    # traffic is once per step, as with ZeRO-1.
    assert z3_pipe.memory.weights[0] == pytest.approx(z1_pipe.memory.weights[0])
    assert z3_pipe.memory.grads[0] == pytest.approx(z1_pipe.memory.grads[0])
    assert z3_pipe.dp.comm_s[0] == pytest.approx(z1_pipe.dp.comm_s[0])
    # Without a pipeline ZeRO-3 shards the weights and moves them every micro-batch.
    assert z3_flat.memory.weights[0] == pytest.approx(z1_flat.memory.weights[0] / 8)
    assert z3_flat.dp.comm_s[0] > z1_flat.dp.comm_s[0]


def test_hardware_flops_match_narayanan_with_full_recompute() -> None:
    from moetrain.planner.validation import row_model

    # GPT-3 175B shape, MHA and a 4h GeLU MLP, as in Narayanan et al. SC21 Table 1.
    layers, hidden, seq, vocab = 96, 12288, 2048, 51200
    model = row_model({"id": "GPT", "attention": "mha", "ffn_act": "gelu", "layers": str(layers),
                       "hidden": str(hidden), "ffn_hidden": str(4 * hidden), "heads": "96", "kv_heads": "96",
                       "vocab": str(vocab)})
    w = Workload(model, load_cluster_config("a100-sxm-80gb"), seq, 1536, precision="fp16")
    layout = _layout(tp=8, pp=8, dp=24)
    layout = replace(layout, recompute=np.array([2]))
    factor = evaluate(w, layout, Efficiency()).hardware_flops_factor[0]
    # Eq. 3 (96·B·s·l·h²·(1 + s/6h + V/16lh)) over the model FLOPs (72·B·s·l·h²·(1 + s/6h + V/12lh)): the
    # recomputed forward covers the layers, not the output head.
    expected = (96 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))) / (
        72 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden)))
    assert factor == pytest.approx(expected, rel=1e-9)
