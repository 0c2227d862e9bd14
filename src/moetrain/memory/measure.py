"""Exact activation accounting: the bytes that stay alive for backward after a forward pass.

``ActivationMeter`` is a ``TorchDispatchMode`` that sees every tensor an operator creates during the
forward, keeps a weak reference to its storage and notes which model part was running. After the
forward, with only the loss kept, every storage still alive is held by autograd: saved tensors (the
tensors reached through ``saved_tensors_hooks``), checkpoint inputs and selective-checkpoint caches
alike. That is the quantity a memory budget bounds, counted once per storage (a tensor saved by two
operators, or a view of it, counts once). Swapped-out host copies are made outside the meter
(``moetrain.memory.runtime``) and so are not device bytes.

Part names are those of ``moetrain.costs.activations.activation_bytes_per_layer`` so the two can be
compared part by part.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Child name inside a decoder layer (or MoE block) → part name.
_LAYER_CHILD_PARTS: dict[str, str] = {
    "attn_norm": "attn_norm",
    "attention": "attention",
    "attn_post_norm": "attn_post_norm",
    "ffn_norm": "ffn_norm",
    "ffn": "ffn",
    "ffn_post_norm": "ffn_post_norm",
    "moe": "dispatch",  # the MoE block's own ops: flatten, permute (dispatcher) and combine
}
_MOE_CHILD_PARTS: dict[str, str] = {"router": "router", "experts": "experts", "shared_expert": "shared_expert"}


def part_of_module(qualified_name: str) -> tuple[str, str]:
    """(layer key, part) for a module name: ``layers.3.moe.experts.act`` → (``layers.3``, ``experts``);
    outside decoder layers the layer key is ``""`` and the part ``embedding`` or ``head``."""
    names = qualified_name.split(".") if qualified_name else []
    if len(names) >= 2 and names[0] == "layers":
        layer, rest = ".".join(names[:2]), names[2:]
    elif len(names) >= 3 and names[0] == "mtp" and names[2] == "layer":
        layer, rest = ".".join(names[:3]), names[3:]
    else:
        return "", "embedding" if names[:1] == ["embed"] else "head"
    if not rest:
        return layer, "residual"
    part = _LAYER_CHILD_PARTS.get(rest[0], rest[0])
    if rest[0] == "moe" and len(rest) >= 2:
        part = _MOE_CHILD_PARTS.get(rest[1], "dispatch")
    return layer, part


@dataclass
class MeasuredActivations:
    total_bytes: int
    by_layer: dict[str, dict[str, int]] = field(default_factory=dict)
    """layer key (``layers.3``, ``mtp.0.layer``, or ``""`` for embedding/head) → part → bytes."""
    details: list[tuple[str, str, str, tuple[int, ...], str, int]] = field(default_factory=list)
    """(layer, part, op, shape, dtype, bytes) for every storage still alive (for debugging a formula)."""

    def layer_total(self, layer: str) -> int:
        return sum(self.by_layer.get(layer, {}).values())


class ActivationMeter(TorchDispatchMode):
    """Track storages created while active; ``alive()`` sums those still referenced."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._model = model
        self._stack: list[str] = [""]
        self._handles: list = []
        self._tracked: dict[int, tuple[StorageWeakRef, int, str, str, str, tuple[int, ...], str]] = {}
        self._known: set[int] = set()

    def __enter__(self):
        for tensor in list(self._model.parameters()) + list(self._model.buffers()):
            self._known.add(StorageWeakRef(tensor.untyped_storage()).cdata)
        for name, module in self._model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter_module(name)))
            self._handles.append(module.register_forward_hook(self._exit_module, always_call=True))
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return super().__exit__(*exc)

    def _enter_module(self, name: str):
        def hook(module, args):
            self._stack.append(name)
        return hook

    def _exit_module(self, module, args, output):
        self._stack.pop()

    def note_inputs(self, *tensors: torch.Tensor) -> None:
        """Storages created before the forward (token ids, labels) are not activations."""
        for tensor in tensors:
            self._known.add(StorageWeakRef(tensor.untyped_storage()).cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        layer, part = part_of_module(self._stack[-1])
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            ref = StorageWeakRef(storage)
            if ref.cdata in self._known or ref.cdata in self._tracked:
                continue
            self._tracked[ref.cdata] = (ref, storage.nbytes(), layer, part, str(func.__name__),
                                        tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        return out

    def alive(self) -> MeasuredActivations:
        result = MeasuredActivations(0)
        for ref, nbytes, layer, part, op, shape, dtype in self._tracked.values():
            if ref.expired() or nbytes == 0:
                continue
            result.total_bytes += nbytes
            parts = result.by_layer.setdefault(layer, {})
            parts[part] = parts.get(part, 0) + nbytes
            result.details.append((layer, part, op, shape, dtype, nbytes))
        return result


def measure_activations(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                        backward: bool = True) -> MeasuredActivations:
    """Run one forward (and backward, to free the graph) and return the bytes kept for backward."""
    meter = ActivationMeter(model)
    meter.note_inputs(input_ids, labels)
    with meter:
        loss = model(input_ids, labels=labels).loss
    measured = meter.alive()
    if backward:
        loss.backward()
    return measured


def measure_saved_bytes(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> int:
    """Run one forward and backward; return the bytes of the distinct storages autograd kept for backward,
    parameters excluded (keeping a weight costs nothing). Counted by saved-tensor hooks, which also see
    what a compiled function keeps (it saves its tensors at its boundary, outside the graph), where
    ``ActivationMeter`` sees eager operators only. No part names: a compiled layer's tensors have none."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids, labels=labels).loss
    loss.backward()
    return sum(kept.values())


def host_link_bytes_per_s(device: torch.device, mib: int = 256, repeats: int = 5) -> float | None:
    """Device → pinned host copy speed, the direction swap-out takes (best of ``repeats`` copies of ``mib``
    MiB); None where host and device memory are one (not CUDA): there is nothing to swap to."""
    if device.type != "cuda":
        return None
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return src.numel() / best


def time_steps(step: Callable[[], None], repeats: int, warmup: int = 1,
               device: torch.device | None = None) -> float:
    """Median seconds of ``step`` over ``repeats`` runs after ``warmup`` runs."""
    def sync() -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]
