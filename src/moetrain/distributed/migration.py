"""Expert migration: carry out a placement change on the expert-parallel group with point-to-point copies.

The contract with the runtime (which owns the module and the optimizer):

* every rank holds its expert state as tensors with a leading slot dimension ``[S, ...]``: the grouped
  expert weights, their fp32 master copies, Adam's two moments; gradient buffers need not move when
  migration runs between steps (after ``zero_grad``), but may be passed too;
* every rank calls ``post_expert_moves`` (or ``migrate_experts``, which also lands the copies at once)
  with the same ``moves`` (from ``placement.diff``), in the same order, at the same point; once the
  copies have landed (``PendingCopies.finish``) slot ``s`` of rank ``r`` holds exactly (bit for bit)
  what the source slot held, so the math of training is unchanged;
* the dispatcher then switches to the new placement's ``logical_to_physical`` table;
* replicas of one expert must stay identical: ``sum_replica_gradients`` adds their gradients (in a
  fixed order, so every replica gets the same bits) before the optimizer step.

Ranks in ``Move`` are positions in the EP group; ``group`` maps them to global ranks.

Optimizer state under ZeRO: the fp32 master and Adam's moments live in flat buckets sharded over the
expert-data-parallel ranks, so one slot's state may straddle shard boundaries, on the sending and on
the receiving EP rank differently. ``post_sharded_moves`` cuts each moved slot at every boundary of
either side and sends each piece from the shard that holds it to the shard that will hold it: only
the moved bytes travel. The copies are posted and left in flight (``PendingCopies``); the runtime
lands them just before the next optimizer update, so they travel while the next step computes.

It is the runtime half of expert balancing: ``moetrain.balance`` plans the moves without torch, this
module carries them out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moetrain.balance.placement import ExpertPlacement, Move


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


@dataclass(frozen=True)
class CopyRoute:
    """The global ranks one copy goes between (``src`` → ``dst``), and this rank's part in it."""

    src: int
    dst: int
    sender: bool
    receiver: bool


@dataclass
class PendingCopies:
    """Point-to-point copies posted and not yet landed: ``finish`` waits for them and writes them."""

    requests: list = field(default_factory=list)
    landings: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(view of the destination, the piece that lands there)."""

    def post(self, source: torch.Tensor, target: torch.Tensor, route: CopyRoute, group: dist.ProcessGroup | None,
             tag: int) -> None:
        """One copy of ``source`` (this rank's view, read now when it is the route's sender) into ``target``
        (written by ``finish`` when it is the receiver)."""
        if route.sender:
            piece = source.detach().clone()
            if route.receiver:
                self.landings.append((target, piece))
            else:
                self.requests.append(dist.isend(piece, dst=route.dst, group=group, tag=tag))
        elif route.receiver:
            piece = torch.empty_like(target)
            self.requests.append(dist.irecv(piece, src=route.src, group=group, tag=tag))
            self.landings.append((target, piece))

    def finish(self) -> None:
        for request in self.requests:
            request.wait()
        with torch.no_grad():
            for target, piece in self.landings:
                target.copy_(piece)
        self.requests, self.landings = [], []


def post_expert_moves(
    moves: Sequence[Move], slot_tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None,
    tag_offset: int = 0,
) -> PendingCopies:
    """Post the copies that apply ``moves`` to ``slot_tensors`` (each ``[S, ...]``, same S) on this rank;
    return them in flight (``finish`` writes them).

    Sources are read (cloned) now, so a slot may both give away its expert and receive another in the
    same round. Sends and receives are posted together (non-blocking), so no pair of ranks waits on
    each other's order. Messages are numbered from ``tag_offset`` (several layers' moves may be in
    flight in one group at once; give each its own range, ``len(moves) · len(slot_tensors)`` wide).
    """
    pending = PendingCopies()
    me = dist.get_rank(group)
    width = len(slot_tensors)
    for index, move in enumerate(moves):
        if me not in (move.src[0], move.dst[0]):
            continue
        route = CopyRoute(_global(group, move.src[0]), _global(group, move.dst[0]), move.src[0] == me,
                          move.dst[0] == me)
        for k, tensor in enumerate(slot_tensors):
            pending.post(tensor[move.src[1]], tensor[move.dst[1]], route, group, tag_offset + index * width + k)
    return pending


def migrate_experts(
    moves: Sequence[Move], slot_tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> None:
    """Apply ``moves`` in place to ``slot_tensors`` now: afterwards each destination slot holds, bit for
    bit, what its source slot held."""
    post_expert_moves(moves, slot_tensors, group).finish()


def _ring_step_chunks(position: int, size: int, step: int) -> tuple[int, int, bool]:
    """(chunk sent, chunk received, received chunk is added) at ``step`` of a ring all-reduce over
    ``size`` replicas, for the replica at ``position``: ``size − 1`` reduce-scatter steps (receive and
    add), then ``size − 1`` all-gather steps (receive and copy). After the reduce-scatter, the replica
    at p holds the finished sum of chunk (p + 1) mod size."""
    if step < size - 1:
        return (position - step) % size, (position - step - 1) % size, True
    step -= size - 1
    return (position + 1 - step) % size, (position - step) % size, False


def sum_replica_gradients(
    placement: ExpertPlacement, slot_grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None,
    tag_offset: int = 0,
) -> None:
    """Replace each replicated expert's gradient, on every replica, by the sum over its replicas.

    A ring all-reduce per replicated expert over its replicas in replica order (reduce-scatter, then
    all-gather; Patarasuk and Yuan 2009), on point-to-point messages: each replica sends and receives
    2(n − 1)/n of a gradient, the least any all-reduce moves. Every chunk's sum is made once, by one
    replica, and copied to the others, so every replica holds the same bits and the replicas' weights
    stay identical after the optimizer step. The rings of all the experts a rank holds advance together,
    one step at a time (``BalanceCostModel.replica_sync_seconds`` prices this). Messages are numbered from
    ``tag_offset`` (rings of another layer may be in flight in the same group: give each its own range,
    ``num_experts · 2 · num_ranks · len(slot_grads)`` wide).
    """
    me = dist.get_rank(group)
    width = len(slot_grads)
    rings = []  # (expert, my position, ring of ranks, my chunks of each gradient)
    counts = placement.num_replicas().tolist()
    for expert in [e for e, count in enumerate(counts) if count > 1]:
        holders = placement.replicas(expert)
        positions = [position for position, (rank, _) in enumerate(holders) if rank == me]
        if positions:
            slot = holders[positions[0]][1]
            chunks = [torch.tensor_split(grad[slot].view(-1), len(holders)) for grad in slot_grads]
            rings.append((expert, positions[0], [rank for rank, _ in holders], chunks))
    steps = max((2 * (len(ring) - 1) for _, _, ring, _ in rings), default=0)
    for step in range(steps):
        requests, landing = [], []
        for expert, position, ring, chunks in rings:
            size = len(ring)
            if step >= 2 * (size - 1):
                continue
            sent, received, add = _ring_step_chunks(position, size, step)
            after, before = ring[(position + 1) % size], ring[(position - 1) % size]
            for k in range(width):
                tag = tag_offset + (expert * 2 * placement.num_ranks + step) * width + k
                buffer = torch.empty_like(chunks[k][received])
                requests.append(dist.isend(chunks[k][sent], dst=_global(group, after), group=group, tag=tag))
                requests.append(dist.irecv(buffer, src=_global(group, before), group=group, tag=tag))
                landing.append((chunks[k][received], buffer, add))
        for request in requests:
            request.wait()
        with torch.no_grad():
            for chunk, buffer, add in landing:
                chunk.add_(buffer) if add else chunk.copy_(buffer)


def shard_segments(src_start: int, dst_start: int, length: int,
                   shard_size: int) -> list[tuple[int, int, int, int, int]]:
    """A copy of ``length`` elements from flat offset ``src_start`` to ``dst_start`` of a bucket cut into
    shards of ``shard_size``, split at every shard boundary of either side: a list of
    (source shard, offset in it, destination shard, offset in it, elements)."""
    pieces = []
    done = 0
    while done < length:
        src, dst = src_start + done, dst_start + done
        count = min(length - done, shard_size - src % shard_size, shard_size - dst % shard_size)
        pieces.append((src // shard_size, src % shard_size, dst // shard_size, dst % shard_size, count))
        done += count
    return pieces


@dataclass(frozen=True)
class ShardedSlots:
    """One slot-major expert parameter inside a ZeRO bucket, and the moves of its slots."""

    moves: Sequence[Move]
    offset: int
    """Element offset of the parameter in the flat bucket."""
    slot_numel: int
    shards: Sequence[torch.Tensor]
    """This rank's shard of every per-element state tensor of the bucket (master, Adam m, v), each
    ``[shard_size]``; the same list, in the same order, on every rank."""
    shard_size: int


def post_sharded_moves(
    items: Sequence[ShardedSlots], my_ep: int, my_edp: int, global_rank: Callable[[int, int], int],
    group: dist.ProcessGroup | None = None,
) -> PendingCopies:
    """Post the sends and receives that carry the moved slots' sharded state; return them in flight.

    ``global_rank(ep, edp)`` names the rank at that position of the expert grid, so pieces go straight
    from the shard that holds them to the one that will. Sources are copied out now, so this rank's
    shards may be overwritten by other pieces when the copies land. Every rank enumerates the same
    pieces in the same order, which numbers the messages (tags) identically on both ends.
    """
    pending = PendingCopies()
    tag = 0
    for item in items:
        width = len(item.shards)
        for move in item.moves:
            pieces = shard_segments(item.offset + move.src[1] * item.slot_numel,
                                    item.offset + move.dst[1] * item.slot_numel, item.slot_numel, item.shard_size)
            for src_shard, src_offset, dst_shard, dst_offset, count in pieces:
                route = CopyRoute(global_rank(move.src[0], src_shard), global_rank(move.dst[0], dst_shard),
                                  (move.src[0], src_shard) == (my_ep, my_edp),
                                  (move.dst[0], dst_shard) == (my_ep, my_edp))
                for k, shard in enumerate(item.shards):
                    pending.post(shard[src_offset:src_offset + count], shard[dst_offset:dst_offset + count],
                                 route, group, tag + k)
                tag += width
    return pending
