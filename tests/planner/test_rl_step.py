"""``moetrain simulate --rl``: the RL step's pricing (``moetrain.planner.rl_step``, ``.generation``) on cases
whose answer is known by hand, the staleness rule, the placements' ordering, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moetrain.cli import main
from moetrain.config import ParallelConfig, load_cluster_config, load_model_config
from moetrain.config.cluster import ClusterConfig
from moetrain.config.model import ModelConfig
from moetrain.errors import UserError
from moetrain.planner.calibration import Calibration, Efficiency, load_calibration
from moetrain.planner.generation import SAMPLING_PASSES, HostCosts, Replica, generation_time
from moetrain.planner.rl_step import RLLayout, RLWorkload, colocated_overlap, price_rl_step
from moetrain.planner.workload import Workload

# A dense GQA model small enough to count by hand: per layer q 64·64, k and v 64·32 each, o 64·64, two norms
# of 64, SwiGLU 3·64·256 = 4096 + 2048 + 2048 + 4096 + 128 + 49152 = 61568 parameters.
DENSE = ModelConfig.model_validate({
    "name": "dense-toy", "vocab_size": 1000, "hidden_size": 64, "num_layers": 2, "dense_ffn_hidden": 256,
    "attention": {"kind": "gqa", "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}})
LAYER_PARAMS = 61568
# Compute so fast that every decode kernel waits for memory: 1 TB/s at full efficiency.
FAST = ClusterConfig(name="fast", device="toy", peak_tflops_bf16=1e9, hbm_gb=80, hbm_bandwidth_tbps=1.0,
                     devices_per_node=8, intra_node_gbps=100, inter_node_gbps=50)
IDEAL = Efficiency(gemm_max=1.0, gemm_overhead_us=0.0, moe_overhead_us=0.0, attention=1.0, memory=1.0)


def test_decode_step_is_bytes_over_bandwidth():
    rows, prompt, response = 4, 10, 6
    times = generation_time(Workload(DENSE, FAST, prompt + response, rows), Replica(rows, 1), prompt, response, IDEAL)
    context = prompt + response / 2  # the mean context over the decode steps
    kv = rows * context * 2 * 2 * 16 * 2  # K and V, 2 kv heads of 16, bf16
    layers = 2 * (LAYER_PARAMS * 2 + kv)
    head = 64 * 1000 * 2
    sampling = SAMPLING_PASSES * 2 * 4 * rows * 1000
    assert times.decode_memory_bound
    assert times.decode_step_s == pytest.approx((layers + head + sampling) / 1e12, rel=1e-9)
    # N new tokens: N draws, N − 1 decode forwards (the prefill's head gives the first token)
    assert times.decode_s == pytest.approx((response - 1) * (layers + head) / 1e12 + response * sampling / 1e12,
                                           rel=1e-9)


def test_host_floor_adds_on_a_cpu_and_hides_on_an_accelerator():
    w = Workload(DENSE, FAST, 16, 4)
    bare = generation_time(w, Replica(4, 1), 10, 6, IDEAL)
    cpu = generation_time(w, Replica(4, 1, HostCosts(layer_forward_us=100.0, host_is_device=True)), 10, 6, IDEAL)
    gpu = generation_time(w, Replica(4, 1, HostCosts(layer_forward_us=100.0)), 10, 6, IDEAL)
    # 2 layers × 100 µs per forward; the device's own time (ns here) is below the floor on the accelerator
    assert cpu.decode_step_s - bare.decode_step_s == pytest.approx(2 * 100e-6, rel=1e-3)
    head_and_sampling = bare.decode_step_s - 2 * (LAYER_PARAMS * 2 + 4 * 13 * 128) / 1e12
    assert gpu.decode_step_s == pytest.approx(2 * 100e-6 + head_and_sampling, rel=1e-6)


def test_engine_work_adds_per_decode_forward_on_a_cpu():
    # 4 rows, 6 new tokens: 5 decode forwards, each with the engine's 30 µs + 4 rows × 5 µs on a CPU
    w = Workload(DENSE, FAST, 16, 4)
    base = HostCosts(layer_forward_us=100.0, host_is_device=True)
    bare = generation_time(w, Replica(4, 1, base), 10, 6, IDEAL)
    engine = HostCosts(layer_forward_us=100.0, host_is_device=True, engine_step_us=30.0, engine_row_us=5.0)
    timed = generation_time(w, Replica(4, 1, engine), 10, 6, IDEAL)
    assert engine.engine_step_s(4) == pytest.approx(50e-6)
    assert timed.decode_s - bare.decode_s == pytest.approx(5 * 50e-6, rel=1e-9)
    assert timed.decode_step_s - bare.decode_step_s == pytest.approx(50e-6, rel=1e-9)
    assert timed.prefill_s == bare.prefill_s
    # on an accelerator the host issues it while the device runs the step: no change
    gpu_host = HostCosts(layer_forward_us=100.0, engine_step_us=30.0, engine_row_us=5.0)
    gpu = generation_time(w, Replica(4, 1, gpu_host), 10, 6, IDEAL)
    assert gpu.decode_s == generation_time(w, Replica(4, 1, HostCosts(layer_forward_us=100.0)), 10, 6, IDEAL).decode_s


def test_decode_priced_at_the_running_rows():
    # 8 rows of which half run on average: each decode step is the 4-row step; the prefill stays at 8 rows
    w = Workload(DENSE, FAST, 16, 8)
    host = HostCosts(layer_forward_us=100.0, host_is_device=True, engine_step_us=30.0, engine_row_us=5.0)
    half = generation_time(w, Replica(8, 1, host), 10, 6, IDEAL, running_share=0.5)
    four = generation_time(w, Replica(4, 1, host), 10, 6, IDEAL)
    assert half.decode_s == pytest.approx(four.decode_s, rel=1e-12)
    assert half.prefill_s == generation_time(w, Replica(8, 1, host), 10, 6, IDEAL).prefill_s
    with pytest.raises(ValueError, match="running share"):
        generation_time(w, Replica(8, 1, host), 10, 6, IDEAL, running_share=0.0)
    rl = RLWorkload(DENSE, FAST, 4, 2, 10, 6, "fp32", decode_running_share=0.5)
    priced = price_rl_step(rl, RLLayout("colocated", 1, ParallelConfig(micro_batch=8)), Calibration(IDEAL, {}), host)
    assert priced.phases.decode_s == pytest.approx(
        generation_time(Workload(DENSE, FAST, 16, 8, "fp32"), Replica(4, 1, host), 10, 6, IDEAL).decode_s, rel=1e-12)


def test_runtime_reduce_scatter_runs_as_an_all_reduce():
    # moetrain's runtime reduce-scatters by an all-reduce (gloo): with sequence parallelism each
    # all-gather + reduce-scatter pair costs 3 ring passes instead of 2; ZeRO-1's gradient reduction 2 instead of 1
    from moetrain.planner.simulate import simulate_layout

    cluster = ClusterConfig(name="link", device="toy", peak_tflops_bf16=1e9, hbm_gb=80, hbm_bandwidth_tbps=1e6,
                            devices_per_node=8, intra_node_gbps=1.0, inter_node_gbps=1.0, intra_node_latency_us=0.0)
    calibration = Calibration(IDEAL, {})

    def comm(parallel: ParallelConfig, flag: bool) -> dict:
        w = Workload(DENSE, cluster, 16, 8, "fp32", overlap_grad_comm=False, reduce_scatter_by_all_reduce=flag)
        return simulate_layout(w, parallel, parallel.world_size, calibration).communication_s

    tp = ParallelConfig(tp=2, sp=True, micro_batch=8)
    assert comm(tp, True)["tensor_parallel"].total_s == pytest.approx(
        1.5 * comm(tp, False)["tensor_parallel"].total_s, rel=1e-9)
    # ZeRO-1 over 2 ranks: gradients (4 B) reduce-scattered, parameters (2 B) all-gathered: 4 + 2 units of the
    # ring, 2·4 + 2 with the all-reduce
    dp = ParallelConfig(dp=2, micro_batch=4)
    assert comm(dp, True)["data_parallel"].total_s == pytest.approx(
        10 / 6 * comm(dp, False)["data_parallel"].total_s, rel=1e-9)
    # and nothing hides it: moetrain reduces after the backward
    assert comm(dp, True)["data_parallel"].exposed_s == pytest.approx(comm(dp, True)["data_parallel"].total_s)


def test_project_tensor_parallel_by_hand():
    # this project's TP: in an MoE layer only attention is a TP region (an all-gather and a reduce-scatter in
    # the forward, again in the backward), the routers all-gather fp32 logits and scores and all-reduce the
    # int64 counts (forward only); Megatron's also splits the shared expert (2 more per pass)
    import numpy as np

    from moetrain.planner.layer_costs import layer_costs
    from moetrain.planner.simulate import simulate_layout
    from moetrain.planner.strategy import Strategies

    model = load_model_config("tiny-pangu")
    cluster = ClusterConfig(name="link", device="toy", peak_tflops_bf16=1e9, hbm_gb=80, hbm_bandwidth_tbps=1e6,
                            devices_per_node=8, intra_node_gbps=1.0, inter_node_gbps=1.0, intra_node_latency_us=0.0)
    strategies = Strategies.from_parallel([ParallelConfig(tp=2, sp=True, micro_batch=4)])

    def tp_comm(flag: bool) -> float:
        w = Workload(model, cluster, 16, 4, "fp32", project_tensor_parallel=flag)
        eff = Efficiency(gemm_max=1.0, gemm_overhead_us=0.0, moe_overhead_us=0.0, attention=1.0, memory=1.0,
                         bus_intra=1.0)
        return float(np.ravel(layer_costs(w, strategies, eff, True, 1.0).tp_comm)[0])

    tokens, experts = 4 * 16, model.moe.num_experts
    one = 0.5 * tokens * model.hidden_size * 4 / 1e9  # one all-gather of the [tokens, hidden] fp32 activation
    router = (2 * 0.5 * tokens * experts * 4 + 2 * 0.5 * experts * 8) / 1e9
    assert model.moe.num_shared_experts
    assert tp_comm(False) == pytest.approx(4 * one * 2, rel=1e-9)
    assert tp_comm(True) == pytest.approx(2 * one * 2 + router, rel=1e-9)
    # the output head runs whole on every TP rank: twice the head of a vocabulary split over tp = 2
    head = {flag: simulate_layout(Workload(DENSE, FAST, 16, 8, project_tensor_parallel=flag),
                                  ParallelConfig(tp=2, sp=True, micro_batch=8), 2, Calibration(IDEAL, {}))
            .compute_s["head"] for flag in (False, True)}
    assert head[True] == pytest.approx(2 * head[False], rel=1e-9)


def _tiny(prompts: int = 16, **kwargs) -> RLWorkload:
    return RLWorkload(load_model_config("tiny-pangu"), load_cluster_config("cpu"), prompts, 8, 16, 8, "fp32", **kwargs)


def _calibration() -> Calibration:
    return load_calibration()


@pytest.mark.parametrize("staleness", [1, 4])
def test_staleness_pipelines_generation_and_training(staleness: int):
    w, cal = _tiny(), _calibration()
    layout = RLLayout("disaggregated", 2, ParallelConfig(micro_batch=16), rollout_devices=1)
    sync = price_rl_step(w, layout, cal)
    stale = price_rl_step(w, RLLayout("disaggregated", 2, ParallelConfig(micro_batch=16), rollout_devices=1,
                                      staleness=staleness), cal)
    ph = sync.phases
    assert sync.step_s == pytest.approx(ph.generate_s + ph.reward_s + ph.logprob_s + ph.train_s + ph.push_s)
    # the push travels in the background: without the sync's host rates nothing of it is the trainer's
    assert stale.step_s == pytest.approx(max(ph.generate_s + ph.reward_s + ph.push_s, ph.logprob_s + ph.train_s))
    assert stale.step_s < sync.step_s
    assert stale.generated_tokens_per_s == pytest.approx(128 * 8 / stale.step_s)


def test_colocated_is_the_sum_of_its_phases():
    p = price_rl_step(_tiny(logprob_forwards=1, reward_s=0.01),
                      RLLayout("colocated", 2, ParallelConfig(dp=2, micro_batch=16), offload=True), _calibration())
    ph = p.phases
    assert ph.offload_s > 0 and ph.offload_s == ph.restore_s and ph.push_s == 0 and ph.gather_s > 0
    assert p.step_s == pytest.approx(ph.offload_s + ph.reshard_s + ph.generate_s + ph.gather_s + ph.restore_s
                                     + ph.reward_s + ph.logprob_s + ph.train_s)


def test_placements_order_where_the_answer_is_obvious():
    w, cal = _tiny(), _calibration()
    colocated = price_rl_step(w, RLLayout("colocated", 2, ParallelConfig(dp=2, micro_batch=16)), cal)
    alternating = price_rl_step(w, RLLayout("disaggregated", 2, ParallelConfig(micro_batch=16), rollout_devices=1),
                                cal)
    # Alternating on half the devices each does the same work at half the speed: colocated wins.
    assert colocated.step_s < alternating.step_s
    # An offload over a very slow host link costs colocated more than everything else: pipelined wins.
    slow = RLLayout("colocated", 2, ParallelConfig(dp=2, micro_batch=16), offload=True, host_link_gbps=1e-4)
    pipelined = RLLayout("disaggregated", 2, ParallelConfig(micro_batch=16), rollout_devices=1, staleness=1)
    assert price_rl_step(w, pipelined, cal).step_s < price_rl_step(w, slow, cal).step_s


TINY_RL = ["simulate", "--rl", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "2", "--prompts", "16",
           "--group-size", "8", "--prompt-len", "16", "--response-len", "8", "--dtype", "fp32",
           "--micro-batch", "64"]


def test_cli_json_prices_both_placements(capsys: pytest.CaptureFixture[str]):
    assert main([*TINY_RL, "--staleness", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {row["placement"]: row for row in out["predictions"]}
    assert set(rows) == {"colocated", "disaggregated"}
    assert rows["disaggregated"]["staleness"] == 2 and rows["colocated"]["staleness"] == 2
    assert out["faster"] == min(rows.values(), key=lambda r: r["step_s"])["placement"]
    assert rows["colocated"]["phases_s"]["train_s"] > 0 and rows["disaggregated"]["phases_s"]["push_s"] > 0


@pytest.mark.parametrize("extra,expected", [
    (["--placement", "nowhere"], "--placement 'nowhere': choose one of colocated, disaggregated, both"),
    (["--rollout-devices", "2"], "--rollout-devices 2 must leave devices to train and to generate"),
    (["--staleness", "-1"], "--staleness cannot be negative"),
    (["--gen-ep", "3"], "3 devices per generation replica do not divide"),
])
def test_cli_errors_are_one_line_exit_2(capsys: pytest.CaptureFixture[str], extra: list[str], expected: str):
    assert main([*TINY_RL, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and expected in err


def test_cli_completion_length_prices_the_trained_positions_it_leaves(capsys: pytest.CaptureFixture[str]):
    """Samples that stop early: the head on their completions, the step on prompt + their mean length."""
    assert main([*TINY_RL, "--placement", "disaggregated", "--json"]) == 0
    padded = json.loads(capsys.readouterr().out)["predictions"][0]["phases_s"]
    assert main([*TINY_RL, "--placement", "disaggregated", "--completion-len", "4", "--json"]) == 0
    short = json.loads(capsys.readouterr().out)["predictions"][0]["phases_s"]
    # the same step on 128 samples of 16 + 4 positions: what --response-len 4 prices for training
    at = TINY_RL.index("--response-len")
    assert main([*TINY_RL[:at], "--response-len", "4", *TINY_RL[at + 2:], "--placement", "disaggregated",
                 "--json"]) == 0
    four = json.loads(capsys.readouterr().out)["predictions"][0]["phases_s"]
    assert short["train_s"] == pytest.approx(four["train_s"]) and short["train_s"] < padded["train_s"]
    assert short["generate_s"] == pytest.approx(padded["generate_s"])  # generation still runs to the limit
    assert main([*TINY_RL, "--completion-len", "9"]) == 2
    assert "--completion-len 9 must be in (0, --response-len 8]" in capsys.readouterr().err


def test_cli_needs_the_response_length(capsys: pytest.CaptureFixture[str]):
    at = TINY_RL.index("--response-len")
    argv = TINY_RL[:at] + TINY_RL[at + 2:]
    assert main(argv) == 2
    assert "--rl needs --response-len" in capsys.readouterr().err


def test_rl_pricing_imports_no_torch():
    code = ("import sys, moetrain.planner.rl_step, moetrain.planner.generation, moetrain.cli.simulate_rl; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_overlap_on_shared_cores_is_processor_sharing():
    from moetrain.planner.rl_step import overlapped_time

    assert overlapped_time(0.3, 0.5) == 0.5  # separate devices
    assert overlapped_time(0.3, 0.5, shared_cores=2.0) == pytest.approx(0.5)  # a core each
    assert overlapped_time(0.3, 0.5, shared_cores=1.0) == pytest.approx(0.8)  # one core: time-sliced
    # 1.2 cores: both at 0.6 of a core until 0.3 s of work is done (0.5 s), then 0.2 s alone at full speed
    assert overlapped_time(0.5, 0.3, shared_cores=1.2) == pytest.approx(0.3 / 0.6 + 0.2)
    # several processes a side: 2 replicas of 0.2 s and 2 trainer ranks of 0.5 s on 2 cores run at half a
    # core each until the replicas are done (0.4 s), then the trainer ranks' last 0.3 s at a core each
    assert overlapped_time(0.2, 0.5, shared_cores=2.0, processes=(2, 2)) == pytest.approx(0.4 + 0.3)
    # 1 replica of 0.6 s beside 2 trainer ranks of 0.2 s on 1.8 cores: 3 processes at 0.6 of a core until
    # 0.2 s is done (1/3 s), then the replica's last 0.4 s alone at one core
    assert overlapped_time(0.6, 0.2, shared_cores=1.8, processes=(1, 2)) == pytest.approx(0.2 / 0.6 + 0.4)


def test_replicas_beside_a_trainer_group_share_the_cores_and_pack_each_bucket_once():
    """R = 2 rollout replicas beside a DP2 trainer group on one 2-core CPU, k = 1: each replica generates
    half of every batch, every trainer rank packs half the weights once (a bucket goes to both replicas
    at once), and the four processes share the cores."""
    from moetrain.planner.rl_step import SyncRates, weight_bytes

    w, cal = _tiny(), _calibration()
    rates = SyncRates(copy_bytes_per_s=40e9, crc_bytes_per_s=4e9)
    per_byte = 1 / 40e9 + 1 / 4e9
    layout = RLLayout("disaggregated", 4, ParallelConfig(dp=2, micro_batch=64), rollout_devices=2, staleness=1,
                      shared_cores=2.0)
    p = price_rl_step(w, layout, cal, sync=rates)
    ph = p.phases
    assert (p.replicas, p.train_devices) == (2, 2)
    eff = cal.for_device("cpu")
    half = generation_time(w.samples_workload, Replica(64, 1), 16, 8, eff)  # 64 of the 128 rows
    assert ph.generate_s == pytest.approx(half.total_s)
    weights = weight_bytes(w)
    rollout = ph.generate_s + ph.push_s - weights * per_byte  # the trainer ranks packed every bucket
    train = ph.train_s + weights / 2 * per_byte  # each trainer rank packs its half, once
    short, long = sorted((rollout, train))
    # four processes on two cores: half a core each until the shorter side is done, then a core each
    assert p.step_s == pytest.approx(short / 0.5 + (long - short) / 1.0, rel=1e-9)
    # on separate devices the longer side sets the step
    apart = price_rl_step(w, RLLayout("disaggregated", 4, ParallelConfig(dp=2, micro_batch=64), rollout_devices=2,
                                      staleness=1), cal, sync=rates)
    assert apart.step_s == pytest.approx(long, rel=1e-9)


def test_colocated_overlap_fills_only_the_device_time_generation_leaves_idle():
    # an accelerator: 3 s of generation of which 1 s keeps the device busy (2 s of host floor), 1.5 s of update
    assert colocated_overlap(3.0, 1.0, 1.5) == 3.0  # the update fits in the host's 2 s
    assert colocated_overlap(3.0, 1.0, 2.5) == 3.5  # 1 s + 2.5 s of device work, one after the other
    # one CPU, two threads with 1.5 cores' worth between them: both at 0.75 until 1.5 s of update is done
    # (2 s), then generation's last 1.5 s alone at one core: 3.5 s
    assert colocated_overlap(3.0, 1.0, 1.5, shared_cores=1.5) == pytest.approx(3.5)


def test_colocated_k1_composes_its_serial_phases_with_the_overlap():
    w, cal, train = _tiny(logprob_forwards=1, reward_s=0.01), _calibration(), ParallelConfig(dp=2, micro_batch=16)
    host = HostCosts(layer_forward_us=2000.0, probe_tokens=1)  # an eager host floor of 2 ms per layer pass
    sync = price_rl_step(w, RLLayout("colocated", 2, train), cal, host)
    k1 = price_rl_step(w, RLLayout("colocated", 2, train, staleness=1), cal, host)
    ph, bare = k1.phases, price_rl_step(w, RLLayout("colocated", 2, train), cal).phases
    serial = ph.reshard_s + ph.gather_s + ph.reward_s + ph.logprob_s
    assert k1.step_s == pytest.approx(serial + max(ph.generate_s, bare.generate_s + ph.train_s))
    assert k1.step_s < sync.step_s == pytest.approx(serial + ph.generate_s + ph.train_s)
    with pytest.raises(UserError, match="drop --offload"):
        price_rl_step(w, RLLayout("colocated", 2, train, staleness=1, offload=True), cal)


def test_training_runs_the_head_on_the_completion_tokens_only():
    # The trainer scores completions only (rl.grpo.PolicyObjective): of 24 positions per sequence, the head
    # and its loss run on 6; the rest of the step does not change.
    from moetrain.planner.compute import gemm_time, memory_time
    from moetrain.planner.rl_step import training_prediction

    cal = _calibration()
    layout = RLLayout("disaggregated", 2, ParallelConfig(micro_batch=128), rollout_devices=1)
    full = _tiny(train_seq_len=24, completion_len=24.0)
    scored = _tiny(train_seq_len=24, completion_len=6.0)
    assert full.model.num_mtp_layers == 1  # whose head predicts at every position, in both
    assert (full.head_share, scored.head_share) == (1.0, 0.25)
    eff = cal.for_device(full.cluster.device)
    vocab, hidden, tokens = full.model.vocab_size, full.model.hidden_size, 128 * 24

    def head(t: float) -> float:  # forward + backward (3 GEMMs, 3 passes over the fp32 logits)
        return float(3 * gemm_time(2.0 * hidden * vocab * t, 1, full.cluster, eff, "fp32")
                     + 3 * memory_time(3 * 4.0 * vocab * t, full.cluster, eff))

    saved = (float(training_prediction(full, layout, cal).step_time_s)
             - float(training_prediction(scored, layout, cal).step_time_s))
    assert saved == pytest.approx(head(tokens) - head(tokens * 0.25), rel=1e-9)
    assert _tiny(train_seq_len=24).head_share == 8 / 24  # by default every sample runs to response_len


def test_a_logprob_forward_runs_the_head_on_the_scored_tokens_only():
    from moetrain.planner.generation import forward_time

    w = Workload(DENSE, FAST, 16, 4)
    full, quarter = (forward_time(w, Replica(4, 1), 16, IDEAL, head_share=share) for share in (1.0, 0.25))
    tokens = 4 * 16  # rows × positions
    head = 2 * 64 * 1000 * tokens / 1e21  # 2·h·V multiply-adds per token at 1e9 TFLOP/s
    softmax = SAMPLING_PASSES * 2 * 4 * tokens * 1000 / 1e12  # fp32 passes over the logits at 1 TB/s
    assert full - quarter == pytest.approx(0.75 * (head + softmax), rel=1e-9)


def test_a_background_push_costs_the_trainer_its_packing_and_the_rollout_side_the_rest():
    from moetrain.planner.rl_step import SyncRates, weight_bytes

    w, cal = _tiny(), _calibration()
    rates = SyncRates(copy_bytes_per_s=40e9, crc_bytes_per_s=4e9)
    sync0, stale = (price_rl_step(w, RLLayout("disaggregated", 2, ParallelConfig(micro_batch=16), rollout_devices=1,
                                              staleness=k, shared_cores=2.0), cal, sync=rates) for k in (0, 1))
    ph = stale.phases
    pack = weight_bytes(w) * (1 / 40e9 + 1 / 4e9)  # one copy and one CRC of the whole model, one replica
    assert ph.push_s == sync0.phases.push_s and ph.push_s > 2 * pack  # the receiver writes and checks too
    assert sync0.step_s == pytest.approx(ph.generate_s + ph.train_s + ph.push_s)
    assert ph.train_s > ph.generate_s + ph.push_s  # training is the longer side here
    assert stale.step_s == pytest.approx(ph.train_s + pack, rel=1e-9)
