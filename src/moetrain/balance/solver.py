"""Placement solvers: given predicted per-expert loads, place experts and replicas of hot experts on
EP ranks so that the busiest rank is as light as possible.

Objective. In the cost model (``balance.costs``) both the expert GEMMs and the all-to-all of a layer
grow with the busiest rank's token copies, so the solvers minimise ``max_r load_r``; the replica
count, which trades balance against the replicas' gradient all-reduce, is chosen by pricing a few
candidate placements with the full cost model (``plan_placement``).

Solvers:

* ``greedy``: replicate the hottest experts until no single replica exceeds the even share (the
  "redundant experts" step of DeepSeek's EPLB), then longest-processing-time-first packing (Graham
  1969): heaviest replica to the lightest rank with a free slot that does not already hold it;
* ``local``: greedy, then moves and swaps out of the busiest rank while they lower the maximum;
* both finish with the exact token shares among an expert's replicas (a small LP, HiGHS; among the
  shares that reach the least maximum, those with the least load above the mean, so that linked ranks
  that do not decide the maximum keep room for a load that comes out other than forecast);
* ``milp``: the exact mixed-integer program (which expert on which rank, with shares), for small
  instances, to measure how far the fast solvers are from optimal.

Finally ranks are relabelled (an assignment problem) so that as many experts as possible stay where
they are, which is what migration pays for.

Replicas' gradient all-reduces (a ring per replicated expert, the busiest rank's busiest link decides) are
the other cost of replication. Two candidate variants keep them small: bridging that partners light ranks
outside the existing rings first (``bridge_replicas(spread=True)``), so that no rank sends a gradient share
for two rings, and, with EP over several nodes, every candidate whose rings cross nodes with the ranks its
replicas link gathered into one node (``group_replicas_by_node``), so the rings run over the in-node links.
With EP over several nodes the larger replica budgets are also offered with no expert on more ranks than a
node has (``replica_counts(max_replicas=...)``): a longer ring cannot stay in a node.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linear_sum_assignment, linprog, milp
from scipy.sparse import coo_matrix

from moetrain.balance.placement import EMPTY_SLOT, ExpertPlacement
from moetrain.errors import UserError

SOLVERS = ("greedy", "local", "milp")
MILP_MAX_PAIRS = 1024
"""The largest exact program the replay runs (experts × ranks binaries): 128 experts on 8 ranks solve in up to
8 s each on a 2-core machine, and a replay solves every layer at every re-plan."""


def check_solver(solver: str) -> None:
    if solver not in SOLVERS:
        raise UserError(f"unknown solver {solver!r}; choose one of: {', '.join(SOLVERS)}")


def _check_sizes(num_experts: int, num_ranks: int, slots_per_rank: int) -> None:
    if num_ranks * slots_per_rank < num_experts:
        raise UserError(
            f"{num_ranks} ranks × {slots_per_rank} slots cannot hold {num_experts} experts; "
            f"use --slots-per-rank >= {-(-num_experts // num_ranks)}"
        )


def replica_counts(
    loads: np.ndarray, num_ranks: int, budget: int, stop_at_even: bool = True, max_replicas: int | None = None,
    giants_only: bool = False,
) -> np.ndarray:
    """[E] replicas per expert: one each, then up to ``budget`` extra replicas, each for the expert
    whose per-replica load is largest (no expert on more than ``num_ranks`` ranks, nor on more than
    ``max_replicas``). With ``stop_at_even`` it stops once no replica carries more than the even per-rank
    share; beyond that point replicas still help by making the packing finer, at the price of gradient
    all-reduces. With ``giants_only``, only experts whose load exceeds the even share get replicas."""
    loads = np.asarray(loads, dtype=float)
    counts = np.ones(loads.size, dtype=np.int64)
    even = loads.sum() / num_ranks
    most = num_ranks if max_replicas is None else max(1, min(num_ranks, max_replicas))
    allowed = loads > even if giants_only else np.ones(loads.size, dtype=bool)
    for _ in range(budget):
        per_replica = np.where((counts < most) & allowed, loads / counts, -1.0)
        hottest = int(np.argmax(per_replica))
        if per_replica[hottest] < 0 or (stop_at_even and per_replica[hottest] <= even):
            break
        counts[hottest] += 1
    return counts


class UnpackableReplicas(AssertionError):
    """Longest-first packing found no rank for a replica: with every slot used, the last free slots can sit
    on ranks that already hold the expert."""


def _pack_lpt(loads: np.ndarray, counts: np.ndarray, num_ranks: int, slots_per_rank: int) -> np.ndarray:
    """[R, S] slot table: replicas, heaviest first, onto the lightest rank with room and without
    that expert. Ties break on the lowest rank so the result is deterministic."""
    experts = np.repeat(np.arange(loads.size), counts)
    sizes = loads[experts] / counts[experts]
    order = np.lexsort((experts, -sizes))
    table = np.full((num_ranks, slots_per_rank), EMPTY_SLOT, dtype=np.int64)
    used = np.zeros(num_ranks, dtype=np.int64)
    rank_load = np.zeros(num_ranks)
    holds = np.zeros((loads.size, num_ranks), dtype=bool)
    for item in order:
        expert = experts[item]
        open_ranks = (used < slots_per_rank) & ~holds[expert]
        if not open_ranks.any():  # every slot filled, and the last free ones on ranks that hold the expert
            raise UnpackableReplicas("no rank with a free slot for a replica")
        rank = int(np.argmin(np.where(open_ranks, rank_load, np.inf)))
        table[rank, used[rank]] = expert
        used[rank] += 1
        rank_load[rank] += sizes[item]
        holds[expert, rank] = True
    return table


def optimal_shares(table: np.ndarray, loads: np.ndarray, settle: bool = True) -> np.ndarray:
    """[R·S] token shares among replicas that minimise the busiest rank for a fixed slot table (an LP
    over the replicated experts' shares; single-replica experts keep share 1). With ``settle``, a second
    LP picks, among the shares that reach that least maximum, ones with the least load above the mean
    (sum over ranks): linked ranks that do not decide the maximum then sit below it, not at it.

    Candidate families and their bridging overlap, so one plan meets a table under the same loads more
    than once (13 % of the calls within each of 108 plans, 16 to 256 experts on 4 to 64 ranks), and a
    fallback plans again under the same loads: the shares are remembered by table and loads. The programs
    are deterministic, so a remembered answer is the one a new solve gives."""
    table = np.ascontiguousarray(table, dtype=np.int64)
    loads = np.ascontiguousarray(loads, dtype=np.float64)
    return _remembered_shares(table.shape, table.tobytes(), loads.tobytes(), settle).copy()


@functools.lru_cache(maxsize=512)
def _remembered_shares(shape: tuple[int, int], table: bytes, loads: bytes, settle: bool) -> np.ndarray:
    return _solve_shares(np.frombuffer(table, dtype=np.int64).reshape(shape), np.frombuffer(loads, dtype=np.float64),
                         settle)


def _solve_shares(table: np.ndarray, loads: np.ndarray, settle: bool) -> np.ndarray:
    """``optimal_shares``'s two programs. They are small (a row per rank and per replicated expert), so they
    are built dense: building sparse matrices took longer than HiGHS takes to solve them."""
    num_experts = loads.size
    num_ranks, slots_per_rank = table.shape
    flat = table.reshape(-1)
    used = flat != EMPTY_SLOT
    counts = np.bincount(flat[used], minlength=num_experts)
    share = np.zeros(flat.size)
    share[used] = 1.0 / counts[flat[used]]
    replicated = used & (counts[np.where(used, flat, 0)] > 1)
    var_slots = np.flatnonzero(replicated)
    if var_slots.size == 0:
        return share
    single = used & ~replicated
    fixed = np.bincount(np.flatnonzero(single) // slots_per_rank, weights=loads[flat[single]], minlength=num_ranks)
    n = var_slots.size
    scale = max(float(loads.max()), 1e-12)  # keep the LP well scaled
    experts = flat[var_slots]
    uniq, expert_row = np.unique(experts, return_inverse=True)
    # rank_rows[r, i]: the scaled load replicated slot i puts on rank r at share 1
    slot_ranks, slot_loads = var_slots // slots_per_rank, loads[experts] / scale
    rank_rows = np.zeros((num_ranks, n))
    rank_rows[slot_ranks, np.arange(n)] = slot_loads
    sums = np.zeros((uniq.size, n))  # each replicated expert's shares sum to 1
    sums[expert_row, np.arange(n)] = 1.0
    # variables: the shares, then t (the busiest rank's load / scale)
    result = linprog(np.eye(1, n + 1, n).ravel(), A_ub=np.hstack([rank_rows, -np.ones((num_ranks, 1))]),
                     b_ub=-fixed / scale, A_eq=np.hstack([sums, np.zeros((uniq.size, 1))]), b_eq=np.ones(uniq.size),
                     bounds=[(0.0, 1.0)] * n + [(0.0, None)], method="highs")
    if result.status != 0:
        return share  # equal shares are always feasible
    x = np.clip(result.x[:n], 0.0, 1.0)
    if settle:
        # Many share vectors reach the least maximum: the linked ranks that do not decide it may sit at it
        # too, and then look as busy as the one that does (to ``bridge_replicas`` and to the next solve).
        # Among them, the one with the least load above the mean: rank loads <= the maximum just found,
        # minimise sum_r u_r with u_r >= load_r - mean (variables: the shares, then u).
        peak = result.x[n]
        mean = (loads.sum() / num_ranks) / scale
        a_two = np.block([[rank_rows, np.zeros((num_ranks, num_ranks))], [rank_rows, -np.eye(num_ranks)]])
        b_two = np.concatenate([peak - fixed / scale, mean - fixed / scale])
        second = linprog(np.concatenate([np.zeros(n), np.ones(num_ranks)]), A_ub=a_two, b_ub=b_two,
                         A_eq=np.hstack([sums, np.zeros((uniq.size, num_ranks))]), b_eq=np.ones(uniq.size),
                         bounds=[(0.0, 1.0)] * n + [(0.0, None)] * num_ranks, method="highs")
        if second.status == 0:
            x = _no_higher_peak(x, np.clip(second.x[:n], 0.0, 1.0), slot_ranks, slot_loads, fixed / scale, expert_row)
    # renormalise per expert (removes LP round-off) so the placement validates exactly
    totals = np.bincount(expert_row, weights=x, minlength=uniq.size)
    share[var_slots] = x / totals[expert_row]
    return share


def _no_higher_peak(first: np.ndarray, second: np.ndarray, slot_ranks: np.ndarray, slot_loads: np.ndarray,
                    fixed: np.ndarray, expert_row: np.ndarray) -> np.ndarray:
    """``second`` moved back towards ``first`` (a convex combination: still shares that sum to 1) just
    enough that no rank ends above ``first``'s busiest: the settling LP meets its bound only to the
    solver's tolerance, and the least maximum must not rise by that either. Replicated slot i sits on
    rank ``slot_ranks[i]`` and puts ``slot_loads[i]`` on it at share 1; ``fixed``: each rank's other load."""

    def rank_loads(x):
        totals = np.bincount(expert_row, weights=x, minlength=expert_row.max() + 1)
        return np.bincount(slot_ranks, weights=slot_loads * (x / totals[expert_row]), minlength=fixed.size) + fixed

    low, high = rank_loads(first), rank_loads(second)
    peak = low.max()
    over = high > peak
    if not over.any():
        return second
    step = float(np.min((peak - low[over]) / (high[over] - low[over])))
    step = max(0.0, min(1.0, step))
    mixed = first + step * (second - first)
    return mixed if rank_loads(mixed).max() <= peak else first


def _rank_loads(table: np.ndarray, slot_load: np.ndarray) -> np.ndarray:
    return slot_load.reshape(table.shape).sum(axis=1)


def _local_search(
    table: np.ndarray, slot_load: np.ndarray, max_rounds: int = 200, snapshots: tuple[int, ...] = ()
) -> list[np.ndarray]:
    """Moves (into an empty slot) and swaps between the busiest rank and any other, best first,
    while the pair's larger load drops below the current maximum. Replicas move with their share.
    Each round prices every (other rank, hot slot, other slot) exchange at once: [R, S, S].
    Returns the table after each round count in ``snapshots`` that was reached, then the final one
    (each exchange is at most two moves, so early snapshots are cheap-to-reach placements)."""
    table = table.copy()
    taken: list[np.ndarray] = []
    slot_load = slot_load.reshape(table.shape).copy()
    for round_index in range(max_rounds):
        if round_index in snapshots:
            taken.append(table.copy())
        loads = slot_load.sum(axis=1)
        hot = int(np.argmax(loads))
        peak = loads[hot]
        hot_experts = table[hot]
        # delta[o, i, j]: load leaving hot (its slot i) minus load arriving (slot j of rank o)
        delta = slot_load[hot][None, :, None] - slot_load[:, None, :]
        worst = np.maximum(peak - delta, loads[:, None, None] + delta)
        same = hot_experts[None, :, None] == table[:, None, :]
        hot_on_other = (same.any(axis=2) & (hot_experts != EMPTY_SLOT)[None, :])[:, :, None]
        other_on_hot = (same.any(axis=1) & (table != EMPTY_SLOT))[:, None, :]
        # an expert may not end up twice on one rank; two empty slots or no gain are no move
        clash = (hot_on_other | other_on_hot) & ~same
        both_empty = (hot_experts == EMPTY_SLOT)[None, :, None] & (table == EMPTY_SLOT)[:, None, :]
        worst = np.where(clash | both_empty | (delta <= 0), np.inf, worst)
        worst[hot] = np.inf
        other, i, j = np.unravel_index(int(np.argmin(worst)), worst.shape)
        if not peak - worst[other, i, j] > 1e-9 * max(peak, 1.0):
            break
        table[hot, i], table[other, j] = table[other, j], table[hot, i]
        slot_load[hot, i], slot_load[other, j] = slot_load[other, j], slot_load[hot, i]
    return [*taken, table]


def _slot_loads(table: np.ndarray, share: np.ndarray, loads: np.ndarray) -> np.ndarray:
    flat = table.reshape(-1)
    return np.where(flat == EMPTY_SLOT, 0.0, loads[np.maximum(flat, 0)] * share.reshape(-1))


def _equal_shares(table: np.ndarray, num_experts: int) -> np.ndarray:
    flat = table.reshape(-1)
    used = flat != EMPTY_SLOT
    counts = np.bincount(flat[used], minlength=num_experts)
    return np.where(used, 1.0 / np.maximum(counts[np.maximum(flat, 0)], 1), 0.0)


def improve(table: np.ndarray, share: np.ndarray, loads: np.ndarray) -> ExpertPlacement:
    """Local search from a slot table (replicas keep ``share``), then the exact shares."""
    table = _local_search(table, _slot_loads(table, share, loads))[-1]
    return ExpertPlacement.from_slot_experts(loads.size, table, optimal_shares(table, loads))


# Exchange counts at which a warm-started search offers its placement as a candidate: a few moves
# may already take most of the gain, and the caller's score (migration included) decides.
WARM_SNAPSHOTS = (1, 2, 4, 8, 16)


def improve_stepwise(current: ExpertPlacement, loads: np.ndarray) -> list[ExpertPlacement]:
    """Placements along a local search started from ``current``: after 1, 2, 4, ... exchanges and at
    the end, each with exact shares (plus ``current`` with re-optimised shares: no move at all)."""
    table = current.slot_expert.reshape(current.num_ranks, current.slots_per_rank)
    tables = [table, *_local_search(table, _slot_loads(table, current.slot_share, loads), snapshots=WARM_SNAPSHOTS)]
    unique = [t for i, t in enumerate(tables) if not any(np.array_equal(t, u) for u in tables[:i])]
    return [ExpertPlacement.from_slot_experts(loads.size, t, optimal_shares(t, loads)) for t in unique]


MAX_HOT_REPLICAS = 16
"""Replicas ``replicate_hot`` adds at most per plan (each costs one LP for the shares)."""


def replicate_hot(
    current: ExpertPlacement, loads: np.ndarray, ranks_per_node: int | None = None
) -> list[ExpertPlacement]:
    """``current`` plus replicas of its hot experts, for an incremental plan (issue #43).

    Only when some expert's forecast load exceeds what one rank holds at the even share (``replica_counts``
    gives it more replicas than it has). Then replicas are added one at a time, each to the expert whose
    per-replica load is largest (the apportionment of ``replica_counts``, which is exact for the ``replica``
    lower bound of ``balance.bound``), on the lightest rank that does not hold it and has a free slot, or a
    slot held by a *stale* replica (an expert with more replicas than ``replica_counts`` gives it: a formerly
    hot one), which is evicted: evicting moves nothing, and its share goes to the expert's other replicas.
    With ``ranks_per_node``, on a rank in the node of the expert's first replica where one is open: its
    gradient ring then stays on the in-node links the cost model prices, and on a rank in no other hot
    expert's ring where one is open (a rank in two rings sends a gradient share for each). At most
    ``num_ranks`` (and ``MAX_HOT_REPLICAS``) replicas are added, and none that raises the busiest rank (shares
    from the LP). The warm local search alone cannot do
    this (it only moves and swaps slots), nor can bridging (it needs a free slot on the light rank).

    Returns, with exact shares, the placement after each of the first 8 replicas (then after 16), once every
    expert has the replicas ``replica_counts`` gives it, and the one with the lightest busiest rank; each also
    without the stale replicas left (a ring every step; dropping one moves nothing), and the lightest after a
    local search. The caller scores them with their migration and their replicas' gradient rings: fewer
    rings may beat a lighter busiest rank. An empty list when no expert needs a replica."""
    loads = np.asarray(loads, dtype=float)
    r, s, e = current.num_ranks, current.slots_per_rank, current.num_experts
    spare = r * s - e
    if spare <= 0:
        return []
    multi_node = ranks_per_node is not None and 1 < ranks_per_node < r and r % ranks_per_node == 0
    most = ranks_per_node if multi_node else r
    want = replica_counts(loads, r, spare, stop_at_even=True, max_replicas=most)
    table = current.slot_expert.reshape(r, s).copy()
    have = np.bincount(table[table != EMPTY_SLOT], minlength=e)
    if not (want > have).any():
        return []
    growth = _HotReplicaGrowth(loads, want, np.flatnonzero(have > want), most, ranks_per_node if multi_node else None)
    grown = growth.grow(table, current.slot_share, min(spare, r, MAX_HOT_REPLICAS))
    if grown.best is None:
        return []
    return growth.candidates(grown)


@dataclass
class _GrownTables:
    """The slot tables ``replicate_hot`` keeps while it adds replicas."""

    taken: list[np.ndarray] = field(default_factory=list)
    """After each of the first 8 replicas, then after 16."""
    enough: np.ndarray | None = None
    """The first with every expert's ``replica_counts`` replicas."""
    best: np.ndarray | None = None
    """The one with the lightest busiest rank..."""
    best_peak: float = float("inf")
    """...and that rank's load."""


@dataclass(frozen=True)
class _HotReplicaGrowth:
    """What ``replicate_hot`` holds fixed while it adds replicas one at a time."""

    loads: np.ndarray
    """Forecast tokens per expert [E]."""
    want: np.ndarray
    """Replicas per expert from ``replica_counts`` [E]."""
    stale_experts: np.ndarray
    """Experts that started with more replicas than ``want`` (formerly hot): their replicas may be evicted."""
    most: int
    """Replicas an expert may have at most (a node's ranks where the group spans nodes, else every rank)."""
    ranks_per_node: int | None
    """Set only where the group spans several whole nodes: new replicas stay in their expert's node."""

    def grow(self, table: np.ndarray, share: np.ndarray, limit: int) -> _GrownTables:
        """Add up to ``limit`` replicas to ``table`` [R, S] (replicas keep ``share``) while none raises the
        busiest rank, stopping at the even load."""
        mean = self.loads.sum() / table.shape[0]
        peak = float(_rank_loads(table, _slot_loads(table, share, self.loads)).max())
        grown = _GrownTables()
        for added in range(1, limit + 1):
            have = np.bincount(table[table != EMPTY_SLOT], minlength=self.loads.size)
            if grown.enough is None and (have >= self.want).all():
                grown.enough = table.copy()
            target = self._target(table, share, have)
            if target is None:
                break
            expert, rank = target
            trial = table.copy()
            trial[rank, self._slot_for(table, share, have, rank)] = expert
            trial_share = optimal_shares(trial, self.loads, settle=False)
            trial_peak = float(_rank_loads(trial, _slot_loads(trial, trial_share, self.loads)).max())
            if trial_peak > peak * (1.0 + 1e-9):
                break
            table, share, peak = trial, trial_share, trial_peak
            if added <= 8 or added & (added - 1) == 0:  # fewer rings than the best: the caller's score decides
                grown.taken.append(table.copy())
            if grown.best is None or peak < grown.best_peak * (1.0 - 1e-9):
                grown.best, grown.best_peak = table.copy(), peak
            if peak <= mean * (1.0 + 1e-6):
                break
        return grown

    def _surplus(self, have: np.ndarray) -> np.ndarray:
        """Per expert: a stale one that still has more replicas than it wants."""
        was_stale = np.zeros(self.loads.size, dtype=bool)
        was_stale[self.stale_experts] = True
        return was_stale & (have > self.want)

    def _stale_slots(self, table: np.ndarray, have: np.ndarray) -> np.ndarray:
        """[R, S]: slots held by a surplus replica of a stale expert (evicting one moves nothing)."""
        return (table != EMPTY_SLOT) & self._surplus(have)[np.maximum(table, 0)]

    def _target(self, table: np.ndarray, share: np.ndarray, have: np.ndarray) -> tuple[int, int] | None:
        """The expert to replicate next and the rank that takes it; None when no expert has anywhere to go."""
        r = table.shape[0]
        rank_load = _rank_loads(table, _slot_loads(table, share, self.loads))
        openable = ((table == EMPTY_SLOT) | self._stale_slots(table, have)).any(axis=1)
        ringed = (table != EMPTY_SLOT) & (have[np.maximum(table, 0)] > 1) & ~self._surplus(have)[np.maximum(table, 0)]
        # the expert whose per-replica load is largest among those that still have somewhere to go
        per_replica = np.where(have < self.most, self.loads / have, -1.0)
        for expert in np.argsort(-per_replica, kind="stable")[:8]:
            if per_replica[expert] <= 0.0:
                break
            holds = (table == expert).any(axis=1)
            open_ranks = openable & ~holds
            in_ring = (ringed & (table != expert)).any(axis=1)
            if self.ranks_per_node is not None:
                home = int(np.flatnonzero(holds)[0]) // self.ranks_per_node
                in_node = open_ranks & (np.arange(r) // self.ranks_per_node == home)
                open_ranks = in_node if in_node.any() else open_ranks
            if open_ranks.any():
                # ranks in no other expert's ring first: a rank in two rings sends a gradient share for each
                outside = open_ranks & ~in_ring
                pick = outside if outside.any() else open_ranks
                return int(expert), int(np.argmin(np.where(pick, rank_load, np.inf)))
        return None

    def _slot_for(self, table: np.ndarray, share: np.ndarray, have: np.ndarray, rank: int) -> int:
        """The rank's first free slot, else the slot of its lightest stale replica (evicted)."""
        free = np.flatnonzero(table[rank] == EMPTY_SLOT)
        if free.size:
            return int(free[0])
        slot_load = _slot_loads(table, share, self.loads).reshape(table.shape)
        return int(np.argmin(np.where(self._stale_slots(table, have)[rank], slot_load[rank], np.inf)))

    def candidates(self, grown: _GrownTables) -> list[ExpertPlacement]:
        """The kept tables, each also without its stale replicas, with exact shares; plus the best after a
        local search where that is new."""
        assert grown.best is not None
        tables: list[np.ndarray] = []
        for t in [*grown.taken, *([] if grown.enough is None else [grown.enough]), grown.best]:
            if not any(np.array_equal(t, u) for u in tables):
                tables.append(t)
        # the same without the stale replicas: each is a gradient ring every step, and dropping one moves nothing
        tables += [t for t in (_drop_stale(t, self.loads, self.want, self.stale_experts) for t in tables)
                   if t is not None]
        e = self.loads.size
        placements = [ExpertPlacement.from_slot_experts(e, t, optimal_shares(t, self.loads)) for t in tables]
        searched = improve(grown.best, optimal_shares(grown.best, self.loads), self.loads)
        return placements if any(searched == p for p in placements) else [*placements, searched]


def _drop_stale(table: np.ndarray, loads: np.ndarray, want: np.ndarray, experts: np.ndarray) -> np.ndarray | None:
    """``table`` with each of ``experts`` cut back to its ``want`` replicas (the first ones in slot order); None
    when none has more."""
    table = table.copy()
    dropped = False
    for expert in experts:
        ranks, slots = np.nonzero(table == expert)
        for rank, slot in list(zip(ranks, slots))[int(want[expert]):]:
            table[rank, slot] = EMPTY_SLOT
            dropped = True
    return table if dropped else None


def _node_local_pairs(heavy: list[int], light: list[int], ranks_per_node: int) -> list[tuple[int, int]]:
    """Each heavy rank with the lightest unpaired light rank of its own node, where one is left, else
    with the lightest unpaired one anywhere: a bridged expert's gradient all-reduce then stays inside a
    node where it can (the cost model prices in-node all-reduces several times cheaper)."""
    left = list(light)
    pairs = []
    for high in heavy:
        if not left:
            break
        same_node = [low for low in left if low // ranks_per_node == high // ranks_per_node]
        low = same_node[0] if same_node else left[0]
        left.remove(low)
        pairs.append((high, low))
    return pairs


def bridge_replicas(
    placement: ExpertPlacement, loads: np.ndarray, ranks_per_node: int | None = None, spread: bool = False
) -> ExpertPlacement:
    """The placement plus replicas that pair each rank above the mean load with one below it.

    Whole experts are coarse: with ``E/R`` experts per rank, packing alone leaves the busiest rank
    about one expert's load above the mean, and replicas made only for hot experts link few ranks.
    Here the heaviest rank over the mean gets its largest expert (one it can give away, not already
    on the partner) replicated onto the lightest rank with a free slot, the second heaviest onto the
    second lightest, and so on; the LP then splits each bridged expert so that the pair meets in the
    middle. One extra replica per pair: a move and a gradient all-reduce, which the caller's score
    weighs against the time saved. With ``ranks_per_node``, partners are sought inside the heavy
    rank's node first (``_node_local_pairs``).

    With ``spread``, light ranks that hold no replicated expert are partnered first: a rank in two rings
    sends a gradient share for each (``BalanceCostModel.replica_sync_seconds``: the busiest rank decides),
    and the lightest ranks are often those holding a small replica of a giant expert."""
    loads = np.asarray(loads, dtype=float)
    num_ranks, slots = placement.num_ranks, placement.slots_per_rank
    table = placement.slot_expert.reshape(num_ranks, slots).copy()
    slot_load = _slot_loads(table, placement.slot_share, loads).reshape(num_ranks, slots)
    rank_load = slot_load.sum(axis=1)
    mean = rank_load.mean()
    free = (table == EMPTY_SLOT).sum(axis=1)
    heavy = [int(r) for r in np.argsort(-rank_load, kind="stable") if rank_load[r] > mean]
    light = [int(r) for r in np.argsort(rank_load, kind="stable") if rank_load[r] < mean]
    if spread:
        counts = np.bincount(table[table != EMPTY_SLOT], minlength=loads.size)
        in_ring = (counts[np.maximum(table, 0)] > 1) & (table != EMPTY_SLOT)
        linked = in_ring.any(axis=1)
        light = [r for r in light if not linked[r]] + [r for r in light if linked[r]]
    changed = False
    pairs = list(zip(heavy, light)) if ranks_per_node is None else _node_local_pairs(heavy, light, ranks_per_node)
    for high, low in pairs:
        gap = rank_load[high] - rank_load[low]
        if free[low] == 0:
            # A light rank full of small experts: hand its smallest one (that the busy rank lacks)
            # to a free slot of the busy rank first, which frees the slot for the bridge.
            held_high = set(table[high].tolist())
            movable = [(slot_load[low, s], s) for s in range(slots)
                       if table[low, s] != EMPTY_SLOT and int(table[low, s]) not in held_high]
            if free[high] == 0 or not movable:
                continue
            small, slot_low = min(movable)
            table[high, int(np.flatnonzero(table[high] == EMPTY_SLOT)[0])] = table[low, slot_low]
            slot_load[high, int(np.flatnonzero(table[high] == table[low, slot_low])[0])] = small
            table[low, slot_low] = EMPTY_SLOT
            free[high] -= 1
            free[low] += 1
        held_low = set(table[low].tolist())
        # the largest expert on the busy rank the light rank lacks; half the gap must fit in it
        options = [(slot_load[high, s], s) for s in range(slots)
                   if table[high, s] != EMPTY_SLOT and int(table[high, s]) not in held_low]
        if not options:
            continue
        load, slot = max(options)
        if load <= 0.0 or gap <= 0.0:
            continue
        table[low, int(np.flatnonzero(table[low] == EMPTY_SLOT)[0])] = table[high, slot]
        changed = True
    if not changed:
        return placement
    return ExpertPlacement.from_slot_experts(loads.size, table, optimal_shares(table, loads))


def _replica_components(table: np.ndarray) -> list[list[int]]:
    """Ranks linked by replicated experts (two ranks holding replicas of one expert are linked), as
    connected components, each in ring order (breadth first from its lowest rank, neighbours by rank)."""
    num_ranks = table.shape[0]
    parent = list(range(num_ranks))

    def root(rank: int) -> int:
        while parent[rank] != rank:
            parent[rank] = parent[parent[rank]]
            rank = parent[rank]
        return rank

    holders: dict[int, list[int]] = {}
    for rank, expert in zip(*np.nonzero(table != EMPTY_SLOT)):
        holders.setdefault(int(table[rank, expert]), []).append(int(rank))
    neighbours: list[set[int]] = [set() for _ in range(num_ranks)]
    for ranks in holders.values():
        for a, b in zip(ranks, ranks[1:]):
            parent[root(a)] = root(b)
            neighbours[a].add(b)
            neighbours[b].add(a)
    members: dict[int, list[int]] = {}
    for rank in range(num_ranks):
        members.setdefault(root(rank), []).append(rank)
    components = []
    for ranks in members.values():
        order, seen, queue = [], {ranks[0]}, [ranks[0]]
        while queue:
            rank = queue.pop(0)
            order.append(rank)
            for other in sorted(neighbours[rank] - seen):
                seen.add(other)
                queue.append(other)
        components.append(order)
    return components


def rings_cross_nodes(placement: ExpertPlacement, ranks_per_node: int) -> bool:
    """Whether some replicated expert has replicas on ranks of two nodes (its ring all-reduce then has
    hops on the network), nodes being blocks of ``ranks_per_node`` consecutive ranks."""
    ranks = np.arange(placement.num_ranks * placement.slots_per_rank) // placement.slots_per_rank
    used = placement.slot_expert != EMPTY_SLOT
    experts, nodes = placement.slot_expert[used], ranks[used] // ranks_per_node
    lowest = np.full(placement.num_experts, np.iinfo(np.int64).max)
    highest = np.full(placement.num_experts, -1)
    np.minimum.at(lowest, experts, nodes)
    np.maximum.at(highest, experts, nodes)
    return bool((highest > lowest).any())


def group_replicas_by_node(placement: ExpertPlacement, ranks_per_node: int) -> ExpertPlacement:
    """The same placement with its ranks permuted so that ranks sharing a replicated expert share a node
    where they fit: every rank keeps its experts and shares, so every rank's load is unchanged, but the
    replicas' ring all-reduces run over the in-node links (``BalanceCostModel.replica_sync_seconds``
    prices those about twice cheaper than the network) instead of crossing nodes.

    The ranks linked by replicas form connected components; the largest go first, each into the node
    with the most free ranks (first-fit decreasing bin packing, bins of ``ranks_per_node``); a component
    larger than a node, or one no node has room for, is cut in ring order over the emptiest nodes. The
    caller's ``align_to(..., ranks_per_node)`` then maps these nodes onto the current ones (whole nodes to
    whole nodes), so the grouping survives the relabelling that keeps migration small."""
    r, s = placement.num_ranks, placement.slots_per_rank
    if not 1 < ranks_per_node < r or r % ranks_per_node:
        return placement
    table = placement.slot_expert.reshape(r, s)
    components = sorted(_replica_components(table), key=len, reverse=True)
    if len(components) == r:  # no replicas: nothing to group
        return placement
    nodes: list[list[int]] = [[] for _ in range(r // ranks_per_node)]
    for component in components:
        left = list(component)
        while left:
            room = [ranks_per_node - len(node) for node in nodes]
            fits = [i for i, free in enumerate(room) if free >= len(left)]
            # the fullest node it fits in keeps big holes for big components; else the emptiest node
            if fits:
                target = min(fits, key=lambda i: (room[i], i))
            else:
                target = max(range(len(nodes)), key=lambda i: (room[i], -i))
            take = min(room[target], len(left))
            nodes[target].extend(left[:take])
            left = left[take:]
    order = np.array([rank for node in nodes for rank in node], dtype=np.int64)
    if np.array_equal(order, np.arange(r)):
        return placement
    share = placement.slot_share.reshape(r, s)
    return ExpertPlacement.from_slot_experts(placement.num_experts, table[order], share[order])


def solve_fixed_replicas(
    loads: np.ndarray, num_ranks: int, slots_per_rank: int, counts: np.ndarray, solver: str
) -> ExpertPlacement:
    """Placement with the given replica counts by ``greedy`` or ``local``, shares from the LP."""
    loads = np.asarray(loads, dtype=float)
    table = _pack_lpt(loads, counts, num_ranks, slots_per_rank)
    if solver == "local":
        return improve(table, _equal_shares(table, loads.size), loads)
    return ExpertPlacement.from_slot_experts(loads.size, table, optimal_shares(table, loads))


def solve_milp(
    loads: np.ndarray, num_ranks: int, slots_per_rank: int, max_replicas: int | None = None,
    time_limit: float = 10.0,
) -> ExpertPlacement:
    """Exact: minimise the busiest rank's load over which ranks hold each expert (binary) and the
    share each holder serves (continuous), with at most ``slots_per_rank`` experts per rank and at
    most ``max_replicas`` replicas in all (default: every slot may be used)."""
    loads = np.asarray(loads, dtype=float)
    e, r = loads.size, num_ranks
    _check_sizes(e, r, slots_per_rank)
    scale = max(float(loads.max()), 1e-12)
    nx = e * r  # x[e, r] binary, then y[e, r] share, then t
    n = 2 * nx + 1
    cost = np.zeros(n)
    cost[-1] = 1.0
    cost[:nx] = 1e-6  # among optimal placements prefer fewer replicas
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    lower: list[np.ndarray] = []
    upper: list[np.ndarray] = []
    row = 0

    def add(block_rows, block_cols, block_vals, lo, hi, count):
        nonlocal row
        rows.append(np.asarray(block_rows) + row)
        cols.append(np.asarray(block_cols))
        vals.append(np.asarray(block_vals, dtype=float))
        lower.append(np.full(count, lo, dtype=float))
        upper.append(np.full(count, hi, dtype=float))
        row += count

    ex, rk = np.meshgrid(np.arange(e), np.arange(r), indexing="ij")
    idx = (ex * r + rk).reshape(-1)
    # shares of each expert sum to 1
    add(np.repeat(np.arange(e), r), nx + idx, np.ones(nx), 1.0, 1.0, e)
    # y <= x
    add(np.concatenate([np.arange(nx), np.arange(nx)]), np.concatenate([nx + idx, idx]),
        np.concatenate([np.ones(nx), -np.ones(nx)]), -np.inf, 0.0, nx)
    # slots per rank
    add(rk.reshape(-1), idx, np.ones(nx), -np.inf, float(slots_per_rank), r)
    # rank load <= t
    add(np.concatenate([rk.reshape(-1), np.arange(r)]), np.concatenate([nx + idx, np.full(r, n - 1)]),
        np.concatenate([loads[ex.reshape(-1)] / scale, -np.ones(r)]), -np.inf, 0.0, r)
    if max_replicas is not None:
        add(np.zeros(nx, dtype=np.int64), idx, np.ones(nx), -np.inf, float(max_replicas), 1)
    matrix = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(row, n))
    constraints = LinearConstraint(matrix.tocsr(), np.concatenate(lower), np.concatenate(upper))
    integrality = np.concatenate([np.ones(nx), np.zeros(nx + 1)])
    bounds = Bounds(np.zeros(n), np.concatenate([np.ones(2 * nx), [np.inf]]))
    result = milp(cost, constraints=constraints, integrality=integrality, bounds=bounds,
                  options={"time_limit": time_limit})
    if result.x is None:
        raise UserError(f"MILP found no placement within {time_limit}s; use the greedy or local solver")
    holds = result.x[:nx].reshape(e, r) > 0.5
    table = np.full((r, slots_per_rank), EMPTY_SLOT, dtype=np.int64)
    share = np.zeros((r, slots_per_rank))
    for rank in range(r):
        experts = np.flatnonzero(holds[:, rank])
        table[rank, : experts.size] = experts
    placement_share = optimal_shares(table, loads)
    share = placement_share.reshape(r, slots_per_rank)
    return ExpertPlacement.from_slot_experts(e, table, share)


def _holds(table: np.ndarray, num_experts: int) -> np.ndarray:
    """[R, E] 1 where rank r holds expert e (a rank holds an expert at most once; integers: the overlap
    product below then stays off BLAS, whose threads cost more to wake than this small product takes)."""
    holds = np.zeros((table.shape[0], num_experts), dtype=np.int64)
    ranks, slots = np.nonzero(table != EMPTY_SLOT)
    holds[ranks, table[ranks, slots]] = 1
    return holds


def _relabel(overlap: np.ndarray, ranks_per_node: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(new ranks, old ranks) that maximise the experts kept in place (``overlap[new, old]``); with
    ``ranks_per_node``, whole nodes map to whole nodes (nodes first, then ranks inside each pair)."""
    r = overlap.shape[0]
    if ranks_per_node is None or not 1 < ranks_per_node < r or r % ranks_per_node:
        return linear_sum_assignment(-overlap)
    nodes = r // ranks_per_node
    blocks = overlap.reshape(nodes, ranks_per_node, nodes, ranks_per_node)
    node_rows, node_cols = linear_sum_assignment(-blocks.sum(axis=(1, 3)))
    rows, cols = [], []
    for a, b in zip(node_rows, node_cols):
        inner_rows, inner_cols = linear_sum_assignment(-blocks[a, :, b, :])
        rows.extend(a * ranks_per_node + inner_rows)
        cols.extend(b * ranks_per_node + inner_cols)
    return np.asarray(rows), np.asarray(cols)


def align_to(
    placement: ExpertPlacement, current: ExpertPlacement, ranks_per_node: int | None = None
) -> ExpertPlacement:
    """The same placement with ranks relabelled, and experts reordered inside each rank, so that the
    most experts stay in the slot they occupy in ``current`` (ranks are interchangeable for the
    objective; migration is not). With ``ranks_per_node``, ranks that share a node keep sharing one,
    so that replicas packed into a node keep their gradient all-reduce on the in-node links."""
    r, s = placement.num_ranks, placement.slots_per_rank
    new_table = placement.slot_expert.reshape(r, s)
    new_share = placement.slot_share.reshape(r, s)
    old_table = current.slot_expert.reshape(r, s)
    overlap = _holds(new_table, placement.num_experts) @ _holds(old_table, placement.num_experts).T
    rows, cols = _relabel(overlap, ranks_per_node)
    source = np.empty(r, dtype=np.int64)
    source[cols] = rows  # rank t takes the candidate's row source[t]
    experts, shares = new_table[source], new_share[source]
    # an expert rank t already holds keeps its slot; the others fill the free slots in order
    same = (experts[:, :, None] == old_table[:, None, :]) & (experts != EMPTY_SLOT)[:, :, None]  # [R, j, i]
    kept = same.any(axis=2)
    incoming = (experts != EMPTY_SLOT) & ~kept
    free_first = np.argsort(same.any(axis=1), axis=1, kind="stable")  # free slots, ascending, then taken ones
    order = np.maximum(np.cumsum(incoming, axis=1) - 1, 0)
    slot = np.where(kept, same.argmax(axis=2), np.take_along_axis(free_first, order, axis=1))
    placed = experts != EMPTY_SLOT
    ranks = np.broadcast_to(np.arange(r)[:, None], (r, s))
    table = np.full((r, s), EMPTY_SLOT, dtype=np.int64)
    share = np.zeros((r, s))
    table[ranks[placed], slot[placed]] = experts[placed]
    share[ranks[placed], slot[placed]] = shares[placed]
    return ExpertPlacement.from_slot_experts(placement.num_experts, table, share)


@dataclass(frozen=True)
class PlanRequest:
    """What ``plan_placement`` is asked: forecast ``loads`` [E] on ``num_ranks`` × ``slots_per_rank`` slots, the
    solver, the placement now (None: none to stay close to), which candidate families to offer and, with EP
    over several nodes, the ranks per node."""

    loads: np.ndarray
    num_ranks: int
    slots_per_rank: int
    solver: str = "local"
    current: ExpertPlacement | None = None
    candidates: str = "all"
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        """Check the request (one line per bad input); negative loads count as none."""
        check_solver(self.solver)
        object.__setattr__(self, "loads", np.maximum(np.asarray(self.loads, dtype=float), 0.0))
        _check_sizes(self.loads.size, self.num_ranks, self.slots_per_rank)
        if self.candidates not in ("all", "incremental", "scratch"):
            raise UserError(f"unknown candidate set {self.candidates!r}; choose all, incremental or scratch")
        if self.candidates == "incremental" and (self.current is None or self.solver == "milp"):
            raise UserError("an incremental plan needs the current placement and the greedy or local solver")

    @property
    def num_experts(self) -> int:
        return self.loads.size

    @property
    def spare(self) -> int:
        return self.num_ranks * self.slots_per_rank - self.num_experts

    @property
    def node_aware(self) -> bool:
        """Ranks per node given and fewer than the EP ranks: node-local bridging applies."""
        return self.ranks_per_node is not None and 1 < self.ranks_per_node < self.num_ranks

    @property
    def multi_node(self) -> bool:
        """EP over several whole nodes: replica rings may cross nodes, and grouping gathers them."""
        return self.node_aware and self.num_ranks % self.ranks_per_node == 0  # type: ignore[operator]

    @property
    def heuristic(self) -> bool:
        return self.solver != "milp"

    def aligned(self, pool: list[ExpertPlacement]) -> list[ExpertPlacement]:
        """Each candidate relabelled to keep the most experts where ``current`` has them (its least migration)."""
        if self.current is None:
            return pool
        return [align_to(c, self.current, self.ranks_per_node) for c in pool]


def replica_budget_candidates(request: PlanRequest) -> list[ExpertPlacement]:
    """From scratch: the solver's placement for several replica budgets (none, just enough that no replica
    exceeds the even share, half and all of the spare slots, every spare slot to the giants only) and, with EP
    over several nodes, the two larger budgets with at most a node's ranks per expert; the MILP's one. None for
    an incremental plan."""
    if request.candidates == "incremental":
        return []
    loads, num_ranks, slots, spare = request.loads, request.num_ranks, request.slots_per_rank, request.spare
    if not request.heuristic:
        return [solve_milp(loads, num_ranks, slots)]
    needed = int(replica_counts(loads, num_ranks, spare).sum()) - request.num_experts
    budgets = sorted({0, needed, max(needed, spare // 2), spare})
    counts = [replica_counts(loads, num_ranks, budget, stop_at_even=budget <= needed) for budget in budgets]
    # every spare slot to the giants (experts above the even share) and to no other expert: with experts/ep
    # + 1 slots the ranks without a giant cannot take enough experts to reach the mean, so a giant must
    # span more ranks than its load alone asks, and a replica of another expert adds a second ring
    spread = replica_counts(loads, num_ranks, spare, stop_at_even=False, giants_only=True)
    giants_spread = [] if any(np.array_equal(spread, c) for c in counts) else [spread]
    if request.multi_node:
        # the large budgets again with no expert on more ranks than a node has: a ring that fits in a
        # node runs on the in-node links; one over two nodes puts its hops on the network
        for budget in budgets[-2:]:
            capped = replica_counts(loads, num_ranks, budget, stop_at_even=budget <= needed,
                                    max_replicas=request.ranks_per_node)
            if not any(np.array_equal(capped, c) for c in counts):
                counts.append(capped)
    placements = [solve_fixed_replicas(loads, num_ranks, slots, c, request.solver) for c in counts]
    for c in giants_spread:  # with several giants filling every slot the packing can fail: no candidate then
        with contextlib.suppress(UnpackableReplicas):
            placements.append(solve_fixed_replicas(loads, num_ranks, slots, c, request.solver))
    return placements


def warm_start_candidates(request: PlanRequest) -> list[ExpertPlacement]:
    """The steps of a local search started from the current placement (few moves each), for ``local`` or an
    incremental plan; none for a plan from scratch."""
    warm = (request.current is not None and request.candidates != "scratch"
            and (request.solver == "local" or request.candidates == "incremental"))
    return improve_stepwise(request.current, request.loads) if warm else []  # type: ignore[arg-type]


def bridging_candidates(request: PlanRequest, base: list[ExpertPlacement]) -> list[ExpertPlacement]:
    """Each of ``base`` with bridging replicas that pair its heavy ranks with light ones, where that changes it,
    then again with light partners outside the replicas' rings first, where that changes the pairs."""
    if not request.heuristic:
        return []
    plain = [bridge_replicas(c, request.loads) for c in base]
    spread = [bridge_replicas(c, request.loads, spread=True) for c in base]
    spread = [d for c, b, d in zip(base, plain, spread)
              if d is not c and not np.array_equal(d.slot_expert, b.slot_expert)]
    return [b for c, b in zip(base, plain) if b is not c] + spread


def node_bridging_candidates(request: PlanRequest, aligned_base: list[ExpertPlacement]) -> list[ExpertPlacement]:
    """Each of ``aligned_base`` with bridging partners sought in the heavy rank's node first, with EP over
    several nodes: bridged after the relabelling, which would scatter node-local pairs over nodes again."""
    if not (request.heuristic and request.node_aware):
        return []
    return [b for c in aligned_base if (b := bridge_replicas(c, request.loads, request.ranks_per_node)) is not c]


def hot_replica_candidates(request: PlanRequest) -> list[ExpertPlacement]:
    """The replicas a new hot expert lacks, on free slots or on slots of stale replicas (issue #43); built on
    ``current`` slot by slot (no relabelling needed), their shares already split whole experts finely."""
    if request.current is None or request.candidates == "scratch" or not request.heuristic:
        return []
    return replicate_hot(request.current, request.loads, request.ranks_per_node if request.multi_node else None)


def node_grouped_candidates(request: PlanRequest, pool: list[ExpertPlacement]) -> list[ExpertPlacement]:
    """Every candidate whose replicas' rings cross nodes again with the ranks they link gathered into nodes (the
    all-reduces then run in-node), aligned to ``current`` again. All of them, not the best few: a candidate's
    network rings can rank it low before the grouping (bridging pairs the heaviest rank with the lightest
    anywhere) and first after it."""
    if not (request.heuristic and request.multi_node):
        return []
    assert request.ranks_per_node is not None
    grouped: list[ExpertPlacement] = []
    for candidate in pool:
        if not rings_cross_nodes(candidate, request.ranks_per_node):
            continue
        g = group_replicas_by_node(candidate, request.ranks_per_node)
        if g is not candidate and not any(np.array_equal(g.slot_expert, h.slot_expert) for h in grouped):
            grouped.append(g)
    return request.aligned(grouped)


def plan_placement(request: PlanRequest, score: Callable[[ExpertPlacement], float] | None = None) -> ExpertPlacement:
    """Best placement for the request's predicted ``loads`` [E] among the candidate families below, by ``score``
    (the caller's predicted step time, migration included; default: the busiest rank's load).

    ``request.candidates``: ``"all"``; ``"incremental"`` (needs ``current``): only the warm start, the hot
    experts' replicas and their bridging, few moves each and a fraction of the solve time; or ``"scratch"``:
    only the replica budgets (and their bridging).

    Families, in the order they are offered (ties go to the first): ``replica_budget_candidates`` and
    ``warm_start_candidates``; their ``bridging_candidates``; all of these aligned to ``current``, so that each
    one's migration is the least its layout allows; ``node_bridging_candidates`` of the first two families;
    ``hot_replica_candidates``; the best of these is then compared with ``node_grouped_candidates`` of them all
    (EP over several nodes)."""
    base = [*replica_budget_candidates(request), *warm_start_candidates(request)]
    pool = request.aligned([*base, *bridging_candidates(request, base)])
    pool += node_bridging_candidates(request, pool[:len(base)])
    pool += hot_replica_candidates(request)
    if score is None:
        score = lambda p: float(p.apply_to_tokens_per_expert(request.loads).max())
    best = pool[int(np.argmin([score(c) for c in pool]))]
    grouped = node_grouped_candidates(request, pool)
    return min([best, *grouped], key=score) if grouped else best


def timed_plan(request: PlanRequest, score: Callable[[ExpertPlacement], float] | None = None,
               ) -> tuple[ExpertPlacement, float]:
    start = time.perf_counter()
    placement = plan_placement(request, score)
    return placement, time.perf_counter() - start
