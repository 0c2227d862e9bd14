"""FP8-stored linear inputs and the rotary embedding's per-layer pass: known values against the formulas
they implement."""

from __future__ import annotations

import numpy as np
import pytest

from moetrain.config import load_cluster_config, load_model_config
from moetrain.config.model import GQAConfig, ModelConfig
from moetrain.planner.calibration import Efficiency
from moetrain.planner.compute import memory_time
from moetrain.planner.costmodel import evaluate
from moetrain.planner.device_memory import fp8_stored_elements
from moetrain.planner.layer_costs import layer_costs
from moetrain.planner.strategy import Strategies
from moetrain.planner.validation import prepare_row
from moetrain.planner.workload import Workload

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, SEQ = 256, 8, 2, 32, 1024, 4, 512


def _dense_model() -> ModelConfig:
    return ModelConfig(name="dense-test", vocab_size=1000, hidden_size=HIDDEN, num_layers=LAYERS,
                       dense_ffn_hidden=FFN, ffn_act="swiglu",
                       attention=GQAConfig(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM))


def _one(recompute: float = 0.0) -> Strategies:
    def one(value: float | bool) -> np.ndarray:
        return np.array([value])

    return Strategies(tp=one(1), sp=one(False), pp=one(1), vpp=one(1), ep=one(1), etp=one(1), cp=one(1),
                      dp=one(1), zero=one(1), micro_batch=one(1), recompute=one(recompute), a2a=one(0),
                      overlap=one(False))


def _workload(precision: str = "bf16", cluster: str = "h100-sxm-80gb", **kwargs: object) -> Workload:
    return Workload(_dense_model(), load_cluster_config(cluster), SEQ, 8, precision=precision, **kwargs)


def test_fp8_stored_linear_inputs_take_one_byte() -> None:
    eff = Efficiency()
    q_w = HEADS * HEAD_DIM
    no_recompute = SEQ * (2 * HIDDEN + q_w + FFN)  # pre-norm outputs, o_proj input, fc2 input
    for level, elements, saved in ((0.0, no_recompute, LAYERS * no_recompute), (1.0, SEQ * q_w, LAYERS * SEQ * q_w),
                                   # full recompute: only the layer being recomputed holds its linear inputs
                                   (2.0, 0.0, no_recompute)):
        kept_bf16 = evaluate(_workload("fp8"), _one(level), eff).memory.activations[0]
        kept_fp8 = evaluate(_workload("fp8", fp8_stored_activations=True), _one(level), eff).memory.activations[0]
        assert float(fp8_stored_elements(_workload("fp8"), _one(level), False, np.array([level]))[0]) == elements
        # one micro-batch in flight on the single stage: one byte saved per stored element
        assert kept_bf16 - kept_fp8 == pytest.approx(saved)


def test_rotary_pass_reads_and_writes_q_and_k() -> None:
    eff = Efficiency()
    rotary = layer_costs(_workload(), _one(), eff, moe_layer=False, num_micro=8.0)
    learned = layer_costs(_workload(rotary_embeddings=False), _one(), eff, moe_layer=False, num_micro=8.0)
    rope_bytes = 2.0 * (HEADS + KV_HEADS) * HEAD_DIM * SEQ * 2.0
    cluster = load_cluster_config("h100-sxm-80gb")
    assert float(rotary.fwd[0] - learned.fwd[0]) == pytest.approx(float(memory_time(rope_bytes, cluster, eff)))


def test_rows_read_fp8_recipe_and_positions(published_rows: list[dict]) -> None:
    rows = {r["id"]: r for r in published_rows}
    assert prepare_row(rows["MBR-11"]).workload.fp8_stored_activations  # MXFP8, Transformer Engine
    assert prepare_row(rows["DSV3-1"]).workload.fp8_stored_activations  # DeepSeek's FP8 framework
    assert not prepare_row(rows["MBR-1"]).workload.fp8_stored_activations  # BF16
    torchao = prepare_row(rows["TT-3b"]).workload  # torchao Float8 keeps BF16 inputs
    assert not torchao.fp8_stored_activations
    assert prepare_row(rows["MBR-3"]).workload.rotary_embeddings
    assert not prepare_row(rows["NAR21-01"]).workload.rotary_embeddings  # learned absolute positions
    assert not prepare_row(rows["MPT-1"]).workload.rotary_embeddings  # ALiBi


def test_fp8_runs_keep_the_output_head_in_bf16() -> None:
    """The output head's three GEMMs (forward, input and weight gradients) run at the BF16 rate in an FP8 run,
    as DeepSeek-V3 §3.3.1, Megatron-Core's output layer and torchtitan's Float8 filter keep it."""
    eff = Efficiency()
    cluster = load_cluster_config("h100-sxm-80gb")
    gemm = 3 * (2.0 * HIDDEN * 1000 * SEQ / (cluster.peak_tflops_bf16 * 1e12 * eff.gemm_max)
                + eff.gemm_overhead_us * 1e-6)
    logits = 3 * 3 * 4.0 * 1000 * SEQ / (cluster.hbm_bandwidth_tbps * 1e12 * eff.memory)
    for precision in ("bf16", "fp8"):
        costs = evaluate(_workload(precision), _one(), eff)
        # one sequence per micro-batch, 8 micro-batches
        assert float(costs.compute.head_s[0]) == pytest.approx(8 * (gemm + logits))


def _fp8_gemms_at_bf16_rate() -> Efficiency:
    # FP8 GEMMs as fast as BF16 ones: an FP8 pass then differs from a BF16 one by its casts alone
    return Efficiency(fp8_gain=1.0)


def test_fp8_casts_of_a_dense_layer_by_hand() -> None:
    eff = _fp8_gemms_at_bf16_rate()
    q_w, qkv_w = HEADS * HEAD_DIM, (HEADS + 2 * KV_HEADS) * HEAD_DIM
    # forward: attention's input and o's input, the MLP's input and its down-projection's input
    forward = SEQ * (HIDDEN + q_w + HIDDEN + FFN)
    # backward: the gradients of o's and qkv's outputs, of the down-projection's and of gate + up's outputs
    backward = SEQ * (HIDDEN + qkv_w + HIDDEN + 2 * FFN)
    cluster = load_cluster_config("h100-sxm-80gb")
    expected = float(memory_time(4.0 * (forward + backward), cluster, eff))
    fp8 = layer_costs(_workload("fp8"), _one(), eff, moe_layer=False, num_micro=8.0)
    bf16 = layer_costs(_workload(), _one(), eff, moe_layer=False, num_micro=8.0)
    assert float(fp8.fp8_casts[0]) == pytest.approx(expected)
    assert float(fp8.fwd[0] - bf16.fwd[0]) == pytest.approx(float(memory_time(4.0 * forward, cluster, eff)))
    assert float(fp8.bwd[0] - bf16.bwd[0]) == pytest.approx(float(memory_time(4.0 * backward, cluster, eff)))
    # full recompute quantises the forward's inputs again
    full_fp8 = layer_costs(_workload("fp8"), _one(2.0), eff, moe_layer=False, num_micro=8.0)
    full_bf16 = layer_costs(_workload(), _one(2.0), eff, moe_layer=False, num_micro=8.0)
    assert float(full_fp8.recompute[0] - full_bf16.recompute[0]) == pytest.approx(
        float(memory_time(4.0 * forward, cluster, eff)))


def test_no_fp8_casts_in_bf16_or_without_an_fp8_peak() -> None:
    eff = Efficiency()
    assert float(np.asarray(layer_costs(_workload(), _one(), eff, moe_layer=False, num_micro=8.0).fp8_casts)) == 0.0
    ampere = layer_costs(_workload("fp8", cluster="a100-sxm-80gb"), _one(), eff, moe_layer=False, num_micro=8.0)
    assert float(np.asarray(ampere.fp8_casts)) == 0.0  # no FP8 tensor cores: the GEMMs run in BF16


def test_fp8_casts_of_a_moe_layer_by_hand() -> None:
    model = load_model_config("tiny-pangu")
    moe = model.moe
    eff = _fp8_gemms_at_bf16_rate()
    w = Workload(model, load_cluster_config("h100-sxm-80gb"), SEQ, 8, precision="fp8")
    layer = layer_costs(w, _one(), eff, moe_layer=True, num_micro=8.0)
    a, h = model.attention, model.hidden_size
    routed = SEQ * moe.router.top_k
    f_e, f_s = moe.expert_ffn_hidden, moe.shared_ffn_hidden
    # MLA: the hidden state into the down-projections, q's and kv's latents into the up-projections, the heads'
    # output into o; the experts as MLPs over their routed tokens, the shared experts (one MLP of their summed
    # width) over every token
    forward = (SEQ * (h + a.q_lora_rank + a.kv_lora_rank + a.num_heads * a.v_head_dim)
               + routed * (h + f_e) + SEQ * (h + f_s))
    backward = (SEQ * (h + a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim
                       + a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
                       + a.num_heads * (a.qk_nope_head_dim + a.v_head_dim))
                + routed * (h + 2 * f_e) + SEQ * (h + 2 * f_s))
    expected = float(memory_time(4.0 * (forward + backward), w.cluster, eff))
    assert float(np.asarray(layer.fp8_casts).ravel()[0]) == pytest.approx(expected)
