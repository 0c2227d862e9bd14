"""The RL step's rates measured on a CPU (``moetrain.rl.rates``): each process's share of the cores scales
every rate alike, the sync's and the link's rates come from their probes, and the generation probes time
the runtime's own model and engine."""

from __future__ import annotations

import pytest

from moetrain.config import ParallelConfig, load_cluster_config
from moetrain.planner.calibration import load_calibration
from moetrain.planner.generation import HostCosts
from moetrain.planner.rl_step import RLLayout, RLWorkload, training_prediction
from moetrain.rl.rates import (
    host_costs,
    link_fit,
    policy_model,
    shared_cores,
    shared_sync,
    speed_reference,
    threads_capacity,
    training_calibration,
    with_link,
)

HOST = HostCosts(layer_forward_us=100.0, sample_ns_per_logit=2.0, host_is_device=True, engine_step_us=50.0,
                 engine_row_us=5.0)


def test_shared_cores_scale_every_rate_alike() -> None:
    calibration = load_calibration()
    assert shared_cores(calibration, HOST, 1.0) == (calibration, HOST)  # a whole core: unchanged
    scaled, host = shared_cores(calibration, HOST, 2.0)
    one, half = calibration.for_device("cpu"), scaled.for_device("cpu")
    assert half.gemm_max == pytest.approx(one.gemm_max / 2) and half.memory == pytest.approx(one.memory / 2)
    assert half.host_layer_us == pytest.approx(one.host_layer_us * 2)
    assert half.bus_intra == one.bus_intra  # the link is not the cores'
    assert (host.layer_forward_us, host.engine_step_us, host.engine_row_us) == (200.0, 100.0, 10.0)


def test_sync_and_link_rates_from_their_probes() -> None:
    rates = {"copy_bytes_per_s": 4e9, "crc_bytes_per_s": 2e9, "whole_sync_8_layers": {"host_bytes_per_s": 1e9}}
    sync = shared_sync(rates, 2.0, 8)
    assert (sync.copy_bytes_per_s, sync.crc_bytes_per_s, sync.host_bytes_per_s) == (2e9, 1e9, 5e8)
    assert shared_sync(rates, 0.5, 4).host_bytes_per_s is None  # not measured at 4 layers; no faster than a core
    assert shared_sync(rates, 0.5, 4).copy_bytes_per_s == 4e9
    # a link of 10 µs per message step and 1 GB/s: the fit finds it, and records its error on the sends
    collectives = [{"kind": kind, "group": 2, "bytes": size, "seconds": 10e-6 + size / 1e9}
                   for kind in ("all_reduce", "all_gather", "all_to_all", "send_recv")
                   for size in (4 << 10, 64 << 10, 512 << 10, 4 << 20)]
    fit = link_fit(collectives)
    assert fit.gbps > 0 and fit.latency_us >= 0 and any("send_recv" in key for key in fit.residual_pct)
    assert with_link(load_calibration()).for_device("cpu").bus_intra == 1.0


def test_training_calibration_shares_the_paced_cores_among_busy_ranks() -> None:
    calibration = load_calibration()
    workload = RLWorkload(policy_model(8), load_cluster_config("cpu"), 8, 4, 10, 6, "fp32")
    layout = RLLayout("colocated", 4, ParallelConfig(dp=2, ep=2, micro_batch=16))
    train, busy = training_calibration(workload, layout, calibration, HOST, paced_capacity=2.0)
    assert busy == pytest.approx(4.0)  # no pipeline: every rank computes
    assert train.for_device("cpu").gemm_max == pytest.approx(calibration.for_device("cpu").gemm_max / 2)
    piped = RLLayout("colocated", 4, ParallelConfig(pp=2, dp=2, ep=2, micro_batch=8))
    _, busy = training_calibration(workload, piped, calibration, HOST, paced_capacity=2.0)
    bubble = float(training_prediction(workload, piped, calibration).bubble_fraction)
    assert bubble > 0 and busy == pytest.approx(4 * (1 - bubble))


def test_generation_probes_time_the_runtime_model_and_engine() -> None:
    host = host_costs(policy_model(1), repeats=1)
    assert host.host_is_device and host.layer_forward_us > 0 and host.sample_ns_per_logit > 0
    assert host.engine_step_us >= 0 and host.engine_row_us >= 0
    assert speed_reference() > 0
    assert 0 < threads_capacity((1, 1), tries=1) <= 2.5


@pytest.mark.slow
def test_profile_rl_out_writes_rates_simulate_reads(tmp_path, capsys) -> None:
    from moetrain.cli import main
    from moetrain.planner.rl_rates import load_rl_rates

    out, rates = tmp_path / "cpu.yaml", tmp_path / "rl.yaml"
    assert main(["profile", "--cluster", "cpu", "--device", "cpu", "--repeats", "1", "--threads", "1",
                 "--model", "tiny-mixtral", "--out", str(out), "--rl-out", str(rates)]) == 0
    assert "RL host rates" in capsys.readouterr().out
    measured = load_rl_rates(rates)
    assert measured.host.host_is_device and measured.host.layer_forward_us > 0
    assert measured.sync.host_bytes_per_s > 0 and measured.sync.copy_bytes_per_s > 0
    assert main(["simulate", "--rl", "--model", "tiny-mixtral", "--cluster", "cpu", "--devices", "2",
                 "--prompt-len", "10", "--response-len", "6", "--dtype", "fp32", "--calibration", str(out),
                 "--rl-rates", str(rates), "--json"]) == 0
