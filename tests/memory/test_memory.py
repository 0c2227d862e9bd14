"""Selective recompute and swap: gradients unchanged, analytic bytes = measured bytes, budgeted policy."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch

from moetrain.cli import main
from moetrain.config import load_model_config
from moetrain.costs.activations import (
    ALL_OPTIONS,
    LAYER_PARTS,
    SELECTIVE_OPTIONS,
    activation_bytes_per_layer,
    model_activation_bytes,
)
from moetrain.costs.flops import layer_forward_flops
from moetrain.memory import ActivationShape, DeviceSpeed, MemoryPlan, choose_memory_plan
from moetrain.memory.measure import measure_activations
from moetrain.memory.options import uses_flash_attention
from moetrain.memory.policy import _Costs, num_blocks
from moetrain.memory.runtime import apply_memory_policy
from moetrain.models import build_model

SEQ, BATCH = 32, 2
CPU_SPEED = DeviceSpeed(flops_per_s=5e10, bytes_per_s=1e10)


@pytest.fixture(autouse=True)
def deterministic():
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    yield
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(threads)


def _ids(cfg, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (BATCH, seq), generator=torch.Generator().manual_seed(0))


@functools.cache
def _run(name: str, options=(), seq: int = SEQ):
    cfg = load_model_config(name)
    model = build_model(cfg, seed=0)
    if options:
        apply_memory_policy(model, MemoryPlan.uniform(options, num_blocks(cfg)))
    ids = _ids(cfg, seq)
    measured = measure_activations(model, ids, ids)
    return measured, {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("options", [(o,) for o in ALL_OPTIONS] + [
    tuple(sorted(SELECTIVE_OPTIONS)),
    ("norm", "attention", "activation", "permute", "router", "swap_moe"),
    ("norm", "swap_attention", "swap_moe", "activation", "permute"),
])
def test_gradients_equal_plain_model(options):
    _, plain = _run("tiny-pangu")
    _, grads = _run("tiny-pangu", options)
    assert plain.keys() == grads.keys()
    mismatched = [k for k in plain if not torch.equal(plain[k], grads[k])]
    assert mismatched == []


def test_gqa_options_keep_gradients():
    _, plain = _run("tiny-qwen3")
    _, grads = _run("tiny-qwen3", ("norm", "activation", "permute", "router", "swap_attention"))
    assert all(torch.equal(plain[k], grads[k]) for k in plain)


@pytest.mark.parametrize("name", ["tiny-pangu", "tiny-qwen3", "tiny-mixtral"])
@pytest.mark.parametrize("seq", [32, 64])
def test_analytic_bytes_match_measured(name, seq):
    measured, _ = _run(name, seq=seq)
    cfg = load_model_config(name)
    predicted = model_activation_bytes(ActivationShape(cfg, seq, BATCH, 4.0, uses_flash_attention(cfg, "cpu")))
    assert abs(predicted["total"] / measured.total_bytes - 1) < 0.05
    assert abs(predicted["total"] - measured.total_bytes) < 64  # in fact exact up to a few scalars


@pytest.mark.parametrize("options", [("norm",), ("attention",), ("layer",), tuple(sorted(SELECTIVE_OPTIONS))])
def test_analytic_bytes_match_measured_with_options(options):
    measured, _ = _run("tiny-pangu", options)
    cfg = load_model_config("tiny-pangu")
    predicted = model_activation_bytes(ActivationShape(cfg, SEQ, BATCH, 4.0, False),
                                       [frozenset(options)] * num_blocks(cfg))
    assert abs(predicted["total"] / measured.total_bytes - 1) < 0.05


def test_options_save_memory():
    baseline, _ = _run("tiny-pangu")
    for option in ("norm", "mla_up", "activation", "permute", "router", "attention", "layer"):
        measured, _ = _run("tiny-pangu", (option,))
        assert measured.total_bytes < baseline.total_bytes, option


@pytest.mark.slow
def test_auto_meets_budget_measured_and_beats_full():
    cfg = load_model_config("tiny-pangu")
    shape = ActivationShape(cfg, 64, BATCH, dtype_bytes=4.0, flash=False)
    auto = choose_memory_plan(shape, "auto", None, CPU_SPEED)
    assert auto.plan.summary() == {}  # no budget: nothing to do
    budget = 0.3 * auto.baseline_bytes
    auto = choose_memory_plan(shape, "auto", budget, CPU_SPEED)
    full = choose_memory_plan(shape, "full", budget, CPU_SPEED)
    assert auto.fits and full.fits and auto.activation_bytes <= budget
    assert auto.added_time_s < full.added_time_s
    assert not any(o.startswith("swap") for o in auto.options)  # CPU: host memory is device memory
    baseline, _ = _run("tiny-pangu", seq=64)
    model = build_model(cfg, seed=0)
    apply_memory_policy(model, auto.plan)
    ids = _ids(cfg, 64)
    measured = measure_activations(model, ids, ids)
    assert measured.total_bytes <= 0.3 * baseline.total_bytes * 1.01


def test_greedy_drops_options_no_longer_needed():
    cfg = load_model_config("tiny-pangu")
    shape = ActivationShape(cfg, 64, BATCH, dtype_bytes=4.0, flash=False)
    base = choose_memory_plan(shape, "none", None, CPU_SPEED).baseline_bytes
    result = choose_memory_plan(shape, "auto", 0.15 * base, CPU_SPEED)
    # layers recomputed whole carry no other option
    assert all(opts == {"layer"} for opts in result.plan.layer_options if "layer" in opts)


def test_gpu_speed_offers_swap():
    cfg = load_model_config("tiny-pangu")
    speed = DeviceSpeed(flops_per_s=1e12, bytes_per_s=1e12, host_link_bytes_per_s=1e12)
    shape = ActivationShape(cfg, 64, BATCH, dtype_bytes=2.0, flash=True)
    base = choose_memory_plan(shape, "none", None, speed).baseline_bytes
    result = choose_memory_plan(shape, "auto", 0.5 * base, speed)
    assert result.fits and any(o.startswith("swap") for o in result.options)


def test_the_swap_options_of_a_layer_share_its_host_link():
    """A layer's swapped tensors cross one link: two swaps that each hide under the layer's compute alone
    can together take longer than it, and then cost the difference."""
    cfg = load_model_config("tiny-pangu")
    shape = ActivationShape(cfg, 64, BATCH, dtype_bytes=2.0, flash=True)
    flops_per_s = 1e12
    forward_s = layer_forward_flops(cfg, 64, True, causal=True).total * 64 * BATCH / flops_per_s
    swapped = {o: activation_bytes_per_layer(shape, True, (o,), include_swapped=True)["swapped"]
               for o in ("swap_attention", "swap_moe")}
    both = activation_bytes_per_layer(shape, True, tuple(swapped), include_swapped=True)["swapped"]
    assert both == pytest.approx(sum(swapped.values()))
    # a link that moves the larger swap in 0.9 of the layer's forward: each alone hides, both do not
    link = max(swapped.values()) / (0.9 * forward_s)
    costs = _Costs(shape, DeviceSpeed(flops_per_s=flops_per_s, bytes_per_s=1e12, host_link_bytes_per_s=link))
    assert costs.set_s(True, frozenset({"swap_attention"})) == 0.0
    assert costs.set_s(True, frozenset({"swap_moe"})) == 0.0
    transfer = both / link
    expected = max(0.0, transfer - forward_s) + max(0.0, transfer - 2 * forward_s)
    assert expected > 0
    assert costs.set_s(True, frozenset(swapped)) == pytest.approx(expected)


def test_swap_layer_moves_every_byte_of_the_layer_to_host():
    cfg = load_model_config("tiny-pangu")
    shape = ActivationShape(cfg, 64, BATCH, dtype_bytes=2.0, flash=True)
    for moe in (False, True):
        for options in ((), ("norm", "activation"), ("attention",)):
            kept = activation_bytes_per_layer(shape, moe, options, include_swapped=True)
            swapped = activation_bytes_per_layer(shape, moe, options + ("swap_layer",), include_swapped=True)
            assert sum(v for k, v in swapped.items() if k in LAYER_PARTS) == 0
            assert swapped["core_attention"] == 0
            assert swapped["swapped"] == pytest.approx(sum(v for k, v in kept.items() if k in LAYER_PARTS))
    # a layer recomputed whole keeps only its input, on the device
    whole = activation_bytes_per_layer(shape, True, ("layer", "swap_layer"), include_swapped=True)
    assert whole == activation_bytes_per_layer(shape, True, ("layer",), include_swapped=True)


def test_swap_layer_leaves_no_floating_point_tensor_of_a_layer_on_the_device():
    """Eager layers: every float tensor a decoder layer saves is copied out (CPU: min size 0). What stays
    is integer (routing indices), or saved outside the layers: the outputs of the last decoder layer and
    of the MTP layer, which the final norms read."""
    measured, _ = _run("tiny-pangu", ("swap_layer",))
    baseline, _ = _run("tiny-pangu")
    cfg = load_model_config("tiny-pangu")
    floats = {(layer, part) for layer, part, _, _, dtype, _ in measured.details
              if layer and not dtype.startswith("int")}
    assert floats == {(f"layers.{cfg.num_layers - 1}", "residual"), ("mtp.0.layer", "residual")}
    assert measured.total_bytes < 0.2 * baseline.total_bytes


def test_policy_is_torch_free():
    code = "import sys, moetrain.memory.policy, moetrain.memory; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_remove_restores_plain_model():
    cfg = load_model_config("tiny-pangu")
    model = build_model(cfg, seed=0)
    handle = apply_memory_policy(model, MemoryPlan.uniform(ALL_OPTIONS[:-1], num_blocks(cfg)))
    handle.remove()
    assert not any("forward" in vars(m) for m in model.modules())


def test_cli_json(capsys):
    assert main(["memory", "--model", "tiny-pangu", "--policy", "auto", "--budget-fraction", "0.3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("baseline_activation_bytes", "activation_bytes", "step_time_s", "baseline_step_time_s", "options"):
        assert key in report
    assert report["activation_bytes"] <= 0.3 * report["baseline_activation_bytes"]


def test_cli_auto_needs_budget(capsys):
    assert main(["memory", "--model", "tiny-pangu", "--policy", "auto"]) == 2
    assert "needs a budget" in capsys.readouterr().err


def test_swapped_tensors_are_released_after_backward():
    """Each step's host copies are dropped once backward has read them back: nothing piles up across
    steps (a pile-up kept every step's pinned buffers alive and made each new step allocate afresh)."""
    cfg = load_model_config("tiny-pangu")
    model = build_model(cfg, seed=0)
    handle = apply_memory_policy(model, MemoryPlan.uniform(("swap_attention", "swap_moe"), num_blocks(cfg)))
    ids = _ids(cfg)
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        assert handle.manager.groups == {}
    handle.remove()


def test_parameters_are_not_swapped():
    """A weight saved for backward stays on the device anyway; copying it out would free nothing."""
    cfg = load_model_config("tiny-pangu")
    model = build_model(cfg, seed=0)
    handle = apply_memory_policy(model, MemoryPlan.uniform(("swap_attention", "swap_moe"), num_blocks(cfg)))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    swapped = []
    original = handle.manager._copy_out
    handle.manager._copy_out = lambda tensor: swapped.append(tensor.untyped_storage().data_ptr()) or original(tensor)
    ids = _ids(cfg)
    model(ids, labels=ids).loss.backward()
    handle.remove()
    assert swapped and not params.intersection(swapped)
