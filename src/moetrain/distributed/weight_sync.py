"""Weight sync: reshard the training layout's weights into a generation layout's, in checked buckets.

The plan is computed once, identically on every rank, from what every rank holds and needs:

- sources: each training rank's tensors as global regions (``placements.local_pieces``: TP slices,
  experts by logical index, ETP slices, whole replicated tensors);
- needs: each generation rank's tensors as global regions (the same rule applied to the generation
  layout: a data-parallel replica needs every tensor whole; an EP-sharded one only its experts).

Each needed region is cut into the boxes where it meets source regions (every needed element must be
covered, or the plan is refused). A box needed by a rank that also holds it is copied locally; for the
other ranks one holder is its owner (the least-loaded one in bytes, ties to the lowest rank: replicas
over DP/TP/EDP spread the sending), so every element is sent once, by a rank that owns it. Boxes of one
owner and one set of receivers are packed into buckets of at most ``bucket_bytes``; a bucket travels as
one ``broadcast`` when every other rank receives it, else as point-to-point sends, over the process
group (gloo on CPU, NCCL on GPU).

Every bucket carries the weight version and a CRC-32 of its exact bytes, computed by the owner from its
training tensors. A receiver copies the bucket into its generation tensors, then recomputes the CRC from
those tensors (not from the received buffer) and compares; after the last bucket it checks that every
box it needs was written at this version. A mismatch, a stale version or a missing box is an error that
names the bucket, the tensor and the box; every rank learns of it (one all-reduce) and raises, after all
buckets have moved, so no peer is left waiting in a collective.

A rank that only sends (a StaleSync trainer, which holds no generation tensors) can push in the
background (``WeightSync.start``): its buckets are packed at once (copies, with their CRCs), so the
training weights may change as soon as it returns, and a thread sends them and takes part in the
agreement; ``SyncInFlight.wait`` returns the report or raises what the sync raised.

Legend: none (tensors are addressed by name and global box).
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod

import torch
import torch.distributed as dist

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(global offsets, shape) of a hyper-rectangle of one tensor."""
Region = tuple[str, tuple[int, ...], tuple[int, ...]]
"""(tensor name, global offsets, shape): a piece a rank holds or needs."""
HEADER_BYTES = 16
"""int64 weight version, int64 CRC-32 after each bucket's payload."""


class WeightSyncError(RuntimeError):
    """A missed, partial or corrupted sync: generation would run on weights that are not the trained ones."""

    def __init__(self, message: str, failed_rank: int | None = None) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank
        """The group rank whose check failed (None: a plan that cannot be built)."""


@dataclass(frozen=True)
class TensorView:
    """One local tensor as a set of global regions: (global offsets, local view) each."""

    pieces: tuple[tuple[tuple[int, ...], torch.Tensor], ...]


@dataclass(frozen=True)
class Item:
    """One box of one tensor, copied from its owner's source piece into each receiver's needed piece."""

    name: str
    box: Box
    dtype: str
    owner: int
    receivers: tuple[int, ...]
    src_piece: tuple[int, ...]
    """Global offsets of the owner's source piece holding the box."""
    dst_pieces: tuple[tuple[int, ...], ...]
    """Per receiver: global offsets of its needed piece holding the box."""
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    index: int
    owner: int
    receivers: tuple[int, ...]
    """Ranks that copy it into their generation tensors (the owner alone: a local copy)."""
    items: tuple[Item, ...]

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)

    @property
    def is_local(self) -> bool:
        return self.receivers == (self.owner,)


@dataclass(frozen=True)
class SyncFault:
    """Test hook: on ``rank``, the receiving side of bucket ``drop`` is skipped (a lost bucket) and one
    byte of bucket ``corrupt`` is flipped before it is copied (a damaged one)."""

    rank: int
    drop: int | None = None
    corrupt: int | None = None


@dataclass(frozen=True)
class SyncReport:
    """One sync, on this rank."""

    version: int
    buckets: int
    bytes_sent: int
    """Payload bytes this rank sent (once per receiver for point-to-point, once for a broadcast)."""
    bytes_received: int
    bytes_local: int
    checksums_verified: int
    """Buckets whose CRC this rank recomputed from its generation tensors and found equal."""
    seconds: float


@dataclass
class WeightSync:
    """The plan between one training layout and one generation layout, and its execution."""

    buckets: list[Bucket]
    sources: dict[str, TensorView]
    targets: dict[str, TensorView]
    rank: int
    group: dist.ProcessGroup | None = None
    fault: SyncFault | None = None
    written: dict[tuple[str, Box], int] = field(default_factory=dict)

    @classmethod
    def plan(cls, sources: dict[str, TensorView], targets: dict[str, TensorView], bucket_bytes: int,
             group: dist.ProcessGroup | None = None) -> WeightSync:
        """Every rank of ``group`` calls this with its own tensors (one all-gather of their regions)."""
        mine = (_regions(sources), _regions(targets))
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        rank = dist.get_rank(group)
        buckets = build_plan([held for held, _ in everyone], [[r for r, _ in needed] for _, needed in everyone],
                             bucket_bytes)
        return cls(buckets, sources, targets, rank, group)

    @torch.no_grad()
    def run(self, version: int) -> SyncReport:
        """Move every bucket, verify, and raise ``WeightSyncError`` on every rank if any rank failed."""
        start = time.perf_counter()
        sent = received = local = verified = 0
        failures: list[str] = []
        for bucket in self.buckets:
            if self.rank != bucket.owner and self.rank not in bucket.receivers:
                continue
            payload = self._pack(bucket, version) if self.rank == bucket.owner else None
            if bucket.is_local:
                local += bucket.nbytes
            elif self.rank == bucket.owner:
                sent += self._send(bucket, payload)
                continue
            else:
                payload = self._transfer(bucket, payload)
                received += bucket.nbytes
            assert payload is not None
            failure = self._receive(bucket, payload, version)
            failures += [failure] if failure else []
            verified += failure is None and self._received_it(bucket)
        failures += self._missing(version)
        _agree_on_failure(failures, self.rank, self.group)
        return SyncReport(version, len(self.buckets), sent, received, local, verified,
                          time.perf_counter() - start)

    @torch.no_grad()
    def start(self, version: int) -> SyncInFlight:
        """Push ``version`` from a rank that receives nothing: pack every bucket it owns now, then send them
        and agree on the outcome (``run``'s all-reduce) on a thread, beside the caller's next work."""
        if self.targets:
            raise ValueError("a rank that receives generation weights syncs with run(), not in the background")
        start = time.perf_counter()
        packed = [(bucket, self._pack(bucket, version)) for bucket in self.buckets if bucket.owner == self.rank]
        in_flight = SyncInFlight(version, time.perf_counter() - start)

        def send() -> None:
            try:
                sent = local = 0
                for bucket, payload in packed:
                    if bucket.is_local:
                        local += bucket.nbytes
                    else:
                        sent += self._send(bucket, payload)
                _agree_on_failure([], self.rank, self.group)
                in_flight.outcome = SyncReport(version, len(self.buckets), sent, 0, local, 0,
                                               time.perf_counter() - start)
            except BaseException as exc:  # handed to the caller by wait()
                in_flight.outcome = exc

        in_flight.thread = threading.Thread(target=send, name=f"weight-sync-{version}", daemon=True)
        in_flight.thread.start()
        return in_flight

    def planned_bytes(self) -> tuple[list[int], list[int]]:
        """(payload bytes each rank of the group sends, bytes each receives) per sync, by the plan: a
        broadcast counted once for its owner, a point-to-point bucket once per receiver; local copies not."""
        world = dist.get_world_size(self.group)
        sent, received = [0] * world, [0] * world
        for bucket in self.buckets:
            if bucket.is_local:
                continue
            sent[bucket.owner] += bucket.nbytes * (1 if self._broadcasts(bucket) else len(bucket.receivers))
            for receiver in bucket.receivers:
                received[receiver] += bucket.nbytes
        return sent, received

    # ----- one bucket -----
    def _pack(self, bucket: Bucket, version: int) -> torch.Tensor:
        parts = [_bytes(_box_view(self.sources[item.name], item.src_piece, item.box)) for item in bucket.items]
        payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        header = torch.tensor([version, payload_crc(parts)], dtype=torch.int64).view(torch.uint8).to(payload.device)
        return torch.cat([payload, header])

    def _send(self, bucket: Bucket, payload: torch.Tensor) -> int:
        """The owner's side of a bucket that travels: its payload bytes sent (a broadcast counted once, a
        point-to-point bucket once per receiver)."""
        self._transfer(bucket, payload)
        return bucket.nbytes * (1 if self._broadcasts(bucket) else len(bucket.receivers))

    def _broadcasts(self, bucket: Bucket) -> bool:
        # remote receivers never include the owner (it holds the box)
        return len(bucket.receivers) == dist.get_world_size(self.group) - 1

    def _transfer(self, bucket: Bucket, payload: torch.Tensor | None) -> torch.Tensor:
        if payload is None:  # a receiver: it has targets (a pure sender, e.g. a StaleSync trainer, has none)
            device = next(iter(self.targets.values())).pieces[0][1].device
            payload = torch.empty(bucket.nbytes + HEADER_BYTES, dtype=torch.uint8, device=device)
        owner = dist.get_global_rank(self.group, bucket.owner) if self.group is not None else bucket.owner
        if self._broadcasts(bucket):
            dist.broadcast(payload, src=owner, group=self.group)
        elif self.rank == bucket.owner:
            # to every receiver at once (the sends overlap, e.g. across StaleSync's rollout replicas)
            peers = [dist.get_global_rank(self.group, r) if self.group is not None else r
                     for r in bucket.receivers if r != self.rank]
            for work in [dist.isend(payload, dst=peer, group=self.group) for peer in peers]:
                work.wait()
        else:
            dist.recv(payload, src=owner, group=self.group)
        return payload

    def _received_it(self, bucket: Bucket) -> bool:
        return not (self.fault is not None and self.fault.rank == self.rank and self.fault.drop == bucket.index)

    def _receive(self, bucket: Bucket, payload: torch.Tensor, version: int) -> str | None:
        """Copy into the generation tensors, then check the CRC recomputed from them; a failure's text."""
        if not self._received_it(bucket):
            return None  # a lost bucket: the final check finds its boxes unwritten
        fault = self.fault
        if fault is not None and fault.rank == self.rank and fault.corrupt == bucket.index and bucket.nbytes:
            payload = payload.clone()
            payload[0] ^= 0xFF
        body, header = payload[:bucket.nbytes], payload[bucket.nbytes:].view(torch.int64).tolist()
        sent_version, sent_crc = header
        views, offset = [], 0
        slot = bucket.receivers.index(self.rank)
        for item in bucket.items:
            view = _box_view(self.targets[item.name], item.dst_pieces[slot], item.box)
            size = item.nbytes
            view.copy_(body[offset:offset + size].view(_dtype(item.dtype)).view(view.shape))
            views.append(view)
            offset += size
        got = payload_crc([_bytes(view) for view in views])
        if sent_version != version or got != sent_crc:
            what = ", ".join(f"{item.name}{_describe(item.box)}" for item in bucket.items[:3])
            more = f" and {len(bucket.items) - 3} more" if len(bucket.items) > 3 else ""
            return (f"bucket {bucket.index} from rank {bucket.owner} ({what}{more}): "
                    + (f"version {sent_version}, expected {version}" if sent_version != version
                       else f"checksum {got:#010x} of the generation weights, sent {sent_crc:#010x}"))
        for item in bucket.items:
            self.written[(item.name, item.box)] = version
        return None

    def _missing(self, version: int) -> list[str]:
        """Every box this rank needs, written at ``version``?"""
        missing = []
        for bucket in self.buckets:
            if self.rank not in bucket.receivers:
                continue
            for item in bucket.items:
                if self.written.get((item.name, item.box)) != version:
                    missing.append(f"bucket {bucket.index} from rank {bucket.owner}: {item.name}"
                                   f"{_describe(item.box)} not written at version {version}")
                    break
        return missing


@dataclass
class SyncInFlight:
    """A background push (``WeightSync.start``)."""

    version: int
    pack_s: float
    """Seconds the caller spent packing the buckets (copies and CRCs) before the thread took over."""
    thread: threading.Thread | None = None
    outcome: SyncReport | BaseException | None = None

    def wait(self) -> SyncReport:
        """Block until the push has landed and every rank agreed; its report, or what it raised."""
        assert self.thread is not None
        self.thread.join()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        assert self.outcome is not None
        return self.outcome


def build_plan(held: list[list[tuple[Region, str]]], needed: list[list[Region]], bucket_bytes: int) -> list[Bucket]:
    """The buckets (pure function of every rank's regions, so every rank computes the same plan)."""
    holders: dict[Region, list[int]] = {}
    dtypes: dict[str, str] = {}
    for rank, regions in enumerate(held):
        for region, dtype in regions:
            holders.setdefault(region, []).append(rank)
            dtypes[region[0]] = dtype
    by_name: dict[str, list[Region]] = {}
    for region in holders:
        by_name.setdefault(region[0], []).append(region)
    boxes: dict[tuple[Region, Box], dict[int, tuple[int, ...]]] = {}
    order: dict[str, int] = {}
    for rank, regions in enumerate(needed):
        for name, offsets, shape in regions:
            order.setdefault(name, len(order))
            covered = 0
            for source in by_name.get(name, []):
                box = _intersect((offsets, shape), (source[1], source[2]))
                if box is not None:
                    boxes.setdefault((source, box), {})[rank] = offsets
                    covered += prod(box[1])
            if covered != prod(shape):
                raise WeightSyncError(f"no training rank holds all of {name}{_describe((offsets, shape))} "
                                      f"(covered {covered} of {prod(shape)} elements): the layouts do not match")
    return _buckets(_items(boxes, holders, dtypes, order), bucket_bytes)


def _items(boxes: dict[tuple[Region, Box], dict[int, tuple[int, ...]]], holders: dict[Region, list[int]],
           dtypes: dict[str, str], order: dict[str, int]) -> list[Item]:
    """One local item per receiver that holds the box itself, one remote item for the others, whose owner
    is the least-loaded holder (largest boxes assigned first)."""
    load: dict[int, int] = {}
    items = []
    itemsize = {name: _dtype(dtype).itemsize for name, dtype in dtypes.items()}
    keys = sorted(boxes, key=lambda k: (-prod(k[1][1]), order[k[0][0]], k[1]))
    for source, box in keys:
        receivers = boxes[(source, box)]
        ranks = holders[source]
        name, dtype = source[0], dtypes[source[0]]
        nbytes = prod(box[1]) * itemsize[name]
        for rank in sorted(r for r in receivers if r in ranks):
            items.append(Item(name, box, dtype, rank, (rank,), source[1], (receivers[rank],), nbytes))
        remote = sorted(r for r in receivers if r not in ranks)
        if remote:
            owner = min(ranks, key=lambda r: (load.get(r, 0), r))
            load[owner] = load.get(owner, 0) + prod(box[1]) * len(remote)
            items.append(Item(name, box, dtype, owner, tuple(remote), source[1],
                              tuple(receivers[r] for r in remote), nbytes))
    items.sort(key=lambda it: (it.owner, it.receivers, order[it.name], it.box))
    return items


def _buckets(items: list[Item], bucket_bytes: int) -> list[Bucket]:
    buckets: list[Bucket] = []
    current: list[Item] = []
    size = 0
    for item in items:
        same_route = current and (current[0].owner, current[0].receivers) == (item.owner, item.receivers)
        if current and (not same_route or size + item.nbytes > bucket_bytes):
            buckets.append(Bucket(len(buckets), current[0].owner, current[0].receivers, tuple(current)))
            current, size = [], 0
        current.append(item)
        size += item.nbytes
    if current:
        buckets.append(Bucket(len(buckets), current[0].owner, current[0].receivers, tuple(current)))
    return buckets


# ----- helpers -----
def tensor_views(tensors: dict[str, torch.Tensor],
                 pieces_of: Callable[[str, torch.Tensor], list | None] | None = None) -> dict[str, TensorView]:
    """Local tensors as global regions: ``pieces_of`` (``placements.local_pieces``) or whole tensors."""
    views = {}
    for name, tensor in tensors.items():
        pieces = pieces_of(name, tensor) if pieces_of is not None else None
        if pieces is None:
            pieces = [(torch.Size([0] * tensor.ndim), tensor)]
        views[name] = TensorView(tuple((tuple(int(o) for o in offsets), view) for offsets, view in pieces))
    return views


def _regions(views: dict[str, TensorView]) -> list[tuple[Region, str]]:
    return [((name, offsets, tuple(piece.shape)), str(piece.dtype).removeprefix("torch."))
            for name, view in views.items() for offsets, piece in view.pieces]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _intersect(a: Box, b: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)) and lo:
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _box_view(view: TensorView, piece_offsets: tuple[int, ...], box: Box) -> torch.Tensor:
    """The local view of global ``box`` inside the piece at ``piece_offsets``."""
    for offsets, piece in view.pieces:
        if offsets == piece_offsets:
            out = piece
            for dim, (start, size) in enumerate(zip(box[0], box[1])):
                out = out.narrow(dim, start - offsets[dim], size)
            return out
    raise KeyError(f"no piece at {piece_offsets}")


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def payload_crc(parts: list[torch.Tensor]) -> int:
    """CRC-32 of the parts' bytes in order (on the host: a device bucket is copied once for it)."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(part.cpu().numpy().tobytes() if part.numel() else b"", crc)
    return crc


def _describe(box: Box) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(*box)) + "]"


def _agree_on_failure(failures: list[str], rank: int, group: dist.ProcessGroup | None) -> None:
    """Every rank raises when one failed, each with the lowest failing rank's first failure (so whichever
    rank's error a launcher shows, it names the rank, the bucket and the tensor)."""
    flag = torch.tensor([rank if failures else dist.get_world_size(group)], dtype=torch.int64)
    backend_device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    flag = flag.to(backend_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    first = int(flag)
    if first == dist.get_world_size(group):
        return
    text = [failures[0] if rank == first else None]
    dist.broadcast_object_list(text, src=dist.get_global_rank(group, first) if group is not None else first,
                               group=group)
    if failures:
        raise WeightSyncError(f"weight sync failed on rank {rank}: {failures[0]}"
                              + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""), rank)
    raise WeightSyncError(f"weight sync failed on rank {first} (see its error): {text[0]}", first)
