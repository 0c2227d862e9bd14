"""The memory policy in compiled layers: checkpoint wrappers, and the compiler recomputes what they wrap instead
of keeping it; whole-layer swap through the saved-tensor hooks open around the compiled call. Gradients equal
the eager model's (Inductor reorders fp32 sums inside its fused kernels: rel 1e-4, measured about 1e-6), and
each recompute keeps fewer bytes than the compiled model without a policy.

What a compiled layer keeps is decided before Inductor generates a kernel, by AOTAutograd's min-cut
partitioner over the decomposed graph; the ``aot_eager_decomp_partition`` backend runs that same partition
without Inductor's code generation (seconds, not a minute per policy on 2 cores), so the byte counts of every
policy are taken there, and one policy runs under Inductor to show it keeps the same bytes and trains like
eager (measured: 19.40, 14.24 and 3.44 MB under both backends)."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from moetrain.config import load_model_config
from moetrain.costs.activations import SELECTIVE_OPTIONS
from moetrain.distributed.parallelize import apply_compile
from moetrain.memory.measure import measure_saved_bytes
from moetrain.memory.policy import DeviceSpeed, MemoryPlan, num_blocks
from moetrain.memory.runtime import apply_memory_policy
from moetrain.models import build_model

SEQ, BATCH = 64, 2


PARTITION_ONLY = "aot_eager_decomp_partition"
"""Inductor's decompositions and partitioner, eager kernels."""


def _saved_bytes_and_grads(options: frozenset[str], backend: str | None) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd keeps for backward (``measure_saved_bytes``: saved-tensor hooks, which see what a
    compiled layer keeps too) and the gradients; ``backend`` None: eager layers."""
    cfg = load_model_config("tiny-pangu")
    torch._dynamo.reset()  # a fresh compilation per model: guards on one model must not fall back to eager
    model = build_model(cfg, seed=0)
    if options:
        apply_memory_policy(model, MemoryPlan.uniform(options, num_blocks(cfg)), compiled=backend is not None)
    if backend is not None:
        apply_compile(model, backend=backend)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    kept = measure_saved_bytes(model, ids, ids)
    return kept, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_compiled_recompute_keeps_less_and_trains_like_eager():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, eager = _saved_bytes_and_grads(frozenset(), backend=None)
        plain, plain_grads = _saved_bytes_and_grads(frozenset(), PARTITION_ONLY)
        selective, selective_grads = _saved_bytes_and_grads(frozenset(SELECTIVE_OPTIONS), PARTITION_ONLY)
        layer, layer_grads = _saved_bytes_and_grads(frozenset({"layer"}), PARTITION_ONLY)
        inductor, inductor_grads = _saved_bytes_and_grads(frozenset(SELECTIVE_OPTIONS), "inductor")
    finally:
        torch.set_num_threads(threads)
    assert inductor == selective
    for grads in (plain_grads, selective_grads, layer_grads, inductor_grads):
        assert grads.keys() == eager.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, eager[name], rtol=1e-4, atol=1e-6, msg=name)
    assert selective < 0.85 * plain  # measured 0.75 at seq 128
    assert layer < 0.25 * selective  # only the layer inputs and the routing decisions remain


def test_compiled_layers_swap_whole_and_train_like_eager():
    """``swap_layer`` around a compiled layer: every tensor the compiled function saves (weights excepted)
    is copied out and its device storage freed before the forward ends; backward brings each back once
    and leaves no host copy behind; gradients equal the eager model's (rel 1e-4, as above)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, eager = _saved_bytes_and_grads(frozenset(), backend=None)
        plain, _ = _saved_bytes_and_grads(frozenset(), PARTITION_ONLY)
        cfg = load_model_config("tiny-pangu")
        torch._dynamo.reset()
        model = build_model(cfg, seed=0)
        handle = apply_memory_policy(model, MemoryPlan.uniform({"swap_layer"}, num_blocks(cfg)), compiled=True)
        apply_compile(model, backend=PARTITION_ONLY)
        copied: list[tuple[StorageWeakRef, int]] = []
        copy_out = handle.manager._copy_out

        def spy(tensor: torch.Tensor):
            copied.append((StorageWeakRef(tensor.untyped_storage()), tensor.untyped_storage().nbytes()))
            return copy_out(tensor)

        handle.manager._copy_out = spy
        ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        loss = model(ids, labels=ids).loss
        held = sorted(handle.manager.groups)
        still_on_device = [nbytes for ref, nbytes in copied if not ref.expired()]
        loss.backward()
    finally:
        torch.set_num_threads(threads)
    assert held == list(range(num_blocks(cfg)))  # every layer, MTP's included, swapped its own
    assert still_on_device == []
    assert sum(nbytes for _, nbytes in copied) > 0.8 * plain  # measured 0.85: embedding and head stay
    assert handle.manager.groups == {}
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == eager.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager[name], rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_layers_refuse_what_they_cannot_run():
    cfg = load_model_config("tiny-pangu")
    model = build_model(cfg, device="meta")
    swap = MemoryPlan.uniform({"swap_moe", "norm"}, num_blocks(cfg))
    with pytest.raises(ValueError, match=r"^\['swap_moe'\] cannot run in compiled layers; choose from "):
        apply_memory_policy(model, swap, compiled=True)


def test_the_policy_chooses_among_what_compiled_layers_run():
    from moetrain.config.run import MemoryOptions
    from moetrain.memory.options import activation_shape, choose_plan, excluded_options, nominal_speed

    cfg = load_model_config("tiny-pangu")
    auto = MemoryOptions(policy="auto", budget_fraction=0.2)
    assert excluded_options(False, True) == frozenset()
    assert excluded_options(True, False) == {"swap_attention", "swap_moe"}
    assert excluded_options(True, True) == {"swap_attention", "swap_moe", "permute"}
    shape, speed = activation_shape(cfg, 256, 2, 2.0, "cuda"), nominal_speed("cuda")
    compiled = choose_plan(shape, auto, speed, excluded=excluded_options(True, True))
    chosen = set().union(*compiled.plan.layer_options)
    assert chosen and not chosen & {"swap_attention", "swap_moe", "permute"}
    selective = choose_plan(shape, MemoryOptions(policy="selective"), speed, excluded=excluded_options(True, True))
    assert set().union(*selective.plan.layer_options) == set(SELECTIVE_OPTIONS) - {"permute"}
    # a host link that keeps up with the compute: compiled layers swap, whole
    fast = DeviceSpeed(flops_per_s=1e12, bytes_per_s=1e12, host_link_bytes_per_s=1e12)
    swapped = choose_plan(activation_shape(cfg, 64, 2, 2.0, "cuda"), MemoryOptions(policy="auto", budget_fraction=0.5),
                          fast, excluded=excluded_options(True, False))
    assert swapped.fits and "swap_layer" in set().union(*swapped.plan.layer_options)
