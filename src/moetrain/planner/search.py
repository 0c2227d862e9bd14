"""Parallel-strategy search: enumerate every layout that divides, score all of them with the
vectorised cost model, drop those that do not fit memory, re-score the best with the event-driven
timeline, and explain why the winner wins: against the best layout of every other choice, and, when the
calibration carries its cross-validation's fits, under each of those fits as well.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, fields

import numpy as np

from moetrain.config.parallel import ParallelConfig, runtime_limits
from moetrain.planner.calibration import Efficiency
from moetrain.planner.costmodel import StepCosts, evaluate
from moetrain.planner.device_memory import GIB
from moetrain.planner.runnable import runnable_mask
from moetrain.planner.strategy import A2A_NAMES, RECOMPUTE_NAMES, Strategies
from moetrain.planner.timeline import simulate_timeline, stage_costs_from_model
from moetrain.planner.workload import Workload

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


@dataclass(frozen=True)
class SearchOptions:
    """What ``search`` searches and how much of it it times and reports."""

    space: SearchSpace = field(default_factory=SearchSpace)
    top_k: int = 10
    """Layouts kept in ``SearchResult.top`` (and ``ranked``)."""
    timeline_top: int = 10
    """The screen's best layouts of each schedule kind that the event-driven timeline times."""
    held_out: dict[str, Efficiency] | None = None
    """The efficiencies of the calibration's cross-validation fits, by the family each leaves out: the
    winner is re-ranked under each (``SearchResult.calibration_check``); None: no check."""
    time_every_choice: bool = True
    """Time the screen's best layout of every value of each choice with the timeline too, not only its best
    overall (off for quick comparisons)."""
    runnable_only: bool = True
    """Rank only layouts the runtime can run (``runtime_limits`` empty); the fastest one left out, if faster,
    is reported in ``SearchResult.excluded``."""


@dataclass
class CalibrationCheck:
    """The winner against the other layouts the search timed (the screen's best and its best layout of
    every value of each choice) under each fit of the calibration's cross-validation: the efficiencies as
    they would be without one source of published runs (``Calibration.held_out_fits``)."""

    fits: list[str]
    """The family each fit leaves out."""
    labels: list[str]
    """The compared layouts (``describe``), in the search's rank order: the winner first."""
    step_s: np.ndarray
    """[fit, layout] step time (timeline) of each compared layout under each fit."""
    seconds: float = 0.0

    def winner_regret_pct(self) -> np.ndarray:
        """Per fit: how much slower the winner is than the best compared layout under that fit, in %."""
        return (self.step_s[:, 0] / self.step_s.min(axis=1) - 1.0) * 100.0

    def best_label(self) -> list[str]:
        """Per fit: the compared layout that is fastest under it."""
        return [self.labels[int(i)] for i in np.argmin(self.step_s, axis=1)]

    def summary(self) -> dict:
        regret = self.winner_regret_pct()
        worst = int(np.argmax(regret))
        return {
            "held_out_fits": len(self.fits),
            "layouts_compared": len(self.labels),
            "max_winner_regret_pct": round(float(regret[worst]), 3),
            "worst_fit_leaves_out": self.fits[worst],
            "best_under_worst_fit": self.best_label()[worst],
            "winner_step_time_s_range": [float(self.step_s[:, 0].min()), float(self.step_s[:, 0].max())],
            "seconds": self.seconds,
        }

    def line(self) -> str:
        """One line for ``moetrain plan``: the winner's worst showing under the fits."""
        s = self.summary()
        head = (f"calibration check: re-ranked under the {s['held_out_fits']} fits that each leave one source of "
                f"published runs out, against {s['layouts_compared'] - 1} other layouts, ")
        if s["max_winner_regret_pct"] < 0.005:
            return head + "the winner is the fastest under every fit"
        if s["max_winner_regret_pct"] <= TIE_TOLERANCE * 100:
            return head + (f"the winner stays within the {TIE_TOLERANCE:.1%} tie of the best under every fit "
                           f"(at most {s['max_winner_regret_pct']:.2f} % slower, without {s['worst_fit_leaves_out']})")
        return head + (f"the winner is at worst {s['max_winner_regret_pct']:.1f} % slower than the best (without "
                       f"{s['worst_fit_leaves_out']}, where {s['best_under_worst_fit']} wins)")


@dataclass
class ExcludedLayout:
    """The fastest fitting layout the runtime cannot run, when it beats the best runnable one."""

    layout: str
    reasons: list[str]
    """``runtime_limits`` of it: the rules that keep the runtime from running it."""
    step_time_s: float | None
    """Its timeline step (None when no runnable layout fits, so nothing was compared)."""
    runnable_step_time_s: float | None

    def line(self) -> str:
        head = f"runtime limits: the fastest layout overall ({self.layout}"
        if self.step_time_s is None or self.runnable_step_time_s is None:
            return f"{head}) is not runnable: {'; '.join(self.reasons)}; --any-layout ranks every layout"
        slower = (self.runnable_step_time_s / self.step_time_s - 1) * 100
        return (f"{head}, {self.step_time_s:.3f} s) is not runnable: {'; '.join(self.reasons)}; the best runnable "
                f"is {self.runnable_step_time_s:.3f} s (+{slower:.1f} %); --any-layout ranks every layout")


@dataclass(frozen=True)
class RankedLayout:
    """One of the search's best layouts, priced at its timeline step."""

    parallel: ParallelConfig
    step_time_s: float
    """The event-driven timeline's step (what the ranking uses)."""
    tokens_per_s: float
    mfu: float
    memory_gib: float


@dataclass
class SearchResult:
    candidates_evaluated: int
    seconds: float
    feasible: int
    top: Strategies
    top_costs: StepCosts | None
    """The analytic costs of ``top`` (None when no layout fits)."""
    timeline_step_s: list[float]
    explanation: list[str] = field(default_factory=list)
    calibration_check: CalibrationCheck | None = None
    excluded: ExcludedLayout | None = None
    """Set when ranking only runnable layouts left out a faster one."""
    not_runnable: int = 0
    """Layouts that fit in memory but that the runtime cannot run (left out unless ``runnable_only`` is off)."""
    ranked: list[RankedLayout] = field(default_factory=list)
    """``top`` in rank order, each at its timeline step."""

    @property
    def candidates_per_minute(self) -> float | None:
        return self.candidates_evaluated / self.seconds * 60 if self.seconds else None


def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, found up to its square root (n may be a device count)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


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
            keep &= (a2a == 0) | (ep * etp > w.cluster.fabric_devices)  # hierarchical differs only across nodes
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
            yield Strategies.concat(pending)
            pending, pending_len = [], 0
    if pending:
        yield Strategies.concat(pending)


@dataclass
class _Screen:
    """What the vectorised screen keeps of the batches it scores: the ``keep`` fastest layouts that fit
    (and run), the fastest of every value of each choice (to explain the winner against the best
    alternative of each), and the fastest fitting layout the runtime cannot run."""

    keep: int
    evaluated: int = 0
    feasible: int = 0
    not_runnable: int = 0
    best: Strategies | None = None
    best_step: np.ndarray = field(default_factory=lambda: np.empty(0))
    alternatives: dict[tuple[str, int], tuple[float, Strategies]] = field(default_factory=dict)
    excluded: tuple[float, Strategies] | None = None

    def add(self, w: Workload, batch: Strategies, out: StepCosts, runnable_only: bool) -> None:
        self.evaluated += len(batch)
        fits = out.memory.total <= MEMORY_LIMIT_FRACTION * w.cluster.hbm_bytes
        if runnable_only:
            runnable = runnable_mask(batch, w.model.num_layers, w.global_batch, w.cluster.devices_per_node)
            left_out = fits & ~runnable
            self.not_runnable += int(left_out.sum())
            if left_out.any():
                i = int(np.argmin(np.where(left_out, out.step_time_s, np.inf)))
                if self.excluded is None or out.step_time_s[i] < self.excluded[0]:
                    self.excluded = (float(out.step_time_s[i]), batch.take([i]))
            fits &= runnable
        self.feasible += int(fits.sum())
        if not fits.any():
            return
        step = np.where(fits, out.step_time_s, np.inf)
        self._track_alternatives(batch, fits, step)
        order = np.argsort(step)[:self.keep]
        order = order[np.isfinite(step[order])]
        chosen = batch.take(order)
        best = chosen if self.best is None else Strategies.concat([self.best, chosen])
        best_step = np.concatenate([self.best_step, step[order]])
        trim = np.argsort(best_step)[:self.keep]
        self.best, self.best_step = best.take(trim), best_step[trim]

    def _track_alternatives(self, batch: Strategies, fits: np.ndarray, step: np.ndarray) -> None:
        for dim in ("tp", "pp", "vpp", "ep", "cp", "zero", "micro_batch", "recompute", "overlap", "a2a"):
            values = getattr(batch, dim).astype(np.int64)
            for v in np.unique(values[fits]):
                masked = np.where(values == v, step, np.inf)
                i = int(np.argmin(masked))
                if (dim, int(v)) not in self.alternatives or masked[i] < self.alternatives[(dim, int(v))][0]:
                    self.alternatives[(dim, int(v))] = (float(masked[i]), batch.take([i]))


def search(w: Workload, devices: int, eff: Efficiency, options: SearchOptions | None = None) -> SearchResult:
    """The best layouts of ``w`` on ``devices`` under ``eff``, searched as ``options`` say (by default: every
    layout of ``SearchSpace``, the ten best timed and kept, only runnable ones ranked, no calibration check)."""
    options = options or SearchOptions()
    top_k, width = options.top_k, max(options.top_k, options.timeline_top)
    start = time.perf_counter()
    screen = _Screen(keep=width * 20)
    for batch in enumerate_strategies(w, devices, options.space):
        screen.add(w, batch, evaluate(w, batch, eff), options.runnable_only)
    best, excluded, not_runnable = screen.best, screen.excluded, screen.not_runnable
    evaluated, feasible, alternatives = screen.evaluated, screen.feasible, screen.alternatives
    seconds_screen = time.perf_counter() - start
    if best is None:
        result = SearchResult(evaluated, seconds_screen, 0, _empty(), None, [],
                              ["no layout fits in memory; add devices, raise recompute or shorten sequences"])
        if excluded is not None:
            result.excluded = _excluded(w, excluded[1], None, eff)
            result.not_runnable = not_runnable
        return result
    # Re-score with the timeline (bubble and overlap as the schedule really plays out), which decides: the
    # screen's best of both schedule kinds and its best layout of every value of each choice, which the
    # timeline may rank above them (the net under the screen's approximations).
    picks = np.concatenate([np.nonzero(best.overlap)[0][:width], np.nonzero(~best.overlap)[0][:width]])
    per_choice = [layout for _, (_, layout) in sorted(alternatives.items())] if options.time_every_choice else []
    pool = _distinct([best.take(np.sort(picks))] + per_choice)
    costs = evaluate(w, pool, eff)
    pool_step = np.array([timeline_step(costs, pool, i, eff) for i in range(len(pool))])
    # The timed layouts in rank order, the winner first; the top are the first ``top_k``.
    ranked = rank_layouts(pool_step, costs.memory.total, pool)
    pool, pool_step, costs = pool.take(ranked), pool_step[ranked], costs.take(ranked)
    top = pool.take(np.arange(min(top_k, len(pool))))
    top_costs = costs.take(np.arange(len(top)))
    steps = [float(x) for x in pool_step[:top_k]]
    check = None
    if options.held_out:
        check_start = time.perf_counter()
        check = CalibrationCheck(list(options.held_out), [describe(pool, i) for i in range(len(pool))],
                                 np.array([_timeline_steps(w, pool, e) for e in options.held_out.values()]))
        check.seconds = time.perf_counter() - check_start
    result = SearchResult(evaluated, 0.0, feasible, top, top_costs, steps, calibration_check=check,
                          not_runnable=not_runnable, ranked=_ranked(w, top, top_costs, steps))
    if excluded is not None and excluded[0] < float(costs.step_time_s[0]):
        left_out = _excluded(w, excluded[1], steps[0], eff)
        if left_out.step_time_s is not None and left_out.step_time_s < steps[0]:
            result.excluded = left_out
    result.explanation = explain_tie(steps, top_costs.memory.total) + explain(pool, costs, pool_step, check)
    cores = w.cluster.host_cores
    if cores is not None and devices > cores:
        result.explanation.append(shared_host_caution(devices, cores))
    result.seconds = time.perf_counter() - start
    return result


def shared_host_caution(ranks: int, cores: int) -> str:
    """The caution under a plan whose ranks outnumber the host's cores: the plan gives each rank its share of
    the cores (``ClusterConfig.for_ranks``), but ranks taking turns on them run slower than that share, more
    so the more of them share a core (``benchmarks/plan_train_check.py``)."""
    return (f"caution: {ranks} ranks share {cores} cores here; the plan gives each its share of them, but ranks "
            "taking turns on cores run slower than that: expect a longer step than planned (docs/quickstart.md)")


def _ranked(w: Workload, top: Strategies, costs: StepCosts, steps: list[float]) -> list[RankedLayout]:
    tokens = w.global_batch * w.seq_len
    return [RankedLayout(top.to_parallel(i), step, tokens / step, float(costs.mfu_at(step)[i]),
                         float(costs.memory.total[i]) / GIB) for i, step in enumerate(steps)]


def _excluded(w: Workload, layout: Strategies, runnable_step_s: float | None, eff: Efficiency) -> ExcludedLayout:
    """The left-out layout, timed like the ranked ones when there is a runnable winner to compare with."""
    reasons = runtime_limits(layout.to_parallel(0), w.model.num_layers, w.global_batch, w.cluster.devices_per_node)
    step = None if runnable_step_s is None else timeline_step(evaluate(w, layout, eff), layout, 0, eff)
    return ExcludedLayout(describe(layout, 0), reasons, step, runnable_step_s)


def _distinct(items: list[Strategies]) -> Strategies:
    """The layouts of ``items``, each once, in first-seen order."""
    merged = Strategies.concat(items)
    keys = np.stack([getattr(merged, f.name).astype(np.int64) for f in fields(Strategies)], axis=1)
    _, first = np.unique(keys, axis=0, return_index=True)
    return merged.take(np.sort(first))


def describe(strategies: Strategies, i: int) -> str:
    """A layout in one short phrase; the all-to-all kind and the paired schedule only when they are on."""
    s = strategies.to_parallel(i)
    parts = [f"tp{s.tp}" + (" sp" if s.sp else ""), f"pp{s.pp}" + (f" vpp{s.vpp}" if s.vpp > 1 else ""),
             f"ep{s.ep}" + (f" etp{s.etp}" if s.etp > 1 else ""), f"cp{s.cp}", f"dp{s.dp}", f"zero{s.zero}",
             f"mb{s.micro_batch}", f"recompute {s.recompute}"]
    if s.a2a == "hierarchical":
        parts.append("hierarchical a2a")
    if s.overlap:
        parts.append("overlap")
    return " ".join(parts)


def _timeline_steps(w: Workload, strategies: Strategies, eff: Efficiency) -> np.ndarray:
    costs = evaluate(w, strategies, eff)
    return np.array([timeline_step(costs, strategies, i, eff) for i in range(len(strategies))])


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


def timeline_step(costs: StepCosts, strategies: Strategies, i: int, eff: Efficiency) -> float:
    """Step time of candidate ``i`` with the pipeline part replayed by the event-driven timeline."""
    pp, vpp = int(strategies.pp[i]), int(strategies.vpp[i])
    num_micro = int(round(costs.num_micro_batches[i]))
    stage = stage_costs_from_model(costs.stages, i, pp, vpp)
    result = simulate_timeline(pp, vpp, num_micro, stage, bool(strategies.overlap[i]))
    return step_after_pipeline(result.step_time_s, costs, i, eff)


def step_after_pipeline(pipeline_s: float, costs: StepCosts, i: int, eff: Efficiency) -> float:
    """A step of candidate ``i``: the pipeline's span, then what follows it (the exposed data-parallel
    traffic, the optimizer update and the fixed per-step overhead)."""
    return pipeline_s + float(costs.dp.exposed_s[i]) + float(costs.optimizer_s[i]) + eff.step_overhead_ms * 1e-3


# The cost terms that can explain why a layout is slower: what each is called, and where it is.
_REASONS = (
    ("pipeline bubble", lambda c: c.pipeline.bubble_s),
    ("exposed tensor-parallel traffic", lambda c: c.pipeline.tp_exposed_s),
    ("exposed all-to-all", lambda c: c.pipeline.a2a_exposed_s),
    ("exposed data-parallel traffic", lambda c: c.dp.exposed_s),
    ("exposed context-parallel traffic", lambda c: c.pipeline.cp_exposed_s),
    ("pipeline time (compute and exposed comm per micro-batch)", lambda c: c.pipeline.pipeline_s),
)
_SCHEDULE_REASON = "pipeline schedule as the timeline replays it, beyond the analytic estimate"


def explain(pool: Strategies, costs: StepCosts, pool_step: np.ndarray,
            check: CalibrationCheck | None = None) -> list[str]:
    """One line per search dimension: the winner (``pool``'s first layout; ``costs`` and ``pool_step`` are
    the analytic costs and timeline steps of the pool) against the fastest timed layout with another value
    of that choice, the cost term that grows the most in it, and, with a calibration check, the same
    ratio's range under the held-out fits."""
    lines = []
    for dim in ("tp", "pp", "vpp", "ep", "cp", "zero", "micro_batch", "recompute", "overlap", "a2a"):
        values = getattr(pool, dim).astype(np.int64)
        others = np.nonzero(values != values[0])[0]
        if not others.size:
            continue
        j = int(others[np.argmin(pool_step[others])])
        growth = {label: float(of(costs)[j] - of(costs)[0]) for label, of in _REASONS}
        # What the timeline adds over the analytic screen (bubble and overlap as the schedule really runs).
        growth[_SCHEDULE_REASON] = float(pool_step[j] - pool_step[0]) - float(costs.step_time_s[j]
                                                                              - costs.step_time_s[0])
        worst = max(growth, key=lambda k: growth[k])
        if pool_step[j] <= pool_step[0] * (1.0 + TIE_TOLERANCE):
            # No term makes the alternative slower; naming the one that grows most would mislead.
            reason = f"a tie within {TIE_TOLERANCE:.1%}, decided by memory, then by the simpler layout"
        elif growth[worst] > 0:
            reason = f"{worst} +{growth[worst]:.3g} s"
        else:
            reason = "no single term dominates"
        line = (f"{dim}={_value_name(dim, values[0])}: best layout with {dim}={_value_name(dim, values[j])} is "
                f"{pool_step[j] / pool_step[0]:.2f}x the step time ({reason})")
        if check is not None:
            ratios = check.step_s[:, j] / check.step_s[:, 0]
            line += f"; {ratios.min():.2f}-{ratios.max():.2f}x under the {len(check.fits)} held-out fits"
        lines.append(line)
    return lines


def _value_name(dim: str, value: int) -> str:
    names = {"recompute": RECOMPUTE_NAMES, "a2a": A2A_NAMES, "overlap": ("off", "on")}
    return names[dim][int(value)] if dim in names else str(int(value))
