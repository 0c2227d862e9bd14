"""Parallel-strategy search: enumerate every layout that divides, score all of them with the
vectorised cost model, drop those that do not fit memory, re-score the best with the event-driven
timeline, and explain why the winner wins.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from moetrain.planner.calibration import Efficiency
from moetrain.planner.costmodel import Workload, evaluate
from moetrain.planner.strategy import Strategies
from moetrain.planner.timeline import simulate_timeline, stage_costs_from_model

MEMORY_LIMIT_FRACTION = 0.95
"""A layout fits when its predicted peak stays under this share of HBM (the rest: allocator slack)."""
BATCH = 250_000
TIE_TOLERANCE = 0.005
"""Layouts whose predicted step times lie within this share of the fastest tie: the simulator cannot rank
them (its error on published runs is several percent), so the tie goes to the layout that needs the least
memory, the headroom that absorbs the memory model's own error, and then to the simpler one (lower ZeRO
stage, less recomputation, fewer virtual stages, no paired schedule)."""


@dataclass
class SearchSpace:
    tp: tuple[int, ...] = (1, 2, 4, 8)
    cp: tuple[int, ...] = (1, 2, 4, 8)
    pp: tuple[int, ...] | None = None
    """None: every divisor of the device count up to the layer count."""
    vpp: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    ep: tuple[int, ...] | None = None
    """None: every divisor of the expert count."""
    etp: tuple[int, ...] = (1, 2, 4, 8)
    zero: tuple[int, ...] = (0, 1, 2, 3)
    micro_batch: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[int, ...] = (0, 1, 2)
    a2a: tuple[int, ...] = (0, 1)
    overlap: tuple[int, ...] = (0, 1)
    sp: tuple[int, ...] = (0, 1)


@dataclass
class SearchResult:
    candidates_evaluated: int
    seconds: float
    feasible: int
    top: Strategies
    top_costs: dict[str, np.ndarray]
    timeline_step_s: list[float]
    explanation: list[str] = field(default_factory=list)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_strategies(w: Workload, devices: int, space: SearchSpace):
    """Yield batches of strategies that divide: world = tp·cp·pp·dp, ep·etp | tp·cp·dp, whole
    micro-batches, interleaving only with pp > 1 and micro-batches divisible by pp."""
    model = w.model
    is_moe = model.moe is not None
    pps = space.pp or tuple(d for d in _divisors(devices) if d <= model.num_layers)
    eps = (space.ep or tuple(_divisors(model.moe.num_experts))) if is_moe else (1,)
    etps = space.etp if is_moe else (1,)
    a2as = space.a2a if is_moe else (0,)
    overlaps = space.overlap if is_moe else (0,)
    rest = np.array(list(itertools.product(space.vpp, eps, etps, space.zero, space.micro_batch,
                                           space.recompute, a2as, overlaps, space.sp)), dtype=np.int64)
    pending: list[Strategies] = []
    pending_len = 0
    for tp, cp, pp in itertools.product(space.tp, space.cp, pps):
        if devices % (tp * cp * pp) or tp > model.attention.num_heads:
            continue
        dp = devices // (tp * cp * pp)
        vpp, ep, etp, zero, mb, rc, a2a, ov, sp = rest.T
        keep = ((tp * cp * dp) % (ep * etp) == 0) & (w.global_batch % (dp * mb) == 0)
        keep &= (vpp == 1) | ((pp > 1) & ((w.global_batch // (dp * mb)) % pp == 0) & (pp * vpp <= model.num_layers))
        keep &= (sp == 0) | (tp > 1)
        if is_moe:
            keep &= (sp == 1) | (tp == 1)  # MoE with TP needs sequence parallelism (Megatron)
            keep &= etp <= tp
            keep &= (a2a == 0) | (ep * etp > w.cluster.devices_per_node)  # hierarchical differs only across nodes
        keep &= (zero == 0) | (dp * cp > 1)
        if w.seq_len % cp:
            continue
        idx = np.nonzero(keep)[0]
        if not idx.size:
            continue
        n = idx.size
        full = lambda v, n=n: np.full(n, v, dtype=np.int64)  # noqa: E731
        pending.append(Strategies(
            tp=full(tp), sp=sp[idx].astype(bool), pp=full(pp), vpp=vpp[idx], ep=ep[idx], etp=etp[idx], cp=full(cp),
            dp=full(dp), zero=zero[idx], micro_batch=mb[idx], recompute=rc[idx], a2a=a2a[idx],
            overlap=ov[idx].astype(bool),
        ))
        pending_len += n
        if pending_len >= BATCH:
            yield _concat(pending)
            pending, pending_len = [], 0
    if pending:
        yield _concat(pending)


def _concat(items: list[Strategies]) -> Strategies:
    from dataclasses import fields

    return Strategies(**{f.name: np.concatenate([getattr(s, f.name) for s in items]) for f in fields(Strategies)})


def search(w: Workload, devices: int, eff: Efficiency, space: SearchSpace | None = None, top_k: int = 10,
           timeline_top: int = 10) -> SearchResult:
    space = space or SearchSpace()
    start = time.perf_counter()
    evaluated = 0
    feasible = 0
    memory_limit = MEMORY_LIMIT_FRACTION * w.cluster.hbm_bytes
    best: Strategies | None = None
    best_step = np.empty(0)
    keep = max(top_k, timeline_top) * 20
    # Best per (dimension, value), to explain the winner against the best alternative of each choice.
    alternatives: dict[tuple[str, int], tuple[float, Strategies]] = {}
    for batch in enumerate_strategies(w, devices, space):
        out = evaluate(w, batch, eff)
        evaluated += len(batch)
        fits = out["memory_bytes"] <= memory_limit
        feasible += int(fits.sum())
        if not fits.any():
            continue
        step = np.where(fits, out["step_time_s"], np.inf)
        for dim in ("tp", "pp", "vpp", "ep", "cp", "zero", "micro_batch", "recompute", "overlap", "a2a"):
            values = getattr(batch, dim).astype(np.int64)
            for v in np.unique(values[fits]):
                masked = np.where(values == v, step, np.inf)
                i = int(np.argmin(masked))
                if (dim, int(v)) not in alternatives or masked[i] < alternatives[(dim, int(v))][0]:
                    alternatives[(dim, int(v))] = (float(masked[i]), batch.take([i]))
        order = np.argsort(step)[:keep]
        order = order[np.isfinite(step[order])]
        chosen = batch.take(order)
        best = chosen if best is None else _concat([best, chosen])
        best_step = np.concatenate([best_step, step[order]])
        trim = np.argsort(best_step)[:keep]
        best, best_step = best.take(trim), best_step[trim]
    seconds_screen = time.perf_counter() - start
    if best is None:
        return SearchResult(evaluated, seconds_screen, 0, _empty(),
                            {}, [], ["no layout fits in memory; add devices, raise recompute or shorten sequences"])
    # Re-score the best with the timeline (bubble and overlap as the schedule really plays out).
    # The analytic screen cannot see how the paired schedule plays out in a pipeline; re-score the best of
    # both kinds so that the timeline decides.
    width = max(top_k, timeline_top)
    picks = np.concatenate([np.nonzero(best.overlap)[0][:width], np.nonzero(~best.overlap)[0][:width]])
    head = best.take(np.sort(picks))
    costs = evaluate(w, head, eff)
    timeline_steps = []
    for i in range(len(head)):
        timeline_steps.append(timeline_step(costs, head, i, eff))
    order = rank_layouts(np.array(timeline_steps), costs["memory_bytes"], head)[:top_k]
    top = head.take(order)
    top_costs = {k: v[order] for k, v in costs.items()}
    steps = [timeline_steps[i] for i in order]
    seconds = time.perf_counter() - start
    result = SearchResult(evaluated, seconds, feasible, top, top_costs, steps)
    result.explanation = explain_tie(steps, top_costs["memory_bytes"]) + explain(w, eff, top, top_costs,
                                                                                 alternatives)
    return result


def rank_layouts(step_s: np.ndarray, memory_bytes: np.ndarray, strategies: Strategies) -> np.ndarray:
    """Order of the layouts, best first: those within ``TIE_TOLERANCE`` of the fastest by memory, then
    ZeRO stage, recompute level, virtual stages and paired schedule; the rest by step time."""
    step_s = np.asarray(step_s, dtype=float)
    tied = step_s <= step_s.min() * (1.0 + TIE_TOLERANCE)
    primary = np.where(tied, np.asarray(memory_bytes, dtype=float), step_s)
    # np.lexsort sorts by its last key first.
    return np.lexsort((step_s, strategies.overlap, strategies.vpp, strategies.recompute, strategies.zero,
                       primary, ~tied))


def explain_tie(step_s: list[float], memory_bytes: np.ndarray) -> list[str]:
    """A line when the winner is not the fastest layout but ties with it (see ``TIE_TOLERANCE``)."""
    fastest = int(np.argmin(step_s))
    if fastest == 0:
        return []
    saved_gib = (float(memory_bytes[fastest]) - float(memory_bytes[0])) / 2**30
    why = f"needs {saved_gib:.3g} GiB less per device" if saved_gib > 0 else "is the simpler of the two"
    return [f"tie: the fastest layout (#{fastest + 1}, {step_s[fastest]:.4g} s) is within {TIE_TOLERANCE:.1%} of "
            f"the winner's {step_s[0]:.4g} s; the winner {why}"]


def _empty() -> Strategies:
    z = np.zeros(0, dtype=np.int64)
    return Strategies(z, z.astype(bool), z, z, z, z, z, z, z, z, z, z, z.astype(bool))


def timeline_step(costs: dict[str, np.ndarray], strategies: Strategies, i: int, eff: Efficiency) -> float:
    """Step time of candidate ``i`` with the pipeline part replayed by the event-driven timeline."""
    pp, vpp = int(strategies.pp[i]), int(strategies.vpp[i])
    num_micro = int(round(costs["num_micro_batches"][i]))
    stage = stage_costs_from_model(costs, i, pp, vpp)
    result = simulate_timeline(pp, vpp, num_micro, stage, bool(strategies.overlap[i]))
    return (result.step_time_s + float(costs["dp_exposed_s"][i]) + float(costs["optimizer_s"][i])
            + eff.step_overhead_ms * 1e-3)


_REASONS = {
    "bubble_s": "pipeline bubble",
    "tp_exposed_s": "exposed tensor-parallel traffic",
    "a2a_exposed_s": "exposed all-to-all",
    "dp_exposed_s": "exposed data-parallel traffic",
    "cp_exposed_s": "exposed context-parallel traffic",
    "pipeline_s": "pipeline time (compute and exposed comm per micro-batch)",
}


def explain(w: Workload, eff: Efficiency, top: Strategies, top_costs: dict[str, np.ndarray],
            alternatives: dict[tuple[str, int], tuple[float, Strategies]]) -> list[str]:
    """One line per search dimension: the winner's choice against the best layout with another value,
    and the cost term that grows the most in that layout."""
    lines = []
    for dim in ("tp", "pp", "vpp", "ep", "cp", "zero", "micro_batch", "recompute", "overlap", "a2a"):
        chosen = int(getattr(top, dim)[0])
        others = [(step, s, v) for (d, v), (step, s) in alternatives.items() if d == dim and v != chosen]
        if not others:
            continue
        step, alt, value = min(others, key=lambda x: x[0])
        alt_costs = evaluate(w, alt, eff)
        growth = {name: float(alt_costs[name][0] - top_costs[name][0]) for name in _REASONS}
        worst = max(growth, key=lambda k: growth[k])
        reason = f"{_REASONS[worst]} +{growth[worst]:.3g} s" if growth[worst] > 0 else "no single term dominates"
        analytic_winner = float(top_costs["step_time_s"][0])
        lines.append(f"{dim}={chosen}: best layout with {dim}={value} is {step / analytic_winner:.2f}x the step "
                     f"time ({reason})")
    return lines
