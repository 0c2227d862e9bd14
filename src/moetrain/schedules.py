"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs.

Torch-free and outside both ``moetrain.planner`` and ``moetrain.distributed``, so the planner simulates
exactly the list the runtime executes and neither imports the other for it. An action is
(kind, chunk, micro_batch): ``F`` forward, ``B`` backward (input and weight gradient together).
``chunk`` is the local model chunk (0..vpp-1); rank r's local chunk v is global chunk ``v·pp + r``
(Megatron's interleaved layout), so activations flow r → r+1 and wrap from the last rank to the
first between chunks.

- ``one_f_one_b`` (PipeDream-Flush, Narayanan et al. 2021): ``pp - r - 1`` warm-up forwards, then one
  forward and one backward alternately, then the remaining backwards. At most ``pp - r`` micro-batches
  hold activations on rank r.
- ``interleaved_1f1b`` (Narayanan et al. 2021 §2.2): the same on ``vpp`` chunks per rank, forward
  units ordered in groups of ``pp`` micro-batches per chunk; warm-up ``2·(pp - r - 1) + (vpp - 1)·pp``.
  The bubble shrinks by ``vpp``. Needs the micro-batch count to be a multiple of ``pp``.
- ``overlapped``: the same order with one more warm-up forward per rank, and each steady-state forward
  fused with the next backward into one ``Overlapped`` step (Pangu "Adaptive Pipe", DeepSeek DualPipe,
  Megatron "combined 1F1B"): the executor runs the two micro-batches interleaved, handing over at
  every expert all-to-all, so each exchange of one runs under the other's compute. The extra warm-up
  forward keeps the forward and backward of a step on different micro-batches on every rank (on
  the last stage 1F1B would otherwise pair a micro-batch with itself) and lets the step receive both
  of its inputs before it starts: step k of rank r needs step k-1 of rank r-1 and step k of rank r+1,
  an acyclic order (``simulate`` checks it). Cost: one more micro-batch of activations per rank.
"""

from __future__ import annotations

from typing import Literal, NamedTuple


class Action(NamedTuple):
    kind: Literal["F", "B"]
    chunk: int
    micro_batch: int


class Overlapped(NamedTuple):
    """A forward and a backward of different micro-batches run together (each one's communication under
    the other's compute)."""

    forward: Action
    backward: Action


Step = Action | Overlapped


def _unit(k: int, pp: int, vpp: int, forward: bool) -> tuple[int, int]:
    """(local chunk, micro-batch) of the k-th forward (or backward) unit of a rank."""
    group, within = divmod(k, pp * vpp)
    chunk = within // pp
    if not forward:
        chunk = vpp - 1 - chunk
    return chunk, group * pp + within % pp


def _warmup(pp: int, vpp: int, total: int, rank: int, extra: int) -> int:
    base = pp - rank - 1 if vpp == 1 else 2 * (pp - rank - 1) + (vpp - 1) * pp
    return min(base + extra, total)


def interleaved_1f1b(pp: int, vpp: int, num_micro_batches: int, rank: int) -> list[Action]:
    if vpp > 1 and num_micro_batches % pp:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({num_micro_batches}) divisible by pp={pp}")
    total = num_micro_batches * vpp
    warmup = _warmup(pp, vpp, total, rank, 0)
    actions: list[Action] = []
    forwards = backwards = 0
    for _ in range(warmup):
        actions.append(Action("F", *_unit(forwards, pp, vpp, True)))
        forwards += 1
    while forwards < total:
        actions.append(Action("F", *_unit(forwards, pp, vpp, True)))
        forwards += 1
        actions.append(Action("B", *_unit(backwards, pp, vpp, False)))
        backwards += 1
    while backwards < total:
        actions.append(Action("B", *_unit(backwards, pp, vpp, False)))
        backwards += 1
    return actions


def overlapped(pp: int, vpp: int, num_micro_batches: int, rank: int) -> list[Step]:
    """Interleaved 1F1B (1F1B when ``vpp`` = 1, gradient accumulation when ``pp`` = 1) with one more
    warm-up forward and each steady-state (forward, backward) fused into one ``Overlapped`` step."""
    if vpp > 1 and num_micro_batches % pp:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({num_micro_batches}) divisible by pp={pp}")
    total = num_micro_batches * vpp
    warmup = _warmup(pp, vpp, total, rank, 1)
    steps: list[Step] = [Action("F", *_unit(k, pp, vpp, True)) for k in range(warmup)]
    backwards = 0
    for forwards in range(warmup, total):
        steps.append(Overlapped(Action("F", *_unit(forwards, pp, vpp, True)),
                                Action("B", *_unit(backwards, pp, vpp, False))))
        backwards += 1
    steps.extend(Action("B", *_unit(k, pp, vpp, False)) for k in range(backwards, total))
    return steps


def simulate(schedules: list[list[Step]], pp: int, vpp: int) -> None:
    """Run every rank's steps on message availability alone and raise ``ValueError`` on a deadlock or
    a dependency broken inside a rank.

    The executor's rules: a step first receives all it needs (the forward's input activation, the
    backward's output gradient), then computes, then posts its sends; sends never block. A backward
    needs the forward of the same (chunk, micro-batch) done by an earlier step of the rank."""
    num_chunks = pp * vpp
    sent: set[tuple[str, int, int]] = set()  # ("act" | "grad", global chunk, micro-batch)
    done: set[tuple[int, int]] = set()  # (global chunk, micro-batch) forwards done
    position = [0] * pp

    def actions(step: Step) -> tuple[Action, ...]:
        return (step.forward, step.backward) if isinstance(step, Overlapped) else (step,)

    def needs(action: Action, rank: int) -> list[tuple[str, int, int]]:
        chunk = action.chunk * pp + rank
        if action.kind == "F":
            return [("act", chunk - 1, action.micro_batch)] if chunk > 0 else []
        return [("grad", chunk + 1, action.micro_batch)] if chunk < num_chunks - 1 else []

    progress = True
    while progress:
        progress = False
        for rank in range(pp):
            if position[rank] == len(schedules[rank]):
                continue
            step = schedules[rank][position[rank]]
            if not all(need in sent for a in actions(step) for need in needs(a, rank)):
                continue
            for action in actions(step):
                chunk = action.chunk * pp + rank
                if action.kind == "B" and (chunk, action.micro_batch) not in done:
                    raise ValueError(f"rank {rank}: backward of chunk {chunk} micro-batch {action.micro_batch} "
                                     "runs before its forward has finished")
            for action in actions(step):
                chunk = action.chunk * pp + rank
                if action.kind == "F":
                    done.add((chunk, action.micro_batch))
                    if chunk < num_chunks - 1:
                        sent.add(("act", chunk, action.micro_batch))
                elif chunk > 0:
                    sent.add(("grad", chunk, action.micro_batch))
            position[rank] += 1
            progress = True
    stuck = [rank for rank in range(pp) if position[rank] < len(schedules[rank])]
    if stuck:
        raise ValueError(f"deadlock: ranks {stuck} wait at steps {[schedules[r][position[r]] for r in stuck]}")


def one_f_one_b(pp: int, num_micro_batches: int, rank: int) -> list[Action]:
    return interleaved_1f1b(pp, 1, num_micro_batches, rank)


def build_schedule(pp: int, vpp: int, num_micro_batches: int, overlap: bool = False) -> list[list[Step]]:
    """Every rank's step list."""
    make = overlapped if overlap else interleaved_1f1b
    return [list(make(pp, vpp, num_micro_batches, rank)) for rank in range(pp)]
