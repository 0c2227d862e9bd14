"""Choosing memory options under a budget (torch-free: the planner imports it).

Each option saves bytes (``moetrain.costs.activations``) and costs time: recompute costs its
forward FLOPs at the measured FLOP rate, or its bytes at the measured memory bandwidth for
element-wise parts (norms, activation, permutation); swap costs only the part of its host transfer
that does not hide under the layer's compute (forward for the copy out, backward for the copy in), one
transfer per layer for all it swaps.

``auto`` is the greedy of the reference system's adaptive policy (Pangu Ultra MoE system report,
"Selective R/S"): rank (option, layer kind) by bytes saved per second added, apply the best to the
layers of that kind one at a time until the budget holds, repeat; then drop every option whose
removal keeps the budget ("increase, then decrease"). ``full`` recomputes whole layers, as few as
the budget needs (Megatron's ``recompute_num_layers``); ``selective`` applies every fine-grained
recompute option everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from moetrain.config.model import MLAConfig, ModelConfig
from moetrain.costs.activations import (
    ALL_OPTIONS,
    RECOMPUTE_OPTIONS,
    SELECTIVE_OPTIONS,
    SWAP_OPTIONS,
    ActivationShape,
    activation_bytes_per_layer,
    model_activation_bytes,
)
from moetrain.costs.flops import attention_core_flops, attention_projection_flops, layer_forward_flops

PolicyName = Literal["none", "full", "selective", "auto"]
POLICIES: tuple[str, ...] = ("none", "full", "selective", "auto")


@dataclass(frozen=True)
class MemoryPlan:
    """One option set per decoder layer (``model.layers`` then MTP layers)."""

    layer_options: tuple[frozenset[str], ...]

    @classmethod
    def uniform(cls, options, num_blocks: int) -> MemoryPlan:
        return cls(tuple(frozenset(options) for _ in range(num_blocks)))

    def summary(self) -> dict[str, int]:
        """Option → number of layers it is applied to."""
        counts: dict[str, int] = {}
        for options in self.layer_options:
            for name in options:
                counts[name] = counts.get(name, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: ALL_OPTIONS.index(item[0])))


@dataclass(frozen=True)
class DeviceSpeed:
    """Measured (or nominal) speeds the costs are computed from."""

    flops_per_s: float
    """Achieved matmul FLOP/s (training FLOPs over measured step time is a fair estimate)."""
    bytes_per_s: float
    """Achieved memory bandwidth of element-wise kernels."""
    host_link_bytes_per_s: float | None = None
    """Device↔host copy bandwidth; None where host and device memory are one (CPU): no swap."""


@dataclass
class PolicyResult:
    plan: MemoryPlan
    baseline_bytes: float
    activation_bytes: float
    budget_bytes: float | None
    added_time_s: float
    fits: bool
    options: dict[str, int] = field(default_factory=dict)


def num_blocks(model: ModelConfig) -> int:
    return model.num_layers + model.num_mtp_layers


def _is_moe_block(model: ModelConfig, index: int) -> bool:
    return model.is_moe_layer(index) if index < model.num_layers else model.moe is not None


class _Costs:
    """Bytes and added seconds of an option set on one layer, memoised."""

    def __init__(self, shape: ActivationShape, speed: DeviceSpeed) -> None:
        self.shape, self.speed = shape, speed
        self._bytes: dict[tuple[bool, frozenset[str]], tuple[float, float]] = {}

    def bytes(self, moe: bool, options: frozenset[str]) -> tuple[float, float]:
        """(device bytes, swapped bytes)."""
        key = (moe, options)
        if key not in self._bytes:
            parts = activation_bytes_per_layer(self.shape, moe, options, include_swapped=True)
            swapped = float(parts.pop("swapped"))
            parts.pop("core_attention")
            self._bytes[key] = (float(sum(parts.values())), swapped)
        return self._bytes[key]

    def layer_forward_s(self, moe: bool) -> float:
        shape = self.shape
        tokens = shape.seq_len * shape.micro_batch
        flops = layer_forward_flops(shape.model, shape.seq_len, moe, causal=True).total * tokens
        return flops / self.speed.flops_per_s

    def option_s(self, moe: bool, option: str) -> float:
        """Seconds one recompute option adds to one layer's step (alone; swap: ``swap_s``)."""
        m, d, s = self.shape.model, self.shape.dtype_bytes, self.speed
        tokens = self.shape.seq_len * self.shape.micro_batch
        h = m.hidden_size
        elementwise = lambda nbytes: nbytes / s.bytes_per_s  # noqa: E731
        routed = tokens * (m.moe.router.top_k if (moe and m.moe) else 0)
        if option == "norm":
            # four layer norms (two MLA latent norms are small), each rebuilt twice (output, internals)
            return 2 * elementwise(4 * 3 * tokens * h * max(d, 4.0))
        if option == "mla_up":
            attn = m.attention
            if not isinstance(attn, MLAConfig):
                return 0.0
            flops = 2 * tokens * attn.num_heads * (attn.q_lora_rank * attn.qk_head_dim
                                                    + attn.kv_lora_rank * (attn.qk_nope_head_dim + attn.v_head_dim))
            return flops / s.flops_per_s + elementwise(3 * tokens * attn.num_heads * attn.qk_head_dim * d)
        if option == "activation":
            width = (routed * m.moe.expert_ffn_hidden + tokens * m.moe.shared_ffn_hidden) if (moe and m.moe) else (
                tokens * m.dense_ffn_hidden)
            return 2 * elementwise(3 * width * d)
        if option == "permute":
            return elementwise(2 * routed * h * d) if routed else 0.0
        if option == "router":
            return (2 * tokens * h * m.moe.num_experts / s.flops_per_s) if (moe and m.moe) else 0.0
        if option == "attention":
            flops = (attention_projection_flops(m) + attention_core_flops(m, self.shape.seq_len, causal=True)) * tokens
            return flops / s.flops_per_s + elementwise(10 * tokens * h * d)
        if option == "layer":
            return self.layer_forward_s(moe) + elementwise(30 * tokens * h * d)
        raise ValueError(f"unknown recompute option {option!r}; choose from {list(RECOMPUTE_OPTIONS)} (swap: swap_s)")

    def swap_s(self, moe: bool, swapped_bytes: float) -> float:
        """Seconds a layer's host copies add: what the link needs beyond the compute it hides under (out
        during the next layer's forward, in during the previous layer's backward, 2× forward)."""
        if self.speed.host_link_bytes_per_s is None:
            return math.inf
        transfer = swapped_bytes / self.speed.host_link_bytes_per_s
        forward = self.layer_forward_s(moe)
        return max(0.0, transfer - forward) + max(0.0, transfer - 2 * forward)

    def set_s(self, moe: bool, options: frozenset[str]) -> float:
        """Seconds an option set adds to one layer: its recomputes, and one transfer of everything it swaps
        (the swap options share the link, and what a recompute option discards is not copied)."""
        if "layer" in options:
            return self.option_s(moe, "layer")
        inside_attention = {"mla_up"} if "attention" in options else set()
        recomputed = sum(self.option_s(moe, o) for o in options - set(SWAP_OPTIONS) - inside_attention)
        if not options & set(SWAP_OPTIONS):
            return recomputed
        return recomputed + self.swap_s(moe, self.bytes(moe, options)[1])


def _applicable(model: ModelConfig, moe: bool, option: str, speed: DeviceSpeed,
                excluded: frozenset[str] = frozenset()) -> bool:
    if option in excluded:
        return False
    if option == "mla_up" and not isinstance(model.attention, MLAConfig):
        return False
    if option in ("permute", "router", "swap_moe") and not (moe and model.moe is not None):
        return False
    return not (option in SWAP_OPTIONS and speed.host_link_bytes_per_s is None)


def choose_memory_plan(shape: ActivationShape, policy: PolicyName, budget_bytes: float | None, speed: DeviceSpeed,
                       excluded: frozenset[str] = frozenset()) -> PolicyResult:
    """The plan for ``policy`` and the activation budget (bytes for the whole model on one device, or
    None for no budget), with its predicted bytes and added seconds per micro-batch. ``excluded``:
    options the runtime cannot install here (compiled layers swap whole layers only, for one)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown memory policy {policy!r}; choose one of {list(POLICIES)}")
    model = shape.model
    costs = _Costs(shape, speed)
    blocks = num_blocks(model)
    kinds = [_is_moe_block(model, i) for i in range(blocks)]
    head = float(model_activation_bytes(shape)["head"])

    def total(sets: list[frozenset[str]]) -> float:
        return head + sum(costs.bytes(kinds[i], sets[i])[0] for i in range(blocks))

    def added(sets: list[frozenset[str]]) -> float:
        return sum(costs.set_s(kinds[i], sets[i]) for i in range(blocks))

    sets = [frozenset()] * blocks
    baseline = total(sets)
    fits = lambda: budget_bytes is None or total(sets) <= budget_bytes  # noqa: E731
    if policy == "selective":
        sets = [frozenset(o for o in SELECTIVE_OPTIONS if _applicable(model, kinds[i], o, speed, excluded))
                for i in range(blocks)]
    elif policy == "full":
        # whole-layer recompute, on as few layers as the budget needs (all without a budget)
        for i in range(blocks):
            if budget_bytes is not None and fits():
                break
            sets[i] = frozenset({"layer"})
    elif policy == "auto" and budget_bytes is not None:
        sets = _greedy(costs, kinds, budget_bytes, total, excluded)
    plan = MemoryPlan(tuple(sets))
    return PolicyResult(plan, baseline, total(sets), budget_bytes, added(sets), fits(), plan.summary())


def _greedy(costs: _Costs, kinds: list[bool], budget: float, total: Callable[[list[frozenset[str]]], float],
            excluded: frozenset[str]) -> list[frozenset[str]]:
    """Increase (best bytes saved per second added first, one layer at a time), then decrease."""
    model, speed = costs.shape.model, costs.speed
    sets: list[frozenset[str]] = [frozenset()] * len(kinds)
    added_order: list[tuple[str, bool]] = []
    while total(sets) > budget:
        best: tuple[float, str, bool] | None = None
        for moe in sorted(set(kinds)):
            # the least-optioned layer of this kind stands for the kind
            base = min((sets[i] for i in range(len(sets)) if kinds[i] == moe), key=len)
            for option in ALL_OPTIONS:
                if option in base or not _applicable(model, moe, option, speed, excluded):
                    continue
                saved = costs.bytes(moe, base)[0] - costs.bytes(moe, base | {option})[0]
                if saved <= 0:
                    continue
                extra = max(costs.set_s(moe, base | {option}) - costs.set_s(moe, base), 1e-12)
                ratio = saved / extra
                if best is None or ratio > best[0]:
                    best = (ratio, option, moe)
        if best is None:
            break  # nothing left to add: the budget cannot be met
        _, option, moe = best
        base = min((sets[i] for i in range(len(sets)) if kinds[i] == moe), key=len)
        for i in range(len(sets)):
            if kinds[i] == moe and sets[i] == base:
                sets[i] = sets[i] | {option}
                if total(sets) <= budget:
                    break
        added_order.append((option, moe))
    # decrease: drop options (latest first) whose removal keeps the budget
    for option, moe in reversed(added_order):
        trial = [s - {option} if kinds[i] == moe else s for i, s in enumerate(sets)]
        if trial != sets and total(trial) <= budget:
            sets = trial
    return sets
