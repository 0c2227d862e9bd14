"""Measured links and the weight sync's host work in ``moetrain simulate --rl``: the link fit
(``planner.comm.fit_link``), the reshard / push / rows-gather prices and the log-prob forward on the
generation model (``planner.rl_step``), each against values computed by hand; and the probes behind them
(``train.profiler.profile_collectives``, ``profile_sync_rates``)."""

from __future__ import annotations

import math
import re

import pytest

from moetrain.config import ParallelConfig
from moetrain.config.cluster import ClusterConfig
from moetrain.config.model import ModelConfig
from moetrain.errors import UserError
from moetrain.planner.calibration import Calibration, Efficiency
from moetrain.planner.comm import collective_terms, fit_link
from moetrain.planner.generation import SAMPLING_PASSES, HostCosts, Replica, forward_time, generation_time
from moetrain.planner.rl_step import RLLayout, RLWorkload, SyncRates, price_rl_step
from moetrain.planner.workload import Workload

# The dense toy of test_rl_step: 2 layers of 61,568 parameters, embedding and untied head of 1000 × 64,
# final norm 64: 2·61568 + 2·64000 + 64 = 251,200 parameters, 1,004,800 bytes in fp32.
DENSE = ModelConfig.model_validate({
    "name": "dense-toy", "vocab_size": 1000, "hidden_size": 64, "num_layers": 2, "dense_ffn_hidden": 256,
    "attention": {"kind": "gqa", "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}})
WEIGHTS_FP32 = 251_200 * 4
# A link of 1 GB/s and 100 µs, compute and memory so fast that only the link and the sync's rates count.
SLOW_LINK = ClusterConfig(name="slow-link", device="toy", peak_tflops_bf16=1e9, hbm_gb=80, hbm_bandwidth_tbps=1e6,
                          devices_per_node=8, intra_node_gbps=1.0, inter_node_gbps=1.0, intra_node_latency_us=100.0,
                          inter_node_latency_us=100.0)
IDEAL = Efficiency(gemm_max=1.0, gemm_overhead_us=0.0, moe_overhead_us=0.0, attention=1.0, memory=1.0,
                   bus_intra=1.0, bus_inter=1.0)
RATES = SyncRates(copy_bytes_per_s=10e9, crc_bytes_per_s=1e9)


def test_collective_terms_are_the_formulas_coefficients():
    assert collective_terms("all_gather", 4) == (3.0, 0.75)
    assert collective_terms("reduce_scatter", 2) == (1.0, 0.5)
    assert collective_terms("all_reduce", 4) == (6.0, 1.5)
    assert collective_terms("all_to_all", 4) == (1.0, 0.75)
    assert collective_terms("send_recv", 4) == (1.0, 1.0)
    with pytest.raises(ValueError, match="broadcast"):
        collective_terms("broadcast", 4)


def test_fit_link_recovers_latency_and_bandwidth():
    # 200 µs and 2 GB/s, by hand: all-reduce of 1 MB on 4 ranks 6·200 µs + 1.5·1e6 / 2e9 = 1.95 ms; all-gather
    # of 4 MB on 2 ranks 200 µs + 0.5·4e6 / 2e9 = 1.2 ms; all-to-all of 100 kB on 4 ranks 200 µs + 0.75·1e5 / 2e9
    # = 237.5 µs; a send of 1 MB 200 µs + 1e6 / 2e9 = 700 µs.
    rows = [{"kind": "all_reduce", "group": 4, "bytes": 1e6, "seconds": 1.95e-3},
            {"kind": "all_gather", "group": 2, "bytes": 4e6, "seconds": 1.2e-3},
            {"kind": "all_to_all", "group": 4, "bytes": 1e5, "seconds": 237.5e-6},
            {"kind": "send_recv", "group": 4, "bytes": 1e6, "seconds": 700e-6}]
    fit = fit_link(rows)
    assert fit.latency_us == pytest.approx(200.0, rel=1e-9)
    assert fit.gbps == pytest.approx(2.0, rel=1e-9)
    assert all(abs(r) < 1e-6 for r in fit.residual_pct.values())
    cluster = fit.cluster(SLOW_LINK)
    assert (cluster.intra_node_gbps, cluster.intra_node_latency_us) == pytest.approx((2.0, 200.0))
    assert cluster.inter_node_gbps == 1.0  # only the in-node link is measured


def test_each_collective_kind_gets_its_own_fitted_link():
    """gloo's all-reduce costs far more per message than its all-gather: each kind with two sizes or more is
    fitted on its own measurements and priced on its own link. By hand, on 2 ranks: all-reduce at 1 ms and
    2 GB/s (2 latencies, the whole buffer over the link: 2 ms + 1e6 / 2e9 = 2.5 ms for 1 MB), all-gather at
    100 µs and 1 GB/s (100 µs + 0.5 · 1e6 / 1e9 = 600 µs for 1 MB)."""
    from moetrain.planner.comm import allgather_time, allreduce_time

    def reduce(size):
        return 2 * 1e-3 + size / 2e9

    def gather(size):
        return 100e-6 + 0.5 * size / 1e9

    rows = ([{"kind": "all_reduce", "group": 2, "bytes": b, "seconds": reduce(b)} for b in (1e4, 1e6)]
            + [{"kind": "all_gather", "group": 2, "bytes": b, "seconds": gather(b)} for b in (1e4, 1e6)]
            + [{"kind": "all_to_all", "group": 2, "bytes": 1e6, "seconds": 1e-3}])  # one size: no fit of its own
    fit = fit_link(rows)
    assert set(fit.kinds) == {"all_reduce", "all_gather"}
    assert (fit.kinds["all_reduce"].latency_us, fit.kinds["all_reduce"].gbps) == pytest.approx((1000.0, 2.0))
    assert (fit.kinds["all_gather"].latency_us, fit.kinds["all_gather"].gbps) == pytest.approx((100.0, 1.0))
    cluster = fit.cluster(SLOW_LINK)
    assert allreduce_time(1e6, 2, 2, cluster) == pytest.approx(2.5e-3)
    assert allgather_time(1e6, 2, 2, cluster) == pytest.approx(600e-6)
    # a cluster with measured links stays a key (workloads group by their cluster)
    assert {cluster: 1}[fit.cluster(SLOW_LINK)] == 1
    # the all-to-all, with no link of its own, is priced on the overall fit
    assert "all_to_all" not in cluster.collective_links
    assert cluster.intra_node_latency_us == pytest.approx(fit.latency_us)


def test_fit_link_keeps_latency_non_negative():
    # pure bandwidth (0 µs, 1 GB/s): sends of 1 and 2 MB in 1 and 2 ms
    fit = fit_link([{"kind": "send_recv", "group": 2, "bytes": 1e6, "seconds": 1e-3},
                    {"kind": "send_recv", "group": 2, "bytes": 2e6, "seconds": 2e-3}])
    assert fit.latency_us == pytest.approx(0.0, abs=1e-9) and fit.gbps == pytest.approx(1.0, rel=1e-9)


def _workload(**kwargs) -> RLWorkload:
    return RLWorkload(DENSE, SLOW_LINK, 4, 2, 10, 6, "fp32", **kwargs)


def _calibration() -> Calibration:
    return Calibration(IDEAL, {})


def test_reshard_is_the_sync_serial_bucket_chain_by_hand():
    # 4 devices, training TP2 × DP2: the (dense) weights are split over 2 shards, so each device already holds
    # W/2 and every weight is lacked by some device. Each generates with a whole model (W = 1,004,800 B). The
    # sync walks its buckets one after the other: W crosses the link once, in buckets of W/8 (8 messages, one
    # latency each), and every bucket is packed and written (a copy and a CRC-32 each side): the 4 devices'
    # own halves in their turn and the W lacked.
    layout = RLLayout("colocated", 4, ParallelConfig(tp=2, dp=2, micro_batch=2), sync_bucket_bytes=WEIGHTS_FP32 / 8)
    w = _workload()
    link = WEIGHTS_FP32 / 1e9 + 8 * 100e-6
    host = 2 * (4 * WEIGHTS_FP32 / 2 + WEIGHTS_FP32) * (1 / 10e9 + 1 / 1e9)
    agreement = 2 * (0.75 * 8 / 1e9 + 3 * 100e-6)  # all-reduce of one 8-byte flag over the 4 ranks
    priced = price_rl_step(w, layout, _calibration(), sync=RATES).phases
    assert priced.reshard_s == pytest.approx(link + host + agreement, rel=1e-9)
    # without the rates and the bucket size: the lacked bytes as one message
    assert price_rl_step(w, RLLayout("colocated", 4, ParallelConfig(tp=2, dp=2, micro_batch=2)),
                         _calibration()).phases.reshard_s == pytest.approx(WEIGHTS_FP32 / 1e9 + 100e-6, rel=1e-9)
    # data parallel only: every device holds the whole model; nothing crosses the link, each device copies
    # and checks its own weights in its turn
    dp = price_rl_step(w, RLLayout("colocated", 4, ParallelConfig(dp=4, micro_batch=2)), _calibration(),
                       sync=RATES).phases
    assert dp.reshard_s == pytest.approx(2 * 4 * WEIGHTS_FP32 * (1 / 10e9 + 1 / 1e9) + agreement, rel=1e-9)


def test_reshard_bytes_split_dense_over_tp_and_experts_over_ep():
    from moetrain.config import load_model_config
    from moetrain.costs.params import count_params
    from moetrain.planner.rl_step import _reshard_bytes

    model = load_model_config("tiny-pangu")
    counts = count_params(model)
    dense, experts = (counts.total - counts.experts) * 4.0, counts.experts * 4.0
    w = RLWorkload(model, SLOW_LINK, 4, 2, 10, 6, "fp32")

    def held(parallel: ParallelConfig, devices: int, gen_ep: int = 1) -> tuple[float, float]:
        return _reshard_bytes(w, RLLayout("colocated", devices, parallel, gen_devices_per_replica=gen_ep))

    # EP2: the dense weights are on both devices, half the experts on each; only the experts move
    assert held(ParallelConfig(dp=2, ep=2), 2) == pytest.approx((dense + experts / 2, experts))
    # TP2 (experts not split: etp 1): half the dense weights on each, every expert; only the dense weights move
    assert held(ParallelConfig(tp=2, sp=True), 2) == pytest.approx((dense / 2 + experts, dense))
    # PP2 × EP2: both split over the stages, the experts also over EP
    assert held(ParallelConfig(pp=2, dp=2, ep=2), 4) == pytest.approx((dense / 2 + experts / 4, dense + experts))
    # generation in EP2 replicas over an EP2 training layout: each device's generation experts are its own
    assert held(ParallelConfig(dp=2, ep=2), 2, gen_ep=2) == pytest.approx((dense + experts / 2, 0.0))


def test_push_is_send_buckets_host_work_and_agreement_by_hand():
    # 1 rollout + 1 training device: W crosses one link in ceil(W / (W/4)) = 4 buckets
    layout = RLLayout("disaggregated", 2, ParallelConfig(micro_batch=8), rollout_devices=1,
                      sync_bucket_bytes=WEIGHTS_FP32 / 4)
    send = WEIGHTS_FP32 / 1e9 + 100e-6 + 3 * 100e-6  # bytes over the link, one latency per bucket
    host = 2 * WEIGHTS_FP32 * (1 / 10e9 + 1 / 1e9)  # packed by the trainer, written and checked by the receiver
    agreement = 2 * (0.5 * 8 / 1e9 + 1 * 100e-6)
    priced = price_rl_step(_workload(), layout, _calibration(), sync=RATES).phases
    assert priced.push_s == pytest.approx(send + host + agreement, rel=1e-9)


def test_sync_host_rate_of_the_whole_sync_replaces_the_buffer_rates():
    # measured on the model's own sync: 2 GB/s of packed or written bytes, whatever the copy and CRC rates
    rates = SyncRates(copy_bytes_per_s=10e9, crc_bytes_per_s=1e9, host_bytes_per_s=2e9)
    assert rates.seconds(1e6) == pytest.approx(0.5e-3, rel=1e-12)
    layout = RLLayout("colocated", 2, ParallelConfig(dp=2, micro_batch=4))
    priced = price_rl_step(_workload(), layout, _calibration(), sync=rates).phases
    agreement = 2 * (0.5 * 8 / 1e9 + 100e-6)
    # data parallel: each of the 2 devices packs and writes its own whole model, one after the other
    assert priced.reshard_s == pytest.approx(2 * 2 * WEIGHTS_FP32 / 2e9 + agreement, rel=1e-9)


def test_whole_sync_probe_of_a_small_model():
    from moetrain.train.profiler import profile_weight_sync

    probe = profile_weight_sync(DENSE, repeats=1, bucket_bytes=1 << 18)
    assert probe["bytes"] == WEIGHTS_FP32 and probe["boxes"] >= 10 and probe["buckets"] >= 4
    assert probe["host_bytes_per_s"] == pytest.approx(2 * WEIGHTS_FP32 / probe["seconds"])


def test_rows_gather_by_hand():
    # 8 samples of 10 + 6 tokens, 12 B per token (int64 id, fp32 log-prob; no MoE: no replay record),
    # all-gathered over 4 ranks, then the sizes (8 B per rank)
    layout = RLLayout("colocated", 4, ParallelConfig(dp=4, micro_batch=2))
    rows = 8 * 16 * 12
    expected = (0.75 * rows / 1e9 + 3 * 100e-6) + (0.75 * 32 / 1e9 + 3 * 100e-6)
    priced = price_rl_step(_workload(), layout, _calibration())
    assert priced.phases.gather_s == pytest.approx(expected, rel=1e-9)
    assert price_rl_step(_workload(), RLLayout("colocated", 1, ParallelConfig(micro_batch=8)),
                         _calibration()).phases.gather_s == 0.0


def test_logprob_forward_on_the_generation_model():
    w = Workload(DENSE, SLOW_LINK, 16, 8, "fp32")
    eff = IDEAL
    # the layers as the prefill prices them (prefill = layers + one decode head; this cluster's head GEMM
    # and memory passes take ~0), then the log-softmax: 4 fp32 read+write passes over tokens × vocab
    prefill = generation_time(w, Replica(8, 1), 16, 1, eff).prefill_s
    softmax = SAMPLING_PASSES * 2 * 4.0 * 8 * 16 * 1000 / 1e18
    assert forward_time(w, Replica(8, 1), 16, eff) == pytest.approx(prefill + softmax, rel=1e-6)
    # in chunks of 2 rows: 4 chunks of the 2-row forward
    assert forward_time(w, Replica(8, 1), 16, eff, chunk_rows=2) == pytest.approx(4 * forward_time(w, Replica(2, 1), 16,
                                                                                                      eff))
    rl = RLWorkload(DENSE, SLOW_LINK, 4, 2, 10, 6, "fp32", logprob_forwards=2, logprob_on_generation=True)
    layout = RLLayout("colocated", 4, ParallelConfig(dp=4, micro_batch=2))
    priced = price_rl_step(rl, layout, _calibration())
    # the head on the 6 completion tokens of each 16-token sequence only
    assert priced.phases.logprob_s == pytest.approx(2 * forward_time(w, Replica(8, 1), 16, eff, chunk_rows=2,
                                                                     head_share=6 / 16), rel=1e-9)
    # on a CPU's eager stack each layer pass costs its 100 µs floor more (the device's own time is ~0 here):
    # 2 forwards × 4 chunks × 2 layers
    host = HostCosts(layer_forward_us=100.0, host_is_device=True)
    eager = price_rl_step(rl, layout, _calibration(), host)
    assert eager.phases.logprob_s - priced.phases.logprob_s == pytest.approx(2 * 4 * 2 * 100e-6, rel=1e-6)


def test_collective_probe_rows_and_sync_rates():
    from moetrain.train.profiler import profile_collectives, profile_sync_rates

    rows = profile_collectives(2, sizes=(4096,), repeats=1, calls=2)
    assert {(r["kind"], r["group"], r["bytes"]) for r in rows} == {
        ("all_reduce", 2, 4096), ("all_gather", 2, 4096), ("all_to_all", 2, 4096), ("send_recv", 2, 4096)}
    assert all(r["seconds"] > 0 for r in rows)
    fit = fit_link(rows)
    assert fit.latency_us >= 0 and fit.gbps > 0 and math.isfinite(fit.latency_us)
    with pytest.raises(UserError, match="even number"):
        profile_collectives(3)
    rates = profile_sync_rates(repeats=1, num_bytes=1 << 16)
    assert rates["copy_bytes_per_s"] > 0 and rates["crc_bytes_per_s"] > 0


def test_profile_comm_writes_a_cluster_with_the_fitted_link(tmp_path, capsys):
    from moetrain.cli import main
    from moetrain.config import load_cluster_config
    from moetrain.planner.calibration import load_calibration

    out, cluster_out = tmp_path / "cpu.yaml", tmp_path / "cpu-link.yaml"
    assert main(["profile", "--cluster", "cpu", "--device", "cpu", "--repeats", "1", "--threads", "1",
                 "--out", str(out), "--comm-ranks", "2", "--comm-out", str(cluster_out)]) == 0
    printed = capsys.readouterr().out
    assert "weight sync per core" in printed
    cluster = load_cluster_config(str(cluster_out))
    # how 2 ranks computing at once slow each other, measured and written into the cluster
    slowdown = float(re.search(r"2 ranks computing at once: ([0-9.]+)×", printed).group(1))
    assert cluster.shared_host_slowdown >= 1.0 and cluster.shared_host_slowdown == pytest.approx(slowdown, abs=0.006)
    assert cluster.name == "cpu-2-ranks" and cluster.intra_node_gbps > 0 and cluster.intra_node_latency_us >= 0
    # each collective kind probed at four sizes has its own link in the file
    assert set(cluster.collective_links) == {"all_reduce", "all_gather", "all_to_all"}
    assert load_calibration(out).for_device("cpu").bus_intra == 1.0
    assert main(["profile", "--comm-ranks", "3", "--out", str(out)]) == 2
    assert "even number" in capsys.readouterr().err


def test_training_calibration_prices_training_only():
    # a training step priced at half the GEMM rate (the caller's ``training``): the training phase is the
    # planner's step under it, the generation and transfers stay those of the step's calibration
    from dataclasses import replace

    from moetrain.planner.rl_step import training_prediction

    w, layout = _workload(), RLLayout("colocated", 4, ParallelConfig(tp=2, dp=2, micro_batch=2))
    slower = Calibration(replace(IDEAL, gemm_max=0.5), {})
    base = price_rl_step(w, layout, _calibration())
    mixed = price_rl_step(w, layout, _calibration(), training=training_prediction(w, layout, slower))
    assert mixed.phases.train_s == pytest.approx(float(training_prediction(w, layout, slower).step_time_s))
    assert mixed.phases.train_s > base.phases.train_s
    assert (mixed.phases.generate_s, mixed.phases.reshard_s) == (base.phases.generate_s, base.phases.reshard_s)


def test_expert_count_exchange_is_one_gather_per_moe_forward_by_hand():
    """This project's dispatch gathers every EP rank's int64 count per expert before each forward
    dispatch: a ring all-gather of ep × experts × 8 bytes per MoE layer and micro-batch, on top of the
    all-to-all (no overlap here, so all of it shows)."""
    from dataclasses import replace

    from moetrain.config import load_cluster_config, load_model_config
    from moetrain.planner.costmodel import evaluate
    from moetrain.planner.strategy import Strategies

    model = load_model_config("tiny-pangu")
    cluster = load_cluster_config("cpu").model_copy(update={"collective_links": {}})  # the plain in-node link
    eff = Calibration(Efficiency(), {}).for_device("cpu")
    workload = Workload(model, cluster, seq_len=64, global_batch=8, precision="fp32")
    ep2 = Strategies.from_parallel([ParallelConfig(dp=2, ep=2, micro_batch=2)])
    counted = replace(workload, expert_count_exchange=True)
    without, with_counts = evaluate(workload, ep2, eff), evaluate(counted, ep2, eff)
    ep, experts = 2, model.moe.num_experts
    gather = ((ep - 1) / ep * ep * experts * 8.0 / (cluster.intra_node_gbps * 1e9 * eff.bus_intra)
              + (ep - 1) * cluster.intra_node_latency_us * 1e-6)
    micro_batches = 8 // (2 * 2)
    moe_passes = model.num_moe_layers + model.num_mtp_layers  # the MTP module's block is an MoE layer too
    added = float(with_counts.step_time_s[0] - without.step_time_s[0])
    assert added == pytest.approx(micro_batches * moe_passes * gather, rel=1e-9)
    # one EP rank has nobody to gather from
    one = Strategies.from_parallel([ParallelConfig(micro_batch=2)])
    alone = float(evaluate(workload, one, eff).step_time_s[0])
    assert float(evaluate(counted, one, eff).step_time_s[0]) == pytest.approx(alone)
