"""Replicated experts' gradients: summed over their replicas once per step, the rings run under the backward.

Every replica of an expert must get the same update, so each replicated expert's gradient is replaced by
the sum over its replicas (``migration.sum_replica_gradients``: a ring all-reduce per expert) before the ZeRO
step. Run after the backward, the rings add their whole time to the step. Here each layer's rings start as
soon as that layer's expert gradients are final, and run while the backward of the layers before it
computes; the optimizer waits for them just before it reads the gradients. This is the idea of PyTorch DDP's
bucketed all-reduce launched from autograd hooks (Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", §3.2.3), applied to the replicas' rings; the code is our own.

How a layer's gradients are known to be final: a post-accumulate-grad hook on each of the layer's expert
weights counts the backward passes that reached it; with ``expect_backward(n)`` (one per micro-batch) the
n-th of each weight makes the layer ready. The overlapped schedule (``--overlap``) accumulates the expert
weight gradients outside autograd, where autograd's hooks do not fire; the same hook is registered with
``overlap.register_weight_grad_hook`` and counts those. A layer whose count is not reached (a micro-batch
that skips the layer) is started when the optimizer waits, after the backward: correct, only not hidden.

The rings run on one helper thread, layer after layer in a fixed order (the backward's: the last layer
first), on every rank alike: a rank never waits on a ring whose peers are busy with another layer, so the
point-to-point messages cannot deadlock. ``gloo``'s work handles only progress while someone waits on them
(``is_completed`` stays False until ``wait``), hence a thread rather than polling; the waits release the GIL.
Each chunk's sum is made by the same additions in the same order as after the backward, so the gradients,
and the weights after the update, are the same bits.
"""

from __future__ import annotations

import contextvars
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from moetrain.balance.placement import EMPTY_SLOT, ExpertPlacement
from moetrain.distributed.migration import sum_replica_gradients
from moetrain.distributed.migration_executor import EXPERT_WEIGHTS
from moetrain.distributed.overlap import register_weight_grad_hook
from moetrain.distributed.trace import span

RING_TAG_BASE = 1 << 24
"""Message tags of the rings run under the backward start here: apart from the migration's copies (tags from
0), which may still be in flight on the same EP group."""


@dataclass
class _ArmedStep:
    """One step's rings: which layers are replicated, how many backward passes make each ready, the
    helper thread that runs them."""

    placements: list[ExpertPlacement]
    order: list[int]
    """Indices of the replicated layers, in the order their rings run (the last layer first)."""
    needed: int
    """Hook calls that make a layer ready: one per expert weight per backward pass."""
    counts: dict[int, int] = field(default_factory=dict)
    ready: dict[int, threading.Event] = field(default_factory=dict)
    started_in_backward: list[int] = field(default_factory=list)
    """Layers whose rings became ready from a hook (under the backward), in that order."""
    errors: list[BaseException] = field(default_factory=list)
    cancelled: bool = False
    thread: threading.Thread | None = None


@dataclass
class ReplicaGradients:
    """Sums replicated experts' gradients over their replicas, once per step before the ZeRO step.

    ``overlap``: start each layer's rings under the backward (needs ``expect_backward`` before it); False,
    or a step without ``expect_backward``, runs them all in ``sum`` after the backward."""

    layers: list[tuple[int, nn.Module]]
    ep_group: dist.ProcessGroup
    edp_size: int
    device: torch.device
    overlap: bool = True
    last_started_in_backward: list[int] = field(default_factory=list)
    """Layer indices whose rings the last step started from a hook, under the backward (for tests and logs)."""

    def __post_init__(self) -> None:
        self._armed: _ArmedStep | None = None
        self._lock = threading.Lock()
        for index, (_, block) in enumerate(self.layers):
            for name in EXPERT_WEIGHTS:
                param = getattr(block.experts, name)
                param.register_post_accumulate_grad_hook(lambda param, index=index: self._on_gradient(index))
                # the overlapped schedule's weight gradients bypass autograd and its hooks
                register_weight_grad_hook(param, lambda param, index=index: self._on_gradient(index))

    def _params(self, index: int) -> list[nn.Parameter]:
        return [getattr(self.layers[index][1].experts, name) for name in EXPERT_WEIGHTS]

    def _grads(self, index: int) -> list[torch.Tensor]:
        params = self._params(index)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in params]

    def _ring(self, index: int, placement: ExpertPlacement, tag_offset: int = 0) -> None:
        with span("replica_grad_sum", "comm"):
            sum_replica_gradients(placement, self._grads(index), self.ep_group, tag_offset)

    # ---- under the backward ---------------------------------------------------------------------

    def expect_backward(self, placements: list[ExpertPlacement], num_backward: int) -> None:
        """Arm this step's rings: each replicated layer's start once its weights have had ``num_backward``
        gradient accumulations (one backward pass per micro-batch)."""
        self._cancel()
        if not self.overlap:
            return
        order = [i for i in reversed(range(len(self.layers))) if int(placements[i].num_replicas().max()) > 1]
        if not order:
            return
        armed = _ArmedStep(placements, order, len(EXPERT_WEIGHTS) * num_backward,
                           ready={i: threading.Event() for i in order})
        # the thread sees the caller's context (the active tracer), as the overlapped backward does
        context = contextvars.copy_context()
        armed.thread = threading.Thread(target=context.run, args=(self._run, armed), name="replica rings",
                                        daemon=True)
        self._armed = armed
        armed.thread.start()

    def _on_gradient(self, index: int) -> None:
        """A post-accumulate-grad hook of layer ``index``'s expert weights (on the thread that accumulated it:
        autograd's, or the overlapped schedule's)."""
        armed = self._armed
        if armed is None or index not in armed.ready:
            return
        with self._lock:
            armed.counts[index] = armed.counts.get(index, 0) + 1
            if armed.counts[index] != armed.needed:
                return
            armed.started_in_backward.append(index)
        armed.ready[index].set()

    def _run(self, armed: _ArmedStep) -> None:
        try:
            for index in armed.order:
                armed.ready[index].wait()
                if armed.cancelled:
                    return  # the step was abandoned
                stride = armed.placements[index].num_experts * 2 * armed.placements[index].num_ranks
                self._ring(index, armed.placements[index], RING_TAG_BASE + index * stride * len(EXPERT_WEIGHTS))
        except BaseException as exc:  # re-raised where the optimizer waits
            armed.errors.append(exc)

    def _wait(self) -> _ArmedStep | None:
        """Start the layers no hook made ready (the backward is over: their gradients are final) and wait
        for every ring. Returns the finished step (None when nothing was armed)."""
        armed, self._armed = self._armed, None
        if armed is None:
            return None
        for index in armed.order:
            if not armed.ready[index].is_set():
                self._grads(index)  # here, not on the helper thread: the backward may leave a weight without one
                armed.ready[index].set()
        assert armed.thread is not None
        with span("replica_grad_wait", "comm"):
            armed.thread.join()
        if armed.errors:
            raise armed.errors[0]
        return armed

    def _cancel(self) -> None:
        armed, self._armed = self._armed, None
        if armed is not None:
            armed.cancelled = True
            for event in armed.ready.values():
                event.set()

    # ---- before the optimizer step --------------------------------------------------------------

    @torch.no_grad()
    def sum(self, placements: list[ExpertPlacement]) -> torch.Tensor | None:
        """Sum each layer's replicated experts' gradients (under ``placements``): wait for the rings started
        under the backward, or run them now. Return this rank's share of the squared norm counted more than
        once (negative), or None when nothing is replicated."""
        armed = self._wait()
        self.last_started_in_backward = [] if armed is None else list(armed.started_in_backward)
        if armed is not None:
            placements = armed.placements
        correction = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = False
        ep_rank = dist.get_rank(self.ep_group)
        for index, placement in enumerate(placements):
            if int(placement.num_replicas().max()) == 1:
                continue
            replicated = True
            if armed is None:
                self._ring(index, placement)
            grads = self._grads(index)
            # every replica but the first of each expert is a duplicate for the norm
            for slot, expert in enumerate(placement.experts_on_rank(ep_rank).tolist()):
                if expert == EMPTY_SLOT or placement.replicas(expert)[0] == (ep_rank, slot):
                    continue
                for grad in grads:
                    correction -= grad[slot].double().pow(2).sum() / self.edp_size
        return correction if replicated else None
