"""Running two micro-batches at once so that each one's all-to-all flies under the other's compute.

An ``Overlapped`` step of the schedule runs the forward of one micro-batch and the backward of another
as two tasks that take turns (Pangu "Adaptive Pipe"; DeepSeek DualPipe; Megatron "combined 1F1B";
MindSpeed fb-overlap). Every exchange is issued asynchronously (a gloo/NCCL work handle); where a task
needs its result it calls ``wait_comm``, which first hands the turn to the other task, and only waits
on the handle when the turn comes back. So the pairs the issue names fall out of the order of the
layer's stages:

    forward task                        backward task
    attention, router, permute      ‖   combine all-to-all (backward) in flight
    dispatch all-to-all in flight   ‖   unpermute backward, experts input-gradient
    experts                         ‖   dispatch all-to-all (backward) in flight, experts weight-gradient
    combine all-to-all in flight    ‖   permute, router and attention backward

Exactly one task runs at a time (a condition variable passes the turn, no busy wait), so the order in
which collectives are issued is fixed by the program alone and equal on every rank of a group, as
gloo and NCCL require. The backward task runs in a helper thread; CPU autograd runs the backward on
the calling thread, and on GPU the handover keys on whose turn it is, not on the thread, so the
autograd device thread may call it too.

Input and weight gradients of the routed experts are computed apart (``SplitGradExperts``; Qi et al.
2023, "Zero Bubble Pipeline Parallelism"): the input gradient is needed at once to start the
dispatch's backward exchange, the weight gradient is queued and computed while that exchange flies
(``flush_weight_grads``), which is also how a lone micro-batch (warm-up, cool-down) hides part of it.
Those gradients bypass autograd, so its post-accumulate-grad hooks do not fire for them; a hook registered
with ``register_weight_grad_hook`` fires instead (the replicas' gradient rings start from it).
Inside one micro-batch the shared expert runs under the dispatch (``moetrain.distributed.ep``).
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from moetrain.distributed.trace import span
from moetrain.models.experts import GroupedExperts, grouped_mm, grouped_weight_grad


class _TakeTurns:
    """Two tasks, one running at a time; the running one hands over at each communication wait."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.turn = 0
        self.finished = [False, False]

    def hand_over(self) -> None:
        with self.cond:
            me = self.turn
            if self.finished[1 - me]:
                return
            self.turn = 1 - me
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == me)

    def wait_turn(self, me: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == me)

    def finish(self, me: int) -> None:
        with self.cond:
            self.finished[me] = True
            self.turn = 1 - me
            self.cond.notify_all()


# The pair now running on this process. Module state, not a context variable: on GPU autograd calls
# the backward of the exchanges from its own device thread, which shares no context with the task.
_PAIR: _TakeTurns | None = None
# Expert weight gradients computed later (see ``SplitGradExperts``); filled and drained on whichever
# thread runs the backward, one at a time.
_DEFERRED: list[Callable[[], None]] = []
_SPLIT_GRADS = False
# Hooks on the expert weights' deferred gradients, by the parameter's id; the weak reference tells a live
# parameter from a dead one whose id was reused (a WeakKeyDictionary would compare tensors with ==).
_WEIGHT_GRAD_HOOKS: dict[int, tuple[weakref.ref, list[Callable[[torch.Tensor], None]]]] = {}


def run_pair(first: Callable[[], None], second: Callable[[], None]) -> None:
    """Run ``first`` here and ``second`` in a helper thread, taking turns at communication waits."""
    global _PAIR
    assert _PAIR is None, "pairs do not nest"
    pair = _TakeTurns()
    errors: list[BaseException] = []

    def second_task() -> None:
        pair.wait_turn(1)
        try:
            second()
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)
        finally:
            pair.finish(1)

    # The helper thread sees the caller's context (the active tracer).
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(second_task,), name="overlapped backward", daemon=True)
    _PAIR = pair
    thread.start()
    try:
        first()
    finally:
        pair.finish(0)
        thread.join()
        _PAIR = None
    if errors:
        raise errors[0]


def wait_comm(work: dist.Work, name: str, hand_over: bool = True) -> None:
    """Wait for an asynchronous exchange, letting the other task of a pair compute first (unless
    ``hand_over`` is False: for an exchange of a few bytes a turn costs more than it hides)."""
    if hand_over and _PAIR is not None:
        _PAIR.hand_over()
    with span(f"wait:{name}", "comm"):
        work.wait()


def set_split_grads(enabled: bool) -> None:
    """Compute the routed experts' weight gradients apart from their input gradients (overlap mode)."""
    global _SPLIT_GRADS
    _SPLIT_GRADS = enabled


def flush_weight_grads() -> None:
    """Compute the queued expert weight gradients (called while an exchange flies, and at the end of
    every backward so the optimizer sees complete gradients)."""
    while _DEFERRED:
        _DEFERRED.pop(0)()


def register_weight_grad_hook(param: torch.nn.Parameter, hook: Callable[[torch.Tensor], None]) -> None:
    """Call ``hook(param)`` after each weight gradient of ``param`` that ``SplitGradExperts`` accumulates
    outside autograd, as ``Tensor.register_post_accumulate_grad_hook`` does for autograd's own."""
    entry = _WEIGHT_GRAD_HOOKS.get(id(param))
    if entry is None or entry[0]() is not param:
        entry = _WEIGHT_GRAD_HOOKS[id(param)] = (weakref.ref(param), [])
    entry[1].append(hook)


def _accumulate(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    param.grad = grad if param.grad is None else param.grad + grad
    entry = _WEIGHT_GRAD_HOOKS.get(id(param))
    if entry is not None and entry[0]() is param:
        for hook in entry[1]:
            hook(param)


class _SplitGradExpertsFn(torch.autograd.Function):
    """SwiGLU experts whose backward returns the input gradient and queues the weight gradients."""

    @staticmethod
    def forward(ctx, tokens_PD: torch.Tensor, tokens_per_expert_E: torch.Tensor,  # type: ignore[override]
                experts: GroupedExperts) -> torch.Tensor:
        # The weights are read from the module, not passed in: autograd then has no edge to them, so their
        # post-accumulate-grad hooks do not fire for the gradient computed here (they fire, with nothing
        # accumulated, for an input whose gradient is None: rings would start before the gradient exists).
        gate_PF = grouped_mm(tokens_PD, experts.w_gate_EDF, tokens_per_expert_E)
        up_PF = grouped_mm(tokens_PD, experts.w_up_EDF, tokens_per_expert_E)
        ctx.save_for_backward(tokens_PD, tokens_per_expert_E, gate_PF, up_PF)
        ctx.experts = experts
        return grouped_mm(experts.act(gate_PF, up_PF), experts.w_down_EFD, tokens_per_expert_E)

    @staticmethod
    def backward(ctx, grad_PD: torch.Tensor):  # type: ignore[override]
        tokens_PD, counts_E, gate_PF, up_PF = ctx.saved_tensors
        experts: GroupedExperts = ctx.experts
        sig_PF = torch.sigmoid(gate_PF)
        silu_PF = gate_PF * sig_PF
        grad_hidden_PF = grouped_mm(grad_PD, experts.w_down_EFD.transpose(1, 2), counts_E)
        grad_up_PF = grad_hidden_PF * silu_PF
        grad_gate_PF = grad_hidden_PF * up_PF * sig_PF * (1 + gate_PF * (1 - sig_PF))
        grad_tokens_PD = (grouped_mm(grad_gate_PF, experts.w_gate_EDF.transpose(1, 2), counts_E)
                          + grouped_mm(grad_up_PF, experts.w_up_EDF.transpose(1, 2), counts_E))

        def weight_grads() -> None:
            # no_grad: this runs after the backward, where grad mode is on again; the saved tokens require
            # grad, so without it each .grad would carry a graph holding the micro-batch's activations
            with span("experts_wgrad"), torch.no_grad():
                hidden_PF = silu_PF * up_PF
                _accumulate(experts.w_gate_EDF, grouped_weight_grad(tokens_PD, grad_gate_PF, counts_E))
                _accumulate(experts.w_up_EDF, grouped_weight_grad(tokens_PD, grad_up_PF, counts_E))
                _accumulate(experts.w_down_EFD, grouped_weight_grad(hidden_PF, grad_PD, counts_E))

        _DEFERRED.append(weight_grads)
        return grad_tokens_PD, None, None


class SplitGradExperts(GroupedExperts):
    """``GroupedExperts`` whose weight gradient is computed apart in overlap mode (same parameters, same
    names, same forward arithmetic)."""

    @classmethod
    def adopt(cls, experts: GroupedExperts) -> SplitGradExperts:
        experts.__class__ = cls  # same state and parameters; only the forward changes
        return experts  # type: ignore[return-value]

    def forward(self, tokens_PD: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        # the split backward runs only from the tokens' gradient (the weights are no input of it)
        if not (_SPLIT_GRADS and torch.is_grad_enabled() and tokens_PD.requires_grad) \
                or torch.is_autocast_enabled(tokens_PD.device.type):
            return super().forward(tokens_PD, tokens_per_expert_E)
        return _SplitGradExpertsFn.apply(tokens_PD, tokens_per_expert_E, self)

