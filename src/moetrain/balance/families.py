"""Families of synthetic routing traces, the shapes a placement solver must handle beyond the two it was
written beside (``traces.zipf_trace`` and ``traces.drifting_trace``).

Every family is a per-step popularity ``weights[t, e]`` (how many times more tokens expert e draws than
an expert of weight 1) from which the step's token-expert counts are sampled (a multinomial over
``tokens_per_step · top_k`` draws, as ``traces._sample_loads``). Each layer draws its own hot experts.

* ``zipf``: static Zipf popularity, p ∝ 1/rank^s (s ≈ 0.6 mild, s ≥ 1.5 a few experts take most);
* ``many_hot``: a fraction of the experts (5–20 %) hot at 3–10× the base, a quarter of the hot set
  handed to new experts every ``period`` steps (sudden hand-over);
* ``giant``: a few single experts each above a rank's mean load (1.3–2.5× of total / ranks): no
  placement without replicas can balance them; they change identity every ``period`` steps;
* ``few_hot``: a few very hot experts (0.6–1.6× a rank's mean each) over a mildly skewed background, all
  handed to other experts at once every ``period`` steps (issue #43's trace: giants on one node that swap);
* ``sudden_shift``: the whole hot set (10 % of the experts at 6×) replaced every ``period`` steps;
* ``slow_drift``: every expert's log-popularity is a sine of its own period (200–800 steps): every
  expert drifts, smoothly;
* ``random_walk``: every expert's log-popularity follows an AR(1) walk (correlation 0.995 per step, spread
  1): persistent skew, but each step moves every expert by about 10 % at random, which no forecast
  can foresee;
* ``periodic``: two hot sets that take turns, blended by a sine of period ``period``;
* ``issue_28``: the trace of issue #28 (256 experts, EP8 in its report): 8 % of the experts hot at
  3–6×, two single experts above a rank's mean, the hot set drifting every ``period`` steps.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moetrain.balance.traces import RoutingTrace, TraceShape
from moetrain.errors import UserError


def _zipf(shape: TraceShape, rng: np.random.Generator, exponent: float) -> np.ndarray:
    base = 1.0 / np.arange(1, shape.num_experts + 1) ** exponent
    return np.broadcast_to(rng.permutation(base), (shape.num_steps, shape.num_experts)).copy()


def _many_hot(shape: TraceShape, rng: np.random.Generator, hot_fraction: float, period: int,
              low: float = 3.0, high: float = 10.0) -> np.ndarray:
    e = shape.num_experts
    num_hot = max(1, round(hot_fraction * e))
    order = list(rng.permutation(e))
    hot, cold = order[:num_hot], order[num_hot:]
    heat = dict(zip(hot, rng.uniform(low, high, num_hot)))
    weights = np.ones((shape.num_steps, e))
    for t in range(shape.num_steps):
        if t and t % period == 0:  # a quarter of the hot set hands its heat to cold experts
            for _ in range(max(1, num_hot // 4)):
                leaving = hot.pop(int(rng.integers(len(hot))))
                arriving = cold.pop(int(rng.integers(len(cold))))
                heat[arriving] = heat.pop(leaving)
                hot.append(arriving)
                cold.append(leaving)
        weights[t, list(heat)] = list(heat.values())
    return weights


GIANT_MULTIPLE = (1.3, 2.5)
"""The range a giant's load is drawn from, in multiples of a rank's mean load (total / ranks)."""


def _giant(shape: TraceShape, rng: np.random.Generator, num_giants: int, period: int,
           low: float = GIANT_MULTIPLE[0], high: float = GIANT_MULTIPLE[1]) -> np.ndarray:
    """``num_giants`` experts each carrying ``low``–``high`` × a rank's mean load (total / ranks), over weights
    all 1."""
    background = np.ones((shape.num_steps, shape.num_experts))
    return _giants_over(background, shape.num_ranks, rng, num_giants, period, (low, high))


def _giants_over(background: np.ndarray, num_ranks: int, rng: np.random.Generator, num_giants: int, period: int,
                 multiple_range: tuple[float, float]) -> np.ndarray:
    """``background`` weights [T, E] with ``num_giants`` experts each carrying a multiple of a rank's mean
    load (total / ``num_ranks``) drawn from ``multiple_range``; they change identity every ``period`` steps."""
    weights = background.copy()
    num_steps, e = weights.shape
    giants = rng.choice(e, num_giants, replace=False)
    multiple = rng.uniform(*multiple_range, num_giants)
    for t in range(num_steps):
        if t and t % period == 0:
            giants = rng.choice(e, num_giants, replace=False)
        rest = np.delete(weights[t], giants).sum()
        # weight w of a giant with share m/r of the total: w = (m/r)·(rest + Σ w) → solve the linear system
        share = multiple / num_ranks
        total = rest / (1.0 - share.sum())
        weights[t, giants] = share * total
    return weights


def _few_hot(shape: TraceShape, rng: np.random.Generator, num_hot: int, period: int, low: float = 0.6,
             high: float = 1.6) -> np.ndarray:
    """``num_hot`` very hot experts, each ``low``–``high`` × a rank's mean load (the hottest above it), over
    a background of many mildly hot ones (5 % of the experts at 2–4×); every ``period`` steps the whole very
    hot set is handed to other experts at once, each with a new heat (issue #43's trace)."""
    background = _many_hot(shape, rng, 0.05, 10 * shape.num_steps, low=2.0, high=4.0)
    e, r = shape.num_experts, shape.num_ranks
    weights = background.copy()
    hot = rng.choice(e, num_hot, replace=False)
    multiple = rng.uniform(low, high, num_hot)
    for t in range(shape.num_steps):
        if t and t % period == 0:
            hot = rng.choice(np.setdiff1d(np.arange(e), hot), num_hot, replace=False)
            multiple = rng.uniform(low, high, num_hot)
        share = multiple / r
        rest = np.delete(weights[t], hot).sum()
        weights[t, hot] = share * rest / (1.0 - share.sum())
    return weights


def _sudden_shift(shape: TraceShape, rng: np.random.Generator, period: int) -> np.ndarray:
    e = shape.num_experts
    num_hot = max(1, e // 10)
    weights = np.ones((shape.num_steps, e))
    hot = rng.choice(e, num_hot, replace=False)
    for t in range(shape.num_steps):
        if t and t % period == 0:
            hot = rng.choice(e, num_hot, replace=False)
        weights[t, hot] = 6.0
    return weights


def _random_walk(shape: TraceShape, rng: np.random.Generator, sigma: float = 1.0, rho: float = 0.995) -> np.ndarray:
    e = shape.num_experts
    log_weight = rng.normal(0.0, sigma, e)
    weights = np.empty((shape.num_steps, e))
    innovation = sigma * np.sqrt(1.0 - rho**2)  # keeps the walk's spread at sigma
    for t in range(shape.num_steps):
        weights[t] = np.exp(log_weight)
        log_weight = rho * log_weight + innovation * rng.normal(size=e)
    return weights


def _slow_drift(shape: TraceShape, rng: np.random.Generator, sigma: float = 1.0,
                shortest: float = 200.0, longest: float = 800.0) -> np.ndarray:
    """log-popularity of each expert: a sine of its own period (``shortest``–``longest`` steps) and phase."""
    e = shape.num_experts
    period = rng.uniform(shortest, longest, e)
    phase = rng.uniform(0.0, 2.0 * np.pi, e)
    steps = np.arange(shape.num_steps)[:, None]
    return np.exp(sigma * np.sqrt(2.0) * np.sin(2.0 * np.pi * steps / period + phase))


def _periodic(shape: TraceShape, rng: np.random.Generator, period: int, heat: float = 8.0) -> np.ndarray:
    e = shape.num_experts
    num_hot = max(1, e // 10)
    order = rng.permutation(e)
    first, second = order[:num_hot], order[num_hot : 2 * num_hot]
    weights = np.ones((shape.num_steps, e))
    for t in range(shape.num_steps):
        phase = 0.5 * (1.0 + np.sin(2.0 * np.pi * t / period))
        weights[t, first] += (heat - 1.0) * phase
        weights[t, second] += (heat - 1.0) * (1.0 - phase)
    return weights


def _issue_28(shape: TraceShape, rng: np.random.Generator, period: int) -> np.ndarray:
    hot = _many_hot(shape, rng, 0.08, period, low=3.0, high=6.0)
    return _giants_over(hot, shape.num_ranks, rng, 2, period, GIANT_MULTIPLE)


FAMILIES: dict[str, Callable[..., np.ndarray]] = {
    "zipf": _zipf,
    "many_hot": _many_hot,
    "giant": _giant,
    "few_hot": _few_hot,
    "sudden_shift": _sudden_shift,
    "slow_drift": _slow_drift,
    "random_walk": _random_walk,
    "periodic": _periodic,
    "issue_28": _issue_28,
}


def family_trace(family: str, shape: TraceShape, seed: int, **params: float) -> RoutingTrace:
    """A trace of ``family`` (see the module docstring) with its parameters (``exponent`` for zipf;
    ``hot_fraction``, ``period``, ``num_giants``, ``num_hot``, ``low``, ``high`` for the others), each layer
    from its own generator stream of ``seed``."""
    if family not in FAMILIES:
        raise UserError(f"unknown trace family {family!r}; choose one of: {', '.join(FAMILIES)}")
    if shape.num_experts % shape.num_ranks:
        raise UserError(f"{shape.num_experts} experts do not divide over {shape.num_ranks} ranks")
    rng = np.random.default_rng(seed)
    loads = np.empty((shape.num_steps, shape.num_layers, shape.num_experts), dtype=np.int64)
    for layer in range(shape.num_layers):
        weights = FAMILIES[family](shape, rng, **params)
        probs = weights / weights.sum(axis=1, keepdims=True)
        for t in range(shape.num_steps):
            loads[t, layer] = rng.multinomial(shape.tokens_per_step * shape.top_k, probs[t])
    label = "-".join([family, *(f"{k}{v:g}" for k, v in params.items())])
    return RoutingTrace(np.arange(shape.num_steps), np.arange(shape.num_layers), loads, name=label)
