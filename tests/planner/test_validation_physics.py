"""Mechanisms the published runs exposed: uneven pipeline splits balanced at whole-layer granularity,
sliding-window attention, recomputation inferred from device memory (partial full recompute), stated
communication overlap, the asynchronous input-gradient TP collectives, and the grouped-GEMM roofline."""

from __future__ import annotations

import csv
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from moetrain.config import load_cluster_config, load_model_config
from moetrain.planner.calibration import Efficiency
from moetrain.planner.comm import allgather_time
from moetrain.planner.compute import ExpertShard, expert_compute_time, gemm_time, memory_time
from moetrain.planner.costmodel import balanced_stage_time, evaluate
from moetrain.planner.layer_costs import attention_time_share, layer_costs
from moetrain.planner.strategy import Strategies
from moetrain.planner.validation import prepare_all, prepare_row, read_rows
from moetrain.planner.workload import Workload, runtime_workload


def _layout(tp: int = 1, pp: int = 1, vpp: int = 1, dp: int = 8, recompute: float = 0.0) -> Strategies:
    def one(value: float | bool) -> np.ndarray:
        return np.array([value])

    return Strategies(tp=one(tp), sp=one(tp > 1), pp=one(pp), vpp=one(vpp), ep=one(1), etp=one(1), cp=one(1),
                      dp=one(dp), zero=one(1), micro_batch=one(1), recompute=one(recompute), a2a=one(0),
                      overlap=one(False))


def _workload(**kwargs: object) -> Workload:
    return Workload(load_model_config("tiny-qwen3"), load_cluster_config("h100-sxm-80gb"), 256, 64, **kwargs)


def test_balanced_split_known_values() -> None:
    # 5 layers of 1 s on 2 ranks, head 1 s on the last: 3 | 2 + head → 3 s (the uniform split gives 3.5 s).
    assert balanced_stage_time(5, np.array([2]), 1.0, 0.0, 1.0)[0] == pytest.approx(3.0)
    # 61 layers on 16 ranks, embedding 0.5 and head + MTP 2 layer-times: 3 + e | 4 × 14 | 2 + h → 4.
    assert balanced_stage_time(61, np.array([16]), 1.0, 0.5, 2.0)[0] == pytest.approx(4.0)
    # Never below the mean load nor the head's own time.
    assert balanced_stage_time(4, np.array([4]), 1.0, 0.0, 3.0)[0] == pytest.approx(3.0)


def test_uneven_layer_count_uses_the_balanced_split() -> None:
    model = load_model_config("tiny-qwen3")
    eff = Efficiency()
    even = evaluate(_workload(), _layout(pp=model.num_layers), eff)
    assert model.num_layers % 3, "the test needs a layer count that 3 stages do not divide"
    uneven = evaluate(_workload(), _layout(pp=3), eff)
    # Balanced split: the slowest stage is at most one layer above the mean.
    assert uneven.pipeline.stage_time_s[0] <= even.pipeline.stage_time_s[0] * (model.num_layers / 3 + 1) + 1e-12
    # t_max ≥ t_mean (bubble = 2·t_mean)
    assert uneven.pipeline.stage_time_s[0] >= uneven.pipeline.bubble_s[0] / 2 - 1e-12


def test_sliding_window_share() -> None:
    assert attention_time_share(4096, 0, 0.0) == 1.0
    assert attention_time_share(4096, 8192, 0.5) == 1.0  # a window longer than the sequence is full attention
    windowed = 128 - 128 * 127 / (2 * 4096)
    assert attention_time_share(4096, 128, 0.5) == pytest.approx(0.5 + 0.5 * windowed / (4097 / 2))
    full = evaluate(_workload(), _layout(), Efficiency())
    half = evaluate(_workload(attention_window=32, window_layer_share=0.5), _layout(), Efficiency())
    assert half.step_time_s[0] < full.step_time_s[0]


def test_partial_full_recompute_lies_between_selective_and_full() -> None:
    levels = [1.0, 1.5, 2.0]
    out = [evaluate(_workload(), _layout(recompute=r), Efficiency()) for r in levels]
    steps = [o.step_time_s[0] for o in out]
    memory = [o.memory.activations[0] for o in out]
    factors = [o.hardware_flops_factor[0] for o in out]
    assert steps[0] < steps[1] < steps[2]
    assert memory[0] > memory[1] > memory[2]
    assert factors[1] == pytest.approx((factors[0] + factors[2]) / 2)


def test_stated_comm_overlap_hides_tp_under_the_layer() -> None:
    eff = replace(Efficiency(), tp_overlap=0.0, grad_overlap=0.0)
    layout = _layout(tp=4, dp=2)
    plain = evaluate(_workload(async_tp_input_grad=False), layout, eff)
    stated = evaluate(_workload(async_tp_input_grad=False, comm_overlap_stated=("DP", "TP")), layout, eff)
    assert plain.pipeline.tp_exposed_s[0] == pytest.approx(plain.pipeline.tp_comm_s[0])
    assert stated.pipeline.tp_exposed_s[0] < plain.pipeline.tp_exposed_s[0]
    assert stated.dp.exposed_s[0] <= plain.dp.exposed_s[0]


def test_async_tp_hides_the_column_layers_input_gradient_collectives() -> None:
    """A dense layer on TP 4: two all-reduces (4 all-gather prices) a pass; of the backward's, the column-parallel
    layers' input gradients (2 all-gather prices) run under their weight-gradient GEMMs, hidden up to half the
    layer's forward GEMM time."""
    cluster = load_cluster_config("h100-sxm-80gb")
    layout = _layout(tp=4)
    model = load_model_config("tiny-qwen3")

    def dense(eff: Efficiency, async_tp: bool):
        return layer_costs(_workload(async_tp_input_grad=async_tp), layout, eff, moe_layer=False, num_micro=8)

    eff = Efficiency()
    sync, async_ = dense(eff, False), dense(eff, True)
    assert float(sync.tp_async_hidden) == 0.0
    assert float(async_.tp_comm[0]) == pytest.approx(float(sync.tp_comm[0]))  # the same traffic, less of it shown
    one = allgather_time(256 * model.hidden_size * 2.0, 4, 4, cluster, eff)
    gemms = float(async_.attention[0] - async_.attention_core[0] + async_.dense_ffn[0])
    assert 2 * one < 0.5 * gemms  # the collectives are the shorter here
    assert float(async_.tp_async_hidden[0]) == pytest.approx(2 * one)
    # A slow link: the weight-gradient GEMMs bound what hides.
    slow = replace(eff, bus_intra=0.01)
    assert float(dense(slow, True).tp_async_hidden[0]) == pytest.approx(0.5 * gemms)
    # Exposed: what is not hidden, less the fitted share; stated TP overlap prices the layer's window alone.
    no_share = replace(eff, tp_overlap=0.0)
    exposed = {a: evaluate(_workload(async_tp_input_grad=a), layout, no_share).pipeline for a in (False, True)}
    assert exposed[True].tp_comm_s[0] == pytest.approx(exposed[False].tp_comm_s[0])
    assert exposed[True].tp_exposed_s[0] < exposed[False].tp_exposed_s[0]
    stated = {a: evaluate(_workload(async_tp_input_grad=a, comm_overlap_stated=("TP",)), layout, no_share).pipeline
              for a in (False, True)}
    assert stated[True].tp_exposed_s[0] == pytest.approx(stated[False].tp_exposed_s[0])


def test_which_stacks_run_the_async_tp_collectives(calibration_csv: Path) -> None:
    rows = {r["id"]: r for r in read_rows(calibration_csv)}
    # Megatron-LM 2021 (fp16) waits in line; Megatron-DeepSpeed (2022 on) and the bf16 stacks do not.
    assert not prepare_row(rows["NAR21-03"]).workload.async_tp_input_grad
    assert prepare_row(rows["VTRAIN-M-032"]).workload.async_tp_input_grad
    assert prepare_row(rows["MEGH100-2"]).workload.async_tp_input_grad
    assert not runtime_workload(_workload()).async_tp_input_grad  # this project's TP collectives are synchronous


def test_grouped_gemm_is_weight_bound_with_few_tokens() -> None:
    model = load_model_config("tiny-qwen3")
    cluster = load_cluster_config("h100-sxm-80gb")
    eff = Efficiency()
    few = expert_compute_time(np.array([1.0]), model, cluster, eff, ExpertShard(num_local_experts=8))[0]
    assert model.moe is not None
    params = 3 * model.hidden_size * model.moe.expert_ffn_hidden
    weights = memory_time(8 * params * 2.0, cluster, eff)
    assert few >= weights
    many = expert_compute_time(np.array([1e6]), model, cluster, eff, ExpertShard(num_local_experts=8))[0]
    assert many >= gemm_time(2.0 * params * 1e6, 3, cluster, eff)


def test_rows_read_window_overlap_and_memory(published_rows: list[dict]) -> None:
    rows = {r["id"]: r for r in published_rows}
    gpt_oss = prepare_row(rows["MBR-3"])
    assert gpt_oss.workload.attention_window == 128 and gpt_oss.workload.window_layer_share == 0.5
    megatron = prepare_row(rows["MEGH100-4"])
    assert megatron.workload.comm_overlap_stated == ("DP", "PP", "TP")
    assert prepare_row(rows["NAR21-05"]).workload.comm_overlap_stated == ()
    # MBR-5 states no recompute and does not fit its 180 GB without some: part of its layers recompute.
    mbr5 = prepare_row(rows["MBR-5"])
    assert 1.0 < float(mbr5.strategy.recompute[0]) <= 2.0
    out = evaluate(mbr5.workload, mbr5.strategy, Efficiency())
    assert out.memory.total[0] <= mbr5.workload.cluster.hbm_bytes
    # A stated recompute is kept as stated.
    assert float(prepare_row(rows["VTRAIN-M-002"]).strategy.recompute[0]) == 2.0


def test_torchtitan_pipeline_runs_take_torchtitan_defaults(published_rows: list[dict]) -> None:
    rows = {r["id"]: r for r in published_rows}
    # Interleaved 1F1B, micro-batch count unstated: two stages per rank, pp·2 = 16 micro-batches,
    # so the local batch of 32 sequences is split into micro-batches of 2.
    interleaved = prepare_row(rows["TT-4b"])
    assert int(interleaved.strategy.vpp[0]) == 2 and int(interleaved.strategy.micro_batch[0]) == 2
    # Plain 1F1B: pp = 8 micro-batches of 4.
    # (TT-5 is a throughput row on a device without a published peak; its source states its memory.)
    one_f_one_b = prepare_row({**rows["TT-5"], "metric": "peak_memory_gib", "value": "82.5"})
    assert int(one_f_one_b.strategy.vpp[0]) == 1 and int(one_f_one_b.strategy.micro_batch[0]) == 4
    # A stated micro-batch is kept, and other stacks' empty cells still read as 1.
    assert int(prepare_row({**rows["TT-4b"], "micro_batch": "1"}).strategy.micro_batch[0]) == 1
    assert int(prepare_row(rows["MEGH100-4"]).strategy.micro_batch[0]) == 1
    # The 1F1B run holds its 8 micro-batches of 4 on the first stage: it needs more than the
    # interleaved run, as measured (82.5 against 72.7 GiB).
    memory = [evaluate(r.workload, r.strategy, Efficiency()).memory.total[0] for r in (interleaved, one_f_one_b)]
    assert memory[1] > memory[0]


def test_stated_bf16_gradient_reduction_halves_gradient_bytes(published_rows: list[dict]) -> None:
    row = {r["id"]: r for r in published_rows}["MEGH100-4"]
    fp32 = prepare_row(row)
    bf16 = prepare_row({**row, "source": row["source"] + "; gradients reduced in BF16"})
    assert (fp32.workload.grad_bytes, bf16.workload.grad_bytes) == (4.0, 2.0)
    out32, out16 = (evaluate(r.workload, r.strategy, Efficiency()) for r in (fp32, bf16))
    assert out16.memory.grads[0] == pytest.approx(out32.memory.grads[0] / 2)
    assert out16.dp.comm_s[0] < out32.dp.comm_s[0]


def test_held_out_vtrain_rows_complement_the_calibration_file(published_rows: list[dict]) -> None:
    """benchmarks/data/vtrain_heldout.csv holds the vTrain runs the calibration file leaves out: the odd data
    rows, filled in like the VTRAIN-M rows (same model per size, same cluster), each value the stated time."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "vtrain_heldout.csv"
    held = read_rows(path)
    prepared, unsimulable = prepare_all(held)
    assert unsimulable == [] and len(prepared) == 55
    calibration = {r["id"]: r for r in published_rows if r["id"].startswith("VTRAIN-M-")}
    data_rows = {int(r["id"].rsplit("-", 1)[1]) for r in held}
    assert data_rows == set(range(1, 110, 2))
    assert {int(i.rsplit("-", 1)[1]) for i in calibration} == set(range(2, 109, 2))
    model_columns = ("layers", "hidden", "ffn_hidden", "heads", "vocab", "seq_len", "hardware", "precision",
                     "recompute", "sp")
    shapes = {r["model"]: tuple(r[c] for c in model_columns) for r in calibration.values()}
    for row in held:
        assert shapes[row["model"]] == tuple(row[c] for c in model_columns), row["id"]
        stated_ms = float(re.search(r"iteration time (\d+(?:\.\d+)?) ms", row["source"]).group(1))
        assert float(row["value"]) == pytest.approx(stated_ms / 1000, abs=5e-5)
        assert int(row["num_devices"]) == int(row["tp"]) * int(row["pp"]) * int(row["dp"])
    with path.open(newline="") as f:
        assert csv.DictReader(f).fieldnames == list(published_rows[0])


def _held_out_file(name: str, published_rows: list[dict]) -> tuple[list[dict], list]:
    """A held-out file of benchmarks/data: its raw rows and the prepared ones, after checking that the simulator
    takes every row, that no id is one of the calibration file's and that the columns are its columns."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / name
    held = read_rows(path)
    prepared, unsimulable = prepare_all(held)
    assert unsimulable == []
    assert not {r["id"] for r in held} & {r["id"] for r in published_rows}
    with path.open(newline="") as f:
        assert csv.DictReader(f).fieldnames == list(published_rows[0])
    return held, prepared


def test_dgxc_rows_are_the_stated_runs(published_rows: list[dict]) -> None:
    """benchmarks/data/dgxc_heldout.csv: NVIDIA's DGX Cloud benchmark runs, none of them in the calibration file,
    each value the step time its source quotes, each layout consistent with its stated gradient accumulation."""
    held, prepared = _held_out_file("dgxc_heldout.csv", published_rows)
    assert len(prepared) == 48
    for row in held:
        assert float(row["value"]) == float(re.search(r"training step time (\d+(?:\.\d+)?) s", row["source"]).group(1))
        tp, pp, cp, dp = (int(row[k]) for k in ("tp", "pp", "cp", "dp"))
        assert int(row["num_devices"]) == tp * pp * cp * dp, row["id"]
        accumulation = int(re.search(r"GA[ =](\d+)", row["source"]).group(1))
        assert int(row["global_batch_seqs"]) == accumulation * dp * int(row["micro_batch"]), row["id"]
    moe = [p for p in prepared if p.workload.model.moe is not None]
    assert len(moe) == 14 and all(int(p.strategy.ep[0]) == 8 for p in moe)


def test_llama3_rows_are_the_stated_runs(published_rows: list[dict]) -> None:
    """benchmarks/data/llama3_heldout.csv: Table 4 of the Llama 3 paper, none of it in the calibration file; each
    value the BF16 MFU its source quotes, each layout the stated one with 16M tokens per batch."""
    held, prepared = _held_out_file("llama3_heldout.csv", published_rows)
    assert len(prepared) == 3
    for row in held:
        mfu = float(re.search(r"BF16 MFU (0\.\d+)", row["source"]).group(1))
        tflops = float(re.search(r"(\d+) TFLOP/s per GPU", row["source"]).group(1))
        assert float(row["value"]) == mfu and row["metric"] == "mfu"
        assert tflops / 989.4 == pytest.approx(mfu, abs=0.006)  # the two columns agree at the H100's peak
        tp, pp, cp, dp = (int(row[k]) for k in ("tp", "pp", "cp", "dp"))
        assert (tp, pp) == (8, 16) and int(row["num_devices"]) == tp * pp * cp * dp, row["id"]
        assert int(row["global_batch_seqs"]) * int(row["seq_len"]) == 16 * 2**20, row["id"]  # 16M tokens
    # 126 layers, the embedding and the head as 128 one-layer chunks, 8 per rank
    assert all(int(p.strategy.vpp[0]) == 8 and p.workload.model.num_layers == 126 for p in prepared)
