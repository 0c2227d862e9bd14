"""Applying memory options to a built model, from outside: recompute and swap on saved-tensor hooks.

Three mechanisms, all on public autograd APIs (no forked autograd, no flags inside the model):

- **Block recompute** (``attention``, ``layer``, and the internals of every fine-grained producer):
  ``torch.utils.checkpoint`` (non-reentrant) with a selective policy
  (``create_selective_checkpoint_contexts``) that always saves ``topk``, so a recomputed router
  picks the same experts, and collective outputs, so recompute does not communicate again.
- **Output-discarding recompute** (``norm``, ``mla_up``, ``activation``, ``permute``): the producer
  runs under checkpoint, so its internals are not kept, and its output is registered with the
  ``SavedTensorManager``. When a consumer saves that output (or a view of it), the pack hook stores
  a slot instead of the tensor; the first unpack in backward reruns the producer from its (packed)
  inputs under ``no_grad`` and returns the same view. This is MindSpeed's / Megatron's
  "checkpoint without output", built on ``torch.autograd.graph.saved_tensors_hooks``.
- **Swap** (``swap_attention``, ``swap_moe``, ``swap_layer``): tensors saved while the attention / MoE
  block / whole layer runs are copied to pinned host memory on a side stream during forward and
  prefetched back one layer ahead during backward (the first unpack of layer i's tensors starts the
  copy of layer i-1's).
  On CPU the copy still happens (to a separate buffer), which tests the plumbing, not the savings.

Recomputation is deterministic given bit-identical inputs, so gradients equal the plain model's
bit for bit wherever the kernels are deterministic (``torch.use_deterministic_algorithms``).

**Compiled layers** (``apply_memory_policy(..., compiled=True)``, before ``torch.compile``): saved-tensor
hooks cannot be traced, and they are not needed. Inductor's partitioner decides what a compiled layer
keeps for backward, and it does not keep the output of a checkpointed region: it recomputes the region
in backward from the region's inputs (``tests/memory`` measures it). So each recompute option is only
its checkpoint wrapper, with no output registration: ``norm``, ``activation`` and ``mla_up`` wrap their
producer, ``router``, ``attention`` and ``layer`` their block, and ``permute`` the gather of tokens into
expert order (local dispatch only: under expert parallelism the tokens come from other ranks).
A compiled layer saves its tensors when its compiled function returns, through the saved-tensor hooks
active around it: ``swap_layer`` opens them in a forward pre-hook and closes them in a forward hook, both
kept out of the graph (``eager_only``), so everything the layer saves (weights excepted)
goes to host. ``swap_attention`` and ``swap_moe`` stay eager-only: at that boundary no tensor says which
block made it (``COMPILED_OPTIONS``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from moetrain.costs.activations import ALL_OPTIONS
from moetrain.memory.options import COMPILED_EXCLUDED
from moetrain.memory.policy import MemoryPlan
from moetrain.models.dispatch import LocalDispatcher, ReadyDispatch, gather_token_rows
from moetrain.runtime_base.eager_only import eager_only

# Operators whose outputs a recomputing checkpoint keeps: routing decisions and communication.
_ALWAYS_SAVE_OPS = {torch.ops.aten.topk.default}
for _name in ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor"):
    _op = getattr(getattr(torch.ops, "_c10d_functional", None), _name, None)
    if _op is not None:
        _ALWAYS_SAVE_OPS.add(_op.default)


def _save_routing_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in _ALWAYS_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def recompute(fn: Callable, *args, **kwargs):
    """Run ``fn`` so that backward recomputes it (selective checkpoint keeping top-k and collectives)."""
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _save_routing_policy),
                      **kwargs)


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple | list):
        return [t for item in out for t in _tensors(item)]
    return []


class _Producer:
    """A discarded output: how to rebuild it, and a cache shared by every slot that needs it."""

    def __init__(self, manager: SavedTensorManager, fn: Callable, packed_args: list, outputs: list[torch.Tensor]):
        self.manager, self.fn, self.packed_args = manager, fn, packed_args
        self.offsets = [out.storage_offset() for out in outputs]
        self.pending = 0
        self.cache: list[torch.Tensor] | None = None

    def materialize(self, index: int) -> torch.Tensor:
        if self.cache is None:
            args = [self.manager.unpack(a) if isinstance(a, _Slot) else a for a in self.packed_args]
            with torch.no_grad():
                self.cache = _tensors(self.fn(*args))
        return self.cache[index]


@dataclass
class _Slot:
    """What a saved tensor became: a recompute reference or a swapped copy, with the view to rebuild."""

    producer: _Producer | None
    output_index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    swap: _SwapRecord | None = None


@dataclass(eq=False)  # identity: records are removed from their group's list once consumed
class _SwapRecord:
    host: torch.Tensor
    """The saved storage's span (from its first to last element used), in host memory."""
    base_offset: int
    device: torch.device
    group: int
    event: object = None
    on_device: torch.Tensor | None = None
    pending: int = 0


@dataclass
class _ForwardState:
    producers: dict[int, tuple[StorageWeakRef, _Producer, int]] = field(default_factory=dict)
    swapped: dict[int, tuple[StorageWeakRef, _SwapRecord]] = field(default_factory=dict)
    swap_region: list[bool] = field(default_factory=lambda: [False])
    group: int = 0


class SavedTensorManager:
    """The pack/unpack hooks shared by every decoder layer of one model."""

    def __init__(self, min_swap_numel: int = 0, parameter_storages: frozenset[int] = frozenset()) -> None:
        self.min_swap_numel = min_swap_numel
        self.parameter_storages = parameter_storages  # addresses of the model's weights: never swapped
        self.state = _ForwardState()
        self.groups: dict[int, list[_SwapRecord]] = {}
        self._stream = None

    # -- forward side --
    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def register_producer(self, fn: Callable, args: Sequence, outputs) -> None:
        tensors = [t for t in _tensors(outputs) if t.numel() > 0]
        if not tensors or not torch.is_grad_enabled():
            return
        packed = [self.pack(a) if isinstance(a, torch.Tensor) else a for a in args]
        producer = _Producer(self, fn, packed, tensors)
        for index, tensor in enumerate(tensors):
            ref = StorageWeakRef(tensor.untyped_storage())
            self.state.producers[ref.cdata] = (ref, producer, index)

    def pack(self, tensor: torch.Tensor):
        if tensor.numel() == 0 or tensor.device.type == "meta":
            return tensor
        cdata = StorageWeakRef(tensor.untyped_storage()).cdata
        entry = self.state.producers.get(cdata)
        if entry is not None and not entry[0].expired():
            _, producer, index = entry
            producer.pending += 1
            return _Slot(producer, index, tuple(tensor.size()), tuple(tensor.stride()),
                         tensor.storage_offset() - producer.offsets[index])
        # A parameter's storage (the weight itself, or a view of it such as one expert's matrix) stays
        # on the device whatever autograd does with it: copying it out would free nothing.
        if (self.state.swap_region[-1] and tensor.numel() >= self.min_swap_numel and tensor.is_floating_point()
                and tensor.untyped_storage().data_ptr() not in self.parameter_storages):
            return self._offload(tensor, cdata)
        return tensor

    def _offload(self, tensor: torch.Tensor, cdata: int) -> _Slot:
        entry = self.state.swapped.get(cdata)
        if entry is not None and not entry[0].expired():
            record = entry[1]
        else:
            record = self._copy_out(tensor)
            self.state.swapped[cdata] = (StorageWeakRef(tensor.untyped_storage()), record)
            self.groups.setdefault(record.group, []).append(record)
        record.pending += 1
        return _Slot(None, 0, tuple(tensor.size()), tuple(tensor.stride()),
                     tensor.storage_offset() - record.base_offset, swap=record)

    def _copy_out(self, tensor: torch.Tensor) -> _SwapRecord:
        # Copy the whole storage, so that every view of it saved in this layer (the CPU grouped GEMM
        # saves one block per expert) unpacks with its own strides and offset.
        flat = tensor.as_strided((tensor.untyped_storage().nbytes() // tensor.element_size(),), (1,), 0)
        low = 0
        with _disable_current_modes():  # host copies are not device activations (ActivationMeter)
            if tensor.is_cuda:
                stream = self._side_stream(tensor.device)
                host = torch.empty(flat.shape, dtype=tensor.dtype, pin_memory=True)
                stream.wait_stream(torch.cuda.current_stream(tensor.device))
                with torch.cuda.stream(stream):
                    host.copy_(flat, non_blocking=True)
                # the device memory may be reused only once the side stream has read it
                tensor.record_stream(stream)
            else:
                host = flat.clone()
        return _SwapRecord(host, low, tensor.device, self.state.group)

    def _side_stream(self, device: torch.device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    # -- backward side --
    def _prefetch(self, group: int) -> None:
        for record in self.groups.get(group, []):
            if record.on_device is not None or record.pending == 0:
                continue
            if record.device.type == "cuda":
                stream = self._side_stream(record.device)
                stream.wait_stream(torch.cuda.current_stream(record.device))
                with torch.cuda.stream(stream):
                    record.on_device = record.host.to(record.device, non_blocking=True)
                    record.event = torch.cuda.Event()
                    record.event.record(stream)
            else:
                record.on_device = record.host.clone()

    def unpack(self, packed):
        if not isinstance(packed, _Slot):
            return packed
        if packed.swap is not None:
            record = packed.swap
            if record.on_device is None:
                self._prefetch(record.group)
                self._prefetch(record.group - 1)  # one layer ahead: overlaps this layer's backward
            if record.event is not None:
                torch.cuda.current_stream(record.device).wait_event(record.event)
                record.on_device.record_stream(torch.cuda.current_stream(record.device))
                record.event = None
            base = record.on_device
            record.pending -= 1
            if record.pending == 0:
                # Fully consumed: drop it, so its host buffer returns to the (pinned) allocator for the
                # next step instead of piling up, and later prefetches do not scan it.
                record.on_device = None
                group = self.groups.get(record.group)
                if group is not None:
                    group.remove(record)
                    if not group:
                        del self.groups[record.group]
        else:
            producer = packed.producer
            base = producer.materialize(packed.output_index)
            producer.pending -= 1
            if producer.pending == 0:
                producer.cache = None
        return base.as_strided(packed.size, packed.stride, base.storage_offset() + packed.storage_offset)

    # -- regions --
    def enter_layer(self, group: int) -> None:
        self.state.group = group

    def end_layer(self) -> None:
        # producers and swap records stay reachable from their slots; the lookup tables need not
        self.state.producers.clear()
        self.state.swapped.clear()


def _override(obj, name: str, wrapper: Callable, installed: list) -> None:
    original = getattr(obj, name)
    setattr(obj, name, wrapper(original))
    installed.append((obj, name))


COMPILED_OPTIONS: frozenset[str] = frozenset(ALL_OPTIONS) - COMPILED_EXCLUDED
"""Options a compiled layer runs (``compiled=True``)."""


def _producer_wrapper(manager: SavedTensorManager, internals_checkpoint: bool = True):
    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def forward(*args):
            if not torch.is_grad_enabled():
                return original(*args)
            out = recompute(original, *args) if internals_checkpoint else original(*args)
            manager.register_producer(original, args, out)
            return out
        return forward
    return wrap


def _recompute_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(*args):
        return recompute(original, *args) if torch.is_grad_enabled() else original(*args)
    return forward


@dataclass(frozen=True)
class _DiscardedDispatch:
    """A pending dispatch whose tokens, once finished, are registered as a recomputable output."""

    pending: object
    manager: SavedTensorManager
    rebuild: Callable
    args: tuple

    def finish(self):
        out = self.pending.finish()
        if torch.is_grad_enabled():
            self.manager.register_producer(self.rebuild, self.args, out[0])
        return out


def _recomputed_gather(original: Callable) -> Callable:
    """A local dispatch whose permuted tokens are recomputed (compiled layers): the gather into expert
    order is redone under a checkpoint from the block's input; the first gather is then unused, and the
    compiler drops it."""
    @functools.wraps(original)
    def start_dispatch(x_TD, routing):
        pending = original(x_TD, routing)
        if not torch.is_grad_enabled():
            return pending
        _, tokens_per_expert, meta = pending.finish()
        tokens_PD = recompute(gather_token_rows, x_TD, meta.permute.token_index_P, meta.permute.inverse_P)
        return ReadyDispatch((tokens_PD, tokens_per_expert, meta))
    return start_dispatch


def _recomputed_dispatch(manager: SavedTensorManager, original: Callable) -> Callable:
    def rebuild(x_TD: torch.Tensor, routing) -> torch.Tensor:
        return original(x_TD, routing).finish()[0]

    @functools.wraps(original)
    def start_dispatch(x_TD, routing):
        pending = original(x_TD, routing)
        if not torch.is_grad_enabled():
            return pending
        return _DiscardedDispatch(pending, manager, rebuild, (x_TD, routing))
    return start_dispatch


@dataclass
class AppliedPolicy:
    """Handle returned by ``apply_memory_policy``: what was installed, and how to remove it."""

    plan: MemoryPlan
    manager: SavedTensorManager
    overrides: list = field(default_factory=list)
    handles: list = field(default_factory=list)

    def remove(self) -> None:
        for obj, name in reversed(self.overrides):
            delattr(obj, name)
        for handle in self.handles:
            handle.remove()
        self.overrides.clear()
        self.handles.clear()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Decoder layers in plan order: ``model.layers`` then each MTP module's layer."""
    layers = getattr(model, "layers", [])
    # a parallelized model keys its layers by global index (``ModuleDict``)
    layers = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
    layers += [m.layer for m in getattr(model, "mtp", [])]
    return layers


def apply_memory_policy(model: nn.Module, plan: MemoryPlan, min_swap_numel: int | None = None,
                        compiled: bool = False) -> AppliedPolicy:
    """Install the plan's options on each decoder layer of ``model`` (a ``MoETransformer``).

    Call after the expert-parallel dispatcher is installed (``permute`` wraps whichever dispatcher
    the MoE block has). ``min_swap_numel``: smaller saved tensors stay on the device (default 2**16
    elements on CUDA, 0 on CPU). ``compiled``: the layers will be compiled afterwards (checkpoint
    wrappers, and ``swap_layer``'s hooks around the call: ``COMPILED_OPTIONS``). Returns a handle whose
    ``remove()`` restores the plain model."""
    layers = decoder_layers(model)
    if len(plan.layer_options) != len(layers):
        raise ValueError(f"the plan has {len(plan.layer_options)} layers, the model {len(layers)}")
    if compiled:
        unsupported = sorted(set().union(*plan.layer_options) - COMPILED_OPTIONS)
        if unsupported:
            raise ValueError(f"{unsupported} cannot run in compiled layers; choose from {sorted(COMPILED_OPTIONS)}")
    device = next(model.parameters()).device
    if min_swap_numel is None:
        min_swap_numel = 2**16 if device.type == "cuda" else 0
    manager = SavedTensorManager(min_swap_numel,
                                 frozenset(p.untyped_storage().data_ptr() for p in model.parameters()))
    applied = AppliedPolicy(plan, manager)
    for index, (layer, options) in enumerate(zip(layers, plan.layer_options)):
        unknown = set(options) - set(ALL_OPTIONS)
        assert not unknown, unknown
        if compiled:
            _apply_to_compiled_layer(layer, frozenset(options), applied)
            if "swap_layer" in options and "layer" not in options:
                _hooks_around_layer(layer, index, manager, applied, swap=True)
        else:
            _apply_to_layer(layer, index, frozenset(options), manager, applied)
    return applied


def _hooks_around_layer(layer: nn.Module, index: int, manager: SavedTensorManager, applied: AppliedPolicy,
                        swap: bool) -> None:
    """The manager's hooks open while the layer runs (``swap``: everything it saves goes to host, unless a
    region inside says otherwise). Kept out of a compiled layer's graph, whose saved tensors reach them as
    its compiled function returns (module doc); eager layers run them as they are."""
    contexts: list = []

    @eager_only
    def enter(module, args) -> None:
        manager.enter_layer(index)
        manager.state.swap_region.append(swap)
        context = manager.hooks()
        context.__enter__()
        contexts.append(context)

    @eager_only
    def leave(module, args, output) -> None:
        contexts.pop().__exit__(None, None, None)
        manager.state.swap_region.pop()
        manager.end_layer()

    applied.handles.append(layer.register_forward_pre_hook(enter))
    applied.handles.append(layer.register_forward_hook(leave, always_call=True))


def _mlps(layer: nn.Module) -> list[nn.Module]:
    moe = getattr(layer, "moe", None)
    if moe is None:
        return [layer.ffn] if hasattr(layer, "ffn") else []
    return [moe.experts] + ([moe.shared_expert] if moe.shared_expert is not None else [])


def _apply_to_compiled_layer(layer: nn.Module, options: frozenset[str], applied: AppliedPolicy) -> None:
    """Checkpoint wrappers only: the compiler recomputes what they wrap (module doc)."""
    if "layer" in options:
        _override(layer, "forward", _recompute_wrapper, applied.overrides)
        return
    attention = layer.attention
    if "attention" in options:
        _override(attention, "forward", _recompute_wrapper, applied.overrides)
    elif "mla_up" in options and hasattr(attention, "project_up"):
        _override(attention, "project_up", _recompute_wrapper, applied.overrides)
    if "norm" in options:
        names = ["attn_norm", "attn_post_norm", "ffn_norm", "ffn_post_norm"]
        if "attention" not in options and "mla_up" not in options:
            names += [f"attention.{name}" for name in ("q_norm", "kv_norm", "k_norm")]
        for name in names:
            module = layer.get_submodule(name) if _has_submodule(layer, name) else None
            if module is not None:
                _override(module, "forward", _recompute_wrapper, applied.overrides)
    moe = getattr(layer, "moe", None)
    if moe is not None and "router" in options:
        _override(moe.router, "forward", _recompute_wrapper, applied.overrides)
    if moe is not None and "permute" in options:
        if not isinstance(moe.dispatcher, LocalDispatcher):
            raise ValueError("permute recompute in compiled layers needs the local dispatcher (expert parallelism "
                             "keeps the tokens of other ranks: run it eager)")
        _override(moe.dispatcher, "start_dispatch", _recomputed_gather, applied.overrides)
    if "activation" in options:
        for mlp in _mlps(layer):
            _override(mlp.act, "forward", _recompute_wrapper, applied.overrides)


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _apply_to_layer(layer: nn.Module, index: int, options: frozenset[str], manager: SavedTensorManager,
                    applied: AppliedPolicy) -> None:
    if not options:
        return
    if "layer" in options:
        _override(layer, "forward", _recompute_wrapper, applied.overrides)
        return
    swap_layer = "swap_layer" in options
    _hooks_around_layer(layer, index, manager, applied, swap=swap_layer)

    def region(module: nn.Module, swap: bool) -> None:
        def push(mod, args) -> None:
            manager.state.swap_region.append(swap)

        def pop(mod, args, output) -> None:
            manager.state.swap_region.pop()

        applied.handles.append(module.register_forward_pre_hook(push))
        applied.handles.append(module.register_forward_hook(pop, always_call=True))

    attention = layer.attention
    producer = _producer_wrapper(manager)
    if "attention" in options:
        _override(attention, "forward", _recompute_wrapper, applied.overrides)
    else:
        if "swap_attention" in options and not swap_layer:
            region(attention, True)
        if "mla_up" in options and hasattr(attention, "project_up"):
            _override(attention, "project_up", producer, applied.overrides)
        if "norm" in options:
            for name in ("q_norm", "kv_norm", "k_norm"):
                if hasattr(attention, name) and not ("mla_up" in options and hasattr(attention, "project_up")):
                    _override(getattr(attention, name), "forward", producer, applied.overrides)
    if "norm" in options:
        for name in ("attn_norm", "attn_post_norm", "ffn_norm", "ffn_post_norm"):
            if hasattr(layer, name):
                _override(getattr(layer, name), "forward", producer, applied.overrides)
    moe = getattr(layer, "moe", None)
    mlps = _mlps(layer)
    if moe is not None:
        if "swap_moe" in options and not swap_layer:
            region(moe, True)
            region(moe.router, False)
        if "router" in options:
            _override(moe.router, "forward", _recompute_wrapper, applied.overrides)
        if "permute" in options:
            # The MoE block issues ``start_dispatch`` and later ``finish``es it (local and
            # expert-parallel dispatchers alike), so the wrapper sits there: the dispatched tokens
            # are discarded and rebuilt in backward by dispatching again. Under expert parallelism
            # that rebuild exchanges the tokens again (counts and one all-to-all, at the same point
            # of backward on every EP rank): memory traded for communication, as the cost model says.
            _override(moe.dispatcher, "start_dispatch", functools.partial(_recomputed_dispatch, manager),
                      applied.overrides)
    if "activation" in options:
        for mlp in mlps:
            _override(mlp.act, "forward", producer, applied.overrides)

