"""Executor: carry out a placement change on the expert-parallel group with point-to-point copies.

The contract with the runtime (which owns the module and the optimizer):

* every rank holds its expert state as tensors with a leading slot dimension ``[S, ...]``: the grouped
  expert weights, their fp32 master copies, Adam's two moments; gradient buffers need not move when
  migration runs between steps (after ``zero_grad``), but may be passed too;
* every rank calls ``migrate_experts`` with the same ``moves`` (from ``placement.diff``), in the same
  order, at the same point; afterwards slot ``s`` of rank ``r`` holds exactly (bit for bit) what the
  source slot held, so the math of training is unchanged;
* the dispatcher then switches to the new placement's ``logical_to_physical`` table;
* replicas of one expert must stay identical: ``sum_replica_gradients`` adds their gradients (in a
  fixed order, so every replica gets the same bits) before the optimizer step.

Ranks in ``Move`` are positions in the EP group; ``group`` maps them to global ranks.
Torch is imported here only; the planning half of ``moetrain.balance`` stays torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from moetrain.balance.placement import ExpertPlacement, Move


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def migrate_experts(
    moves: Sequence[Move], slot_tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> None:
    """Apply ``moves`` in place to ``slot_tensors`` (each ``[S, ...]``, same S) on this rank.

    All sources are read (cloned) before any destination is written, since a slot may both give away
    its expert and receive another in the same round. Sends and receives are posted together
    (non-blocking) so that no pair of ranks waits on each other's order.
    """
    if not moves:
        return
    me = dist.get_rank(group)
    outgoing: list[tuple[int, list[torch.Tensor]]] = []
    local: list[tuple[int, list[torch.Tensor]]] = []
    for index, move in enumerate(moves):
        if move.src[0] != me:
            continue
        snapshot = [t[move.src[1]].detach().clone() for t in slot_tensors]
        (local if move.dst[0] == me else outgoing).append((index, snapshot))
    requests = []
    incoming: list[tuple[Move, list[torch.Tensor]]] = []
    width = len(slot_tensors)
    for index, snapshot in outgoing:
        move = moves[index]
        for k, tensor in enumerate(snapshot):
            requests.append(dist.isend(tensor, dst=_global(group, move.dst[0]), group=group, tag=index * width + k))
    for index, move in enumerate(moves):
        if move.dst[0] != me or move.src[0] == me:
            continue
        buffers = [torch.empty_like(t[move.dst[1]]) for t in slot_tensors]
        for k, buffer in enumerate(buffers):
            requests.append(dist.irecv(buffer, src=_global(group, move.src[0]), group=group, tag=index * width + k))
        incoming.append((move, buffers))
    for request in requests:
        request.wait()
    with torch.no_grad():
        for index, snapshot in local:
            for tensor, value in zip(slot_tensors, snapshot):
                tensor[moves[index].dst[1]].copy_(value)
        for move, buffers in incoming:
            for tensor, value in zip(slot_tensors, buffers):
                tensor[move.dst[1]].copy_(value)


def sum_replica_gradients(
    placement: ExpertPlacement, slot_grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> None:
    """Replace each replicated expert's gradient, on every replica, by the sum over its replicas.

    Two phases over point-to-point messages: every replica sends to the expert's first replica, which
    adds them in replica order; then the first replica sends the sum back. One fixed order gives
    every replica the same bits, so the replicas' weights stay identical after the optimizer step.
    """
    me = dist.get_rank(group)
    replicated = [e for e in range(placement.num_experts) if placement.num_replicas()[e] > 1]
    width = len(slot_grads)
    gathered: dict[int, list[list[torch.Tensor]]] = {}
    requests = []
    for expert in replicated:
        holders = placement.replicas(expert)
        (owner_rank, owner_slot), others = holders[0], holders[1:]
        for position, (rank, slot) in enumerate(others):
            tag = (expert * placement.num_ranks + position) * width
            if rank == me and owner_rank != me:
                for k, grad in enumerate(slot_grads):
                    requests.append(dist.isend(grad[slot].contiguous(), dst=_global(group, owner_rank),
                                               group=group, tag=tag + k))
            elif owner_rank == me:
                buffers = [torch.empty_like(grad[owner_slot]) for grad in slot_grads]
                if rank == me:  # cannot happen (replicas sit on distinct ranks); kept for clarity
                    raise AssertionError("two replicas of one expert on one rank")
                for k, buffer in enumerate(buffers):
                    requests.append(dist.irecv(buffer, src=_global(group, rank), group=group, tag=tag + k))
                gathered.setdefault(expert, []).append(buffers)
    for request in requests:
        request.wait()
    requests = []
    offset = placement.num_experts * placement.num_ranks * width  # phase-2 tags after phase-1 tags
    with torch.no_grad():
        for expert in replicated:
            holders = placement.replicas(expert)
            (owner_rank, owner_slot), others = holders[0], holders[1:]
            if owner_rank == me:
                for buffers in gathered[expert]:
                    for grad, buffer in zip(slot_grads, buffers):
                        grad[owner_slot].add_(buffer)
                for position, (rank, _) in enumerate(others):
                    tag = offset + (expert * placement.num_ranks + position) * width
                    for k, grad in enumerate(slot_grads):
                        requests.append(dist.isend(grad[owner_slot].contiguous(), dst=_global(group, rank),
                                                   group=group, tag=tag + k))
            else:
                for position, (rank, slot) in enumerate(others):
                    if rank != me:
                        continue
                    tag = offset + (expert * placement.num_ranks + position) * width
                    for k, grad in enumerate(slot_grads):
                        buffer = torch.empty_like(grad[slot])
                        requests.append((dist.irecv(buffer, src=_global(group, owner_rank), group=group,
                                                    tag=tag + k), grad, slot, buffer))
    for item in requests:
        if isinstance(item, tuple):
            request, grad, slot, buffer = item
            request.wait()
            with torch.no_grad():
                grad[slot].copy_(buffer)
        else:
            item.wait()
