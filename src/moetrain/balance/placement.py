"""Where each logical expert lives: the table the planner writes and the runtime's dispatcher reads.

An EP group of ``num_ranks`` ranks holds ``slots_per_rank`` expert slots each (the memory budget for
expert weights). Physical slot ``p = rank * slots_per_rank + local_slot``. Every logical expert has at
least one replica; a hot expert may have several, and its tokens are split among them by
``replica_share`` (shares of one expert sum to 1). The replicas' gradients must be summed before the
optimizer step so that they stay identical (the executor's and the runtime's contract).

Torch-free (numpy only): the planner builds thousands of these per second.
Names: ``E`` logical experts, ``R`` ranks, ``S`` slots per rank, ``P = R·S`` physical slots.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from moetrain.errors import UserError

EMPTY_SLOT = -1


@dataclass(frozen=True)
class Move:
    """Copy one expert's weights and optimizer state from one physical slot to another.

    ``src`` is a slot that holds ``expert`` in the old placement; ``dst`` a slot that holds it in the
    new one. Moves are copies: the source slot may itself receive another expert in the same round, so
    the executor must read every source before it writes any destination.
    """

    expert: int
    src: tuple[int, int]
    """(rank, local slot) in the old placement."""
    dst: tuple[int, int]
    """(rank, local slot) in the new placement."""

    @property
    def crosses_ranks(self) -> bool:
        return self.src[0] != self.dst[0]


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """Logical expert → physical slots, with the token share each replica serves."""

    num_experts: int
    num_ranks: int
    slots_per_rank: int
    slot_expert: np.ndarray
    """[P] int64: logical expert in each physical slot, or ``EMPTY_SLOT``."""
    slot_share: np.ndarray
    """[P] float64: share of its expert's tokens the slot serves (0 for empty slots)."""

    def __post_init__(self) -> None:
        slot_expert = np.asarray(self.slot_expert, dtype=np.int64).copy()
        slot_share = np.asarray(self.slot_share, dtype=np.float64).copy()
        slot_expert.setflags(write=False)
        slot_share.setflags(write=False)
        object.__setattr__(self, "slot_expert", slot_expert)
        object.__setattr__(self, "slot_share", slot_share)
        self._validate()

    @functools.cached_property
    def _replica_slots(self) -> tuple[tuple[int, ...], ...]:
        """Each expert's physical slots, in slot order (built on first use: a solver makes many placements
        and reads few of them this way)."""
        replicas: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, expert in enumerate(self.slot_expert.tolist()):
            if expert != EMPTY_SLOT:
                replicas[expert].append(slot)
        return tuple(tuple(r) for r in replicas)

    def _validate(self) -> None:
        e, r, s = self.num_experts, self.num_ranks, self.slots_per_rank
        if e <= 0 or r <= 0 or s <= 0:
            raise UserError(f"placement needs positive sizes, got experts={e}, ranks={r}, slots_per_rank={s}")
        if r * s < e:
            raise UserError(
                f"{r} ranks × {s} slots = {r * s} slots cannot hold {e} experts; raise slots_per_rank to "
                f"at least {-(-e // r)}"
            )
        if self.slot_expert.shape != (r * s,) or self.slot_share.shape != (r * s,):
            raise UserError(
                f"placement tables must have {r * s} entries (ranks × slots), got {self.slot_expert.shape} "
                f"and {self.slot_share.shape}"
            )
        used = self.slot_expert != EMPTY_SLOT
        bad = self.slot_expert[used & ((self.slot_expert < 0) | (self.slot_expert >= e))]
        if bad.size:
            raise UserError(f"placement names expert {int(bad[0])}, outside 0..{e - 1}")
        missing = np.flatnonzero(np.bincount(self.slot_expert[used], minlength=e) == 0)
        if missing.size:
            raise UserError(f"expert {int(missing[0])} has no slot; every expert needs at least one replica")
        if np.any(self.slot_share[~used] != 0.0) or np.any(self.slot_share[used] < 0.0):
            raise UserError("replica shares must be >= 0 for used slots and 0 for empty slots")
        totals = np.bincount(self.slot_expert[used], weights=self.slot_share[used], minlength=e)
        off = np.flatnonzero(np.abs(totals - 1.0) > 1e-9)
        if off.size:
            raise UserError(f"replica shares of expert {int(off[0])} sum to {totals[off[0]]:.6g}, not 1")
        # sorted rows: a repeat sits next to itself (empty slots sort first and are not repeats)
        rows = np.sort(self.slot_expert.reshape(r, s), axis=1)
        repeated = (rows[:, 1:] == rows[:, :-1]) & (rows[:, 1:] != EMPTY_SLOT)
        if repeated.any():
            rank = int(np.flatnonzero(repeated.any(axis=1))[0])
            raise UserError(f"rank {rank} holds two replicas of one expert; replicas must sit on distinct ranks")

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int, slots_per_rank: int | None = None) -> ExpertPlacement:
        """The static layout every EP runtime starts from: experts ``[r·E/R, (r+1)·E/R)`` on rank r,
        in the first slots; spare slots empty."""
        if num_experts % num_ranks:
            raise UserError(f"num_experts={num_experts} is not divisible by ep={num_ranks}; pick ep dividing it")
        per_rank = num_experts // num_ranks
        slots = per_rank if slots_per_rank is None else slots_per_rank
        if slots < per_rank:
            raise UserError(
                f"slots_per_rank={slots} is below the {per_rank} experts each rank must hold; use at least {per_rank}"
            )
        table = np.full((num_ranks, slots), EMPTY_SLOT, dtype=np.int64)
        table[:, :per_rank] = np.arange(num_experts).reshape(num_ranks, per_rank)
        return cls.from_slot_experts(num_experts, table)

    @classmethod
    def from_slot_experts(
        cls, num_experts: int, slot_expert_by_rank: np.ndarray, slot_share: np.ndarray | None = None
    ) -> ExpertPlacement:
        """From a [R, S] table of experts (``EMPTY_SLOT`` for none); equal shares among replicas
        unless ``slot_share`` ([R, S] or [P]) is given."""
        table = np.asarray(slot_expert_by_rank, dtype=np.int64)
        if table.ndim != 2:
            raise UserError(f"slot table must be [ranks, slots], got shape {table.shape}")
        flat = table.reshape(-1)
        if slot_share is None:
            used = flat != EMPTY_SLOT
            counts = np.bincount(flat[used], minlength=num_experts)
            share = np.zeros(flat.shape, dtype=np.float64)
            share[used] = 1.0 / counts[flat[used]]
        else:
            share = np.asarray(slot_share, dtype=np.float64).reshape(-1)
        return cls(num_experts, table.shape[0], table.shape[1], flat, share)

    # ---- queries ------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.num_ranks * self.slots_per_rank

    def rank_slot(self, physical_slot: int) -> tuple[int, int]:
        return divmod(int(physical_slot), self.slots_per_rank)

    def replicas(self, expert: int) -> list[tuple[int, int]]:
        """(rank, local slot) of every replica of ``expert``."""
        return [self.rank_slot(p) for p in self._replica_slots[expert]]

    def num_replicas(self) -> np.ndarray:
        """[E] replica count per expert."""
        return np.bincount(self.slot_expert[self.slot_expert != EMPTY_SLOT], minlength=self.num_experts)

    def slot_of_logical(self) -> np.ndarray:
        """[E] physical slot of each expert's first replica: the dispatcher's table when nothing is
        replicated (then it is a bijection onto the used slots)."""
        return np.array([slots[0] for slots in self._replica_slots], dtype=np.int64)

    def logical_to_physical(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Padded tables for a dispatcher that splits hot experts' tokens among replicas:
        (slots [E, K] padded with -1, counts [E], cumulative shares [E, K] padded with 1.0), K the
        largest replica count. A token of expert e goes to ``slots[e, j]`` for the first j where
        ``u < cum_share[e, j]``, with u a deterministic per-token number in [0, 1)."""
        counts = self.num_replicas()
        width = int(counts.max())
        slots = np.full((self.num_experts, width), -1, dtype=np.int64)
        cum_share = np.ones((self.num_experts, width), dtype=np.float64)
        for expert, phys in enumerate(self._replica_slots):
            slots[expert, : len(phys)] = phys
            cum_share[expert, : len(phys)] = np.cumsum(self.slot_share[list(phys)])
        cum_share[np.arange(self.num_experts), counts - 1] = 1.0  # exact end despite rounding
        return slots, counts, cum_share

    def experts_on_rank(self, rank: int) -> np.ndarray:
        """[S] experts in the slots of ``rank`` (``EMPTY_SLOT`` where none)."""
        return self.slot_expert.reshape(self.num_ranks, self.slots_per_rank)[rank].copy()

    def tokens_per_slot(self, tokens_per_expert: np.ndarray) -> np.ndarray:
        """[..., P] tokens each physical slot computes, for loads [..., E]."""
        loads = np.asarray(tokens_per_expert, dtype=np.float64)
        if loads.shape[-1] != self.num_experts:
            raise UserError(f"loads have {loads.shape[-1]} experts, the placement {self.num_experts}")
        safe = np.where(self.slot_expert == EMPTY_SLOT, 0, self.slot_expert)
        return loads[..., safe] * self.slot_share

    def apply_to_tokens_per_expert(self, tokens_per_expert: np.ndarray) -> np.ndarray:
        """[..., R] tokens each EP rank computes, for loads [..., E] (replicas' shares included)."""
        per_slot = self.tokens_per_slot(tokens_per_expert)
        return per_slot.reshape(*per_slot.shape[:-1], self.num_ranks, self.slots_per_rank).sum(axis=-1)

    def imbalance(self, tokens_per_expert: np.ndarray) -> np.ndarray:
        """max/mean EP-rank load (1.0 is perfect balance), per row of [..., E]."""
        per_rank = self.apply_to_tokens_per_expert(tokens_per_expert)
        mean = per_rank.mean(axis=-1)
        return np.where(mean > 0, per_rank.max(axis=-1) / np.where(mean > 0, mean, 1.0), 1.0)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ExpertPlacement)
            and (self.num_experts, self.num_ranks, self.slots_per_rank)
            == (other.num_experts, other.num_ranks, other.slots_per_rank)
            and np.array_equal(self.slot_expert, other.slot_expert)
            and np.allclose(self.slot_share, other.slot_share, rtol=0, atol=1e-12)
        )

    def __hash__(self) -> int:
        return hash((self.num_experts, self.num_ranks, self.slots_per_rank, self.slot_expert.tobytes()))

    def to_dict(self) -> dict:
        return {
            "num_experts": self.num_experts,
            "num_ranks": self.num_ranks,
            "slots_per_rank": self.slots_per_rank,
            "slot_expert": self.slot_expert.tolist(),
            "slot_share": [round(x, 12) for x in self.slot_share.tolist()],
        }


def diff(old: ExpertPlacement, new: ExpertPlacement) -> list[Move]:
    """The copies that turn ``old`` into ``new``: one per physical slot whose expert changes.

    A slot already holding its new expert costs nothing. Otherwise the source is a replica of the
    expert in ``old``, preferring one on the same rank (a local copy), then the least-used source so
    that reads spread over ranks. Shares changing without the expert changing need no move.
    """
    if (old.num_experts, old.num_ranks, old.slots_per_rank) != (new.num_experts, new.num_ranks, new.slots_per_rank):
        raise UserError(
            "placements differ in shape: "
            f"{(old.num_experts, old.num_ranks, old.slots_per_rank)} vs "
            f"{(new.num_experts, new.num_ranks, new.slots_per_rank)} (experts, ranks, slots per rank)"
        )
    reads = np.zeros(old.num_slots, dtype=np.int64)
    moves: list[Move] = []
    for slot in range(new.num_slots):
        expert = int(new.slot_expert[slot])
        if expert == EMPTY_SLOT or int(old.slot_expert[slot]) == expert:
            continue
        rank = slot // new.slots_per_rank
        sources = old._replica_slots[expert]
        src = min(sources, key=lambda p: (p // old.slots_per_rank != rank, reads[p], p))
        reads[src] += 1
        moves.append(Move(expert, old.rank_slot(src), new.rank_slot(slot)))
    return moves
