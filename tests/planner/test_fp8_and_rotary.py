"""FP8-stored linear inputs and the rotary embedding's per-layer pass: known values against the formulas
they implement."""

from __future__ import annotations

import numpy as np
import pytest

from moetrain.config import load_cluster_config
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
