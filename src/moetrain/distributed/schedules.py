"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs.

Torch-free, so the planner can simulate exactly the list the runtime executes. An action is
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
"""

from __future__ import annotations

from typing import Literal, NamedTuple


class Action(NamedTuple):
    kind: Literal["F", "B"]
    chunk: int
    micro_batch: int


def _unit(k: int, pp: int, vpp: int, forward: bool) -> tuple[int, int]:
    """(local chunk, micro-batch) of the k-th forward (or backward) unit of a rank."""
    group, within = divmod(k, pp * vpp)
    chunk = within // pp
    if not forward:
        chunk = vpp - 1 - chunk
    return chunk, group * pp + within % pp


def interleaved_1f1b(pp: int, vpp: int, num_micro_batches: int, rank: int) -> list[Action]:
    if vpp > 1 and num_micro_batches % pp:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({num_micro_batches}) divisible by pp={pp}")
    total = num_micro_batches * vpp
    if vpp == 1:
        warmup = min(pp - rank - 1, total)
    else:
        warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp, total)
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


def one_f_one_b(pp: int, num_micro_batches: int, rank: int) -> list[Action]:
    return interleaved_1f1b(pp, 1, num_micro_batches, rank)


def build_schedule(pp: int, vpp: int, num_micro_batches: int) -> list[list[Action]]:
    """Every rank's action list."""
    return [interleaved_1f1b(pp, vpp, num_micro_batches, rank) for rank in range(pp)]
