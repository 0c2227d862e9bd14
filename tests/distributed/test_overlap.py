"""The overlapped schedule's parts, without a process group: the step lists (deadlock-free, never a
micro-batch paired with itself), the turn-taking of a pair at communication waits, and the experts'
split input/weight gradients."""

from __future__ import annotations

import threading

import pytest
import torch

from moetrain.distributed import overlap
from moetrain.models.experts import GroupedExperts
from moetrain.schedules import Action, Overlapped, build_schedule, interleaved_1f1b, simulate


def test_overlapped_one_stage_pairs_each_forward_with_the_previous_backward() -> None:
    assert build_schedule(1, 1, 3, overlap=True) == [[
        Action("F", 0, 0),
        Overlapped(Action("F", 0, 1), Action("B", 0, 0)),
        Overlapped(Action("F", 0, 2), Action("B", 0, 1)),
        Action("B", 0, 2),
    ]]


@pytest.mark.parametrize(("pp", "vpp"), [(2, 1), (3, 1), (4, 1), (2, 2), (4, 2), (2, 3)])
def test_overlapped_schedules_run_without_deadlock(pp: int, vpp: int) -> None:
    for micro_batches in range(pp, 4 * pp + 1, pp):
        schedules = build_schedule(pp, vpp, micro_batches, overlap=True)
        simulate(schedules, pp, vpp)
        for rank, steps in enumerate(schedules):
            flat = [a for s in steps for a in (s if isinstance(s, Overlapped) else (s,))]
            assert sorted(flat) == sorted(interleaved_1f1b(pp, vpp, micro_batches, rank)), "same units, once each"
            for step in steps:
                if isinstance(step, Overlapped):
                    assert step.forward.kind == "F" and step.backward.kind == "B"
                    assert step.forward[1:] != step.backward[1:], "a micro-batch paired with itself"
        if micro_batches > pp:  # a steady state exists: every rank pairs something
            assert all(any(isinstance(s, Overlapped) for s in steps) for steps in schedules)


def test_simulate_finds_the_deadlock_of_too_short_a_warmup() -> None:
    # Both ranks with one warm-up forward: rank 0's step (F1, B0) needs rank 1's B0 gradient, and
    # rank 1's step (F1, B0) needs rank 0's F1 activation.
    steps = [Action("F", 0, 0), Overlapped(Action("F", 0, 1), Action("B", 0, 0)),
             Overlapped(Action("F", 0, 2), Action("B", 0, 1)), Action("B", 0, 2)]
    with pytest.raises(ValueError, match=r"deadlock: ranks \[0, 1\]"):
        simulate([steps, steps], 2, 1)
    # A micro-batch paired with itself is refused too.
    with pytest.raises(ValueError, match="before its forward"):
        simulate([[Overlapped(Action("F", 0, 0), Action("B", 0, 0))]], 1, 1)


class _Work:
    """A stand-in work handle that logs when it is waited on."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"{self.name} done")


def test_pair_hands_over_at_every_wait_and_runs_one_task_at_a_time() -> None:
    log: list[str] = []
    running = threading.Semaphore(1)  # fails the test if both tasks ever compute at once

    def task(name: str, exchanges: int) -> None:
        for i in range(exchanges):
            assert running.acquire(blocking=False), "both tasks ran at once"
            log.append(f"{name}{i} compute, issue")
            running.release()
            overlap.wait_comm(_Work(log, f"{name}{i}"), "a2a")

    overlap.run_pair(lambda: task("F", 2), lambda: task("B", 3))
    assert log == [
        "F0 compute, issue", "B0 compute, issue",   # F's exchange flies while B computes
        "F0 done", "F1 compute, issue",             # and B's while F computes
        "B0 done", "B1 compute, issue",
        "F1 done",                                  # F is finished: B no longer hands over
        "B1 done", "B2 compute, issue", "B2 done",
    ]


def test_pair_reraises_the_second_tasks_error() -> None:
    def fails() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        overlap.run_pair(lambda: None, fails)
    overlap.run_pair(lambda: None, lambda: None)  # the pair was released


def test_split_grad_experts_equal_the_plain_experts() -> None:
    counts = torch.tensor([3, 0, 5, 2])
    torch.manual_seed(0)
    reference = GroupedExperts(4, 6, 5)
    for w in reference.parameters():
        torch.nn.init.normal_(w)
    split = overlap.SplitGradExperts.adopt(GroupedExperts(4, 6, 5))
    split.load_state_dict(reference.state_dict())
    tokens = torch.randn(int(counts.sum()), 6)
    grads = []
    for experts, split_on in ((reference, False), (split, True)):
        x = tokens.clone().requires_grad_(True)
        overlap.set_split_grads(split_on)
        try:
            experts(x, counts).pow(2).sum().backward()
            if split_on:
                assert all(p.grad is None for p in experts.parameters()), "weight gradients are deferred"
                overlap.flush_weight_grads()
        finally:
            overlap.set_split_grads(False)
        grads.append([x.grad, *(p.grad for p in experts.parameters())])
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_deferred_weight_gradients_fire_their_own_hook_not_autograds() -> None:
    """Under split gradients autograd accumulates nothing into the expert weights, so its post-accumulate-grad
    hooks must not fire (they would report a gradient that does not exist yet); the hooks registered with
    ``register_weight_grad_hook`` fire once per weight and backward pass, after the gradient is in ``.grad``."""
    counts = torch.tensor([3, 0, 5, 2])
    torch.manual_seed(0)
    experts = overlap.SplitGradExperts.adopt(GroupedExperts(4, 6, 5))
    for w in experts.parameters():  # torch.empty's leftovers can hold NaN, which torch.equal never matches
        torch.nn.init.normal_(w)
    fired: list[tuple[str, str, torch.Tensor | None]] = []
    for name, p in experts.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(("autograd", name, None)))
        overlap.register_weight_grad_hook(p, lambda p, name=name: fired.append(("deferred", name, p.grad.clone())))
    overlap.set_split_grads(True)
    try:
        for _ in range(2):  # two micro-batches
            experts(torch.randn(int(counts.sum()), 6, requires_grad=True), counts).sum().backward()
            assert fired == [] or fired[-1][0] == "deferred", "no hook before the deferred gradients run"
            overlap.flush_weight_grads()
    finally:
        overlap.set_split_grads(False)
    names = [name for name, _ in experts.named_parameters()]
    assert [(kind, name) for kind, name, _ in fired] == [("deferred", name) for name in names] * 2
    # each hook saw its weight's gradient summed so far: the second equals the final one
    for (_, name, seen), p in zip(fired[len(names):], experts.parameters()):
        assert torch.equal(seen, p.grad), name
        assert p.grad.grad_fn is None, f"{name}: a gradient that holds a graph (and its activations)"
    # the plain path (split gradients off) still reports through autograd's hooks, once per weight
    fired.clear()
    experts(torch.randn(int(counts.sum()), 6, requires_grad=True), counts).sum().backward()
    assert sorted(name for kind, name, _ in fired if kind == "autograd") == sorted(names)
    assert all(kind == "autograd" for kind, _, _ in fired)
