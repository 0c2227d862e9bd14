"""``moetrain profile`` writes a calibration the simulator loads; model-shape variants keep their compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.config import load_model_config
from moetrain.costs.params import count_params
from moetrain.planner.calibration import load_calibration
from moetrain.planner.model_search import _reshape


@pytest.mark.slow
def test_profile_writes_a_loadable_calibration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cpu.yaml"
    assert main(["profile", "--cluster", "cpu", "--device", "cpu", "--repeats", "1", "--threads", "1",
                 "--out", str(out)]) == 0
    measured = load_calibration(out).for_device("cpu")
    assert measured.gemm_max > 0 and measured.attention > 0 and measured.memory > 0
    # the runtime model's host time at a tiny batch, which on a CPU adds to every layer pass
    assert measured.host_layer_us > 0 and measured.host_optimizer_ms > 0 and measured.host_probe_tokens == 16
    capsys.readouterr()
    assert main(["simulate", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "1", "--seq-len", "128",
                 "--global-batch", "16", "--micro-batch", "4", "--dtype", "fp32", "--calibration", str(out),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] > 0


def test_finer_experts_keep_activated_parameters() -> None:
    base = load_model_config("pangu-ultra-moe-718b")
    finer = _reshape(base, 512, base.hidden_size, base.num_layers)
    assert finer is not None and finer.moe is not None
    assert finer.moe.router.top_k == 16 and finer.moe.expert_ffn_hidden == 1024
    # Routed compute is kept exactly; the shared expert narrows with the experts (within 5 % overall).
    assert count_params(finer).active_experts == count_params(base).active_experts
    assert count_params(finer).active == pytest.approx(count_params(base).active, rel=0.05)


def test_host_probe_times_the_runtime_model() -> None:
    import torch

    from moetrain.train.profiler import _host_issue_times

    torch.manual_seed(0)
    times = _host_issue_times(load_model_config("tiny-pangu"), "cpu", repeats=1)
    assert times is not None
    assert 0 < times["forward_s"] < times["forward_backward_s"]
    assert times["optimizer_s"] > 0
    # Too large to build beside a training run: no probe, so the profile leaves the host terms at zero.
    assert _host_issue_times(load_model_config("pangu-ultra-moe-718b"), "cpu", repeats=1) is None


def test_host_floor_bounds_each_layer_pass_and_the_optimizer() -> None:
    from dataclasses import replace

    import numpy as np

    from moetrain.config import ParallelConfig, load_cluster_config
    from moetrain.planner.costmodel import evaluate
    from moetrain.planner.strategy import Strategies
    from moetrain.planner.workload import Workload

    model = load_model_config("tiny-pangu")
    workload = Workload(model, load_cluster_config("h100-sxm-80gb"), seq_len=128, global_batch=16)
    strategy = Strategies.from_parallel([ParallelConfig(micro_batch=4)])
    device_bound = load_calibration().for_device("h100-sxm-80gb")
    base = evaluate(workload, strategy, device_bound)
    assert float(base.host_wait_s[0]) == 0.0
    # A host that needs 10 ms per layer pass and 3 ms per optimizer step sets the step: these layers'
    # device work is far below that, so each further millisecond per pass adds one per layer and micro-batch.
    host_bound = replace(device_bound, host_layer_us=10_000.0, host_optimizer_ms=3.0)
    slower_host = replace(host_bound, host_layer_us=11_000.0)
    out, slower = evaluate(workload, strategy, host_bound), evaluate(workload, strategy, slower_host)
    num_micro = 16 // 4
    layer_passes = model.num_layers + model.num_mtp_layers  # the MTP module's block is a layer pass too
    np.testing.assert_allclose(slower.step_time_s - out.step_time_s, num_micro * layer_passes * 1e-3,
                               rtol=1e-9)
    assert float(out.optimizer_s[0]) == pytest.approx(3e-3)
    # The wait is everything the host adds to the device-bound step.
    assert float(out.host_wait_s[0]) == pytest.approx(float(out.step_time_s[0] - base.step_time_s[0]),
                                                         rel=1e-9)


def test_on_a_cpu_the_host_time_adds_beyond_the_probe_work() -> None:
    """Where the host is the device (a CPU), the measured host time of a layer pass is not a floor: what it
    has beyond the device work priced at its own tokens adds to every pass, however large the pass."""
    from dataclasses import replace

    import numpy as np

    from moetrain.config import ParallelConfig, load_cluster_config
    from moetrain.planner.costmodel import evaluate
    from moetrain.planner.strategy import Strategies
    from moetrain.planner.workload import Workload

    model = load_model_config("tiny-pangu")
    cpu = load_cluster_config("cpu")
    assert cpu.host_is_device and not load_cluster_config("h100-sxm-80gb").host_is_device
    # seq 512: each pass's device work is far above 10 ms, where a GPU's floor would add nothing
    workload = Workload(model, cpu, seq_len=512, global_batch=16, precision="fp32")
    strategy = Strategies.from_parallel([ParallelConfig(micro_batch=4)])
    device_only = replace(load_calibration().for_device("cpu"), host_layer_us=0.0, host_wide_layer_us=0.0,
                          host_optimizer_ms=0.0)
    base = evaluate(workload, strategy, device_only)
    measured = replace(device_only, host_layer_us=10_000.0, host_probe_tokens=16.0)
    slower = replace(measured, host_layer_us=11_000.0)
    out, slow = evaluate(workload, strategy, measured), evaluate(workload, strategy, slower)
    num_micro, layer_passes = 16 // 4, model.num_layers + model.num_mtp_layers
    np.testing.assert_allclose(slow.step_time_s - out.step_time_s, num_micro * layer_passes * 1e-3, rtol=1e-9)
    assert float(out.step_time_s[0]) > float(base.step_time_s[0])
    assert float(out.host_wait_s[0]) == pytest.approx(float(out.step_time_s[0] - base.step_time_s[0]), rel=1e-9)
    # A host time below the device work priced at the probe's 16 tokens (the MoE pass alone is priced
    # hundreds of microseconds) adds nothing: the measurement held only that work.
    below = replace(device_only, host_layer_us=1.0)
    assert float(evaluate(workload, strategy, below).step_time_s[0]) == pytest.approx(float(base.step_time_s[0]))


def test_on_a_cpu_the_host_excess_is_the_line_through_both_probes() -> None:
    """With a second probe on a wide micro-batch, the excess of a pass is the line through the two probes'
    excesses, taken at the pass's tokens: a wide probe 1 ms slower adds (2048 − 16) / (512 − 16) ms to
    every pass of 4 × 512 tokens, and nothing more to a pass of the narrow probe's own 16 tokens."""
    from dataclasses import replace

    import numpy as np

    from moetrain.config import ParallelConfig, load_cluster_config
    from moetrain.planner.costmodel import evaluate
    from moetrain.planner.strategy import Strategies
    from moetrain.planner.workload import Workload

    model, cpu = load_model_config("tiny-pangu"), load_cluster_config("cpu")
    probes = replace(load_calibration().for_device("cpu"), host_layer_us=10_000.0, host_probe_tokens=16.0,
                     host_wide_layer_us=40_000.0, host_wide_batch=4.0, host_wide_seq=128.0)
    slower = replace(probes, host_wide_layer_us=41_000.0)
    layer_passes = model.num_layers + model.num_mtp_layers
    wide = Workload(model, cpu, seq_len=512, global_batch=16, precision="fp32")
    strategy = Strategies.from_parallel([ParallelConfig(micro_batch=4)])
    gained = evaluate(wide, strategy, slower).step_time_s - evaluate(wide, strategy, probes).step_time_s
    np.testing.assert_allclose(gained, 4 * layer_passes * 1e-3 * (2048 - 16) / (512 - 16), rtol=1e-9)
    narrow = Workload(model, cpu, seq_len=16, global_batch=4, precision="fp32")
    one = Strategies.from_parallel([ParallelConfig(micro_batch=1)])
    unchanged = evaluate(narrow, one, slower).step_time_s - evaluate(narrow, one, probes).step_time_s
    np.testing.assert_allclose(unchanged, 0.0, atol=1e-12)


def test_the_shipped_fit_carries_the_cpu_profile_in_every_fit() -> None:
    """The published runs hold no CPU: the shipped CPU profile is the ``cpu`` architecture of the default
    calibration and of each held-out fit, and a GPU's efficiencies do not change with it."""
    import yaml

    from moetrain.planner.calibration import calibration_from_dict

    shipped = load_calibration()
    cpu = shipped.for_device("cpu")
    assert cpu.host_layer_us > 0 and cpu.host_wide_layer_us > cpu.host_layer_us and cpu.bus_intra == 1.0
    profiled = shipped.per_arch["cpu"]
    assert {"gemm_max", "memory", "host_wide_layer_us"} <= set(profiled) and shipped.held_out_fits
    for fit in shipped.held_out_fits.values():  # the profiled values, whatever source a fit leaves out
        assert {k: getattr(fit.for_device("cpu"), k) for k in profiled} == {k: getattr(cpu, k) for k in profiled}
    text = (Path(__file__).parents[2] / "src/moetrain/planner/calibration_default.yaml").read_text()
    fit_alone = calibration_from_dict(yaml.safe_load(text), "calibration_default.yaml")
    assert shipped.for_device("H100") == fit_alone.for_device("H100")
