"""From a run's memory options (policy and budget) to the recompute/swap plan of the layers a rank holds.

Torch-free: ``moetrain memory`` and the planner choose plans here; the runtime installs them with
``moetrain.memory.runtime.apply_memory_policy``.
"""

from __future__ import annotations

from moetrain.config.model import ModelConfig
from moetrain.config.run import MemoryOptions
from moetrain.memory.policy import ActivationShape, DeviceSpeed, MemoryPlan, PolicyResult, choose_memory_plan

GIB = 1024**3

NOMINAL_SPEED = {
    "cuda": DeviceSpeed(flops_per_s=4e14, bytes_per_s=2e12, host_link_bytes_per_s=2.5e10),
    "cpu": DeviceSpeed(flops_per_s=5e10, bytes_per_s=1e10),
}
"""A device's nominal speed: the greedy ranking of options only needs their relative costs."""


def uses_flash_attention(model_cfg: ModelConfig, device_type: str) -> bool:
    """Fused attention keeps no S×S probabilities: always on CUDA; on CPU torch uses its fused kernel
    only when the QK and V head dims agree (else the math fallback)."""
    return device_type == "cuda" or model_cfg.attention.qk_head_dim == model_cfg.attention.v_head_dim


def budget_bytes(options: MemoryOptions, baseline_bytes: float) -> float | None:
    """The activation budget in bytes per micro-batch (None: no budget)."""
    if options.budget_fraction is not None:
        return options.budget_fraction * baseline_bytes
    if options.budget_gib is not None:
        return options.budget_gib * GIB
    return None


COMPILED_EXCLUDED = frozenset({"swap_attention", "swap_moe"})
"""Options compiled layers do not run (``moetrain.memory.runtime.COMPILED_OPTIONS``): a compiled layer
saves its tensors at its boundary, where none says which block made it, so it swaps whole (``swap_layer``)."""


def excluded_options(compiled: bool, expert_parallel: bool) -> frozenset[str]:
    """What the runtime cannot install: compiled layers swap only whole layers, and recompute the
    permutation only where it is local (under expert parallelism the tokens come from other ranks)."""
    if not compiled:
        return frozenset()
    return COMPILED_EXCLUDED | ({"permute"} if expert_parallel else frozenset())


def activation_shape(model_cfg: ModelConfig, seq_len: int, micro_batch: int, dtype_bytes: float,
                     device_type: str) -> ActivationShape:
    """One micro-batch's activations on a ``device_type`` device (its attention kernel decides ``flash``)."""
    return ActivationShape(model_cfg, seq_len, micro_batch, dtype_bytes, uses_flash_attention(model_cfg, device_type))


def nominal_speed(device_type: str) -> DeviceSpeed:
    return NOMINAL_SPEED["cuda" if device_type == "cuda" else "cpu"]


def choose_plan(shape: ActivationShape, options: MemoryOptions, speed: DeviceSpeed,
                excluded: frozenset[str] = frozenset()) -> PolicyResult:
    """The plan of the whole model (decoder layers, then MTP layers) that the options ask for, from the
    options the runtime can install (``excluded_options``)."""
    probe = choose_memory_plan(shape, "none", None, speed)
    return choose_memory_plan(shape, options.policy, budget_bytes(options, probe.baseline_bytes), speed, excluded)


def held_layers_plan(plan: MemoryPlan, held: list[int]) -> MemoryPlan:
    """The options of the layers a pipeline rank holds (``held``: indices into the whole model's plan)."""
    return MemoryPlan(tuple(plan.layer_options[i] for i in held))
