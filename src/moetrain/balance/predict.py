"""Per-expert load forecasts from history, and the error that picks between them.

Two families, both O(E) per step and per layer:

* EMA (as in MindSpeed's expert placement: ``pred ← θ·pred + (1−θ)·load``) for stationary loads;
* Holt's linear trend (double exponential smoothing: a level and a slope, each smoothed) for
  loads that drift, e.g. an expert gaining popularity over hundreds of steps;

and ``AdaptivePredictor``, which runs a bank of them side by side and forecasts with the one whose
recent forecasts were best: no choice made up front from a trace's first steps, and a switch when the
load's behaviour changes (a stationary skew, then a hot set that cycles or wanders).

``forecast_error`` replays a trace and measures, for every step after a warm-up, the error of the
forecast of the mean load over the next ``horizon`` steps (the steps a placement will serve):
sum |forecast − actual| / sum actual, over experts, layers and steps (0 = perfect; predicting zero
load scores 1). ``select_predictor`` picks the candidate with the smallest error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetrain.errors import UserError


@dataclass(frozen=True)
class EMAPredictor:
    """``level ← θ·level + (1−θ)·load``; forecasts are flat."""

    theta: float = 0.9

    def __post_init__(self) -> None:
        if not 0.0 <= self.theta < 1.0:
            raise UserError(f"EMA theta={self.theta} must be in [0, 1)")

    @property
    def name(self) -> str:
        return f"ema(theta={self.theta:g})"

    def init_state(self, load: np.ndarray) -> dict[str, np.ndarray]:
        return {"level": np.asarray(load, dtype=float).copy()}

    def update(self, state: dict[str, np.ndarray], load: np.ndarray) -> None:
        state["level"] = self.theta * state["level"] + (1.0 - self.theta) * np.asarray(load, dtype=float)

    def forecast(self, state: dict[str, np.ndarray], horizon: int) -> np.ndarray:
        """Mean predicted load over the next ``horizon`` steps."""
        return state["level"].copy()


@dataclass(frozen=True)
class HoltPredictor:
    """Holt's linear method: level ← α·load + (1−α)(level + slope); slope ← β(level − level_prev) +
    (1−β)·slope. The mean over the next h steps is level + slope·(h+1)/2, clipped at zero."""

    alpha: float = 0.3
    beta: float = 0.05

    def __post_init__(self) -> None:
        if not (0.0 < self.alpha <= 1.0 and 0.0 <= self.beta <= 1.0):
            raise UserError(f"Holt alpha={self.alpha}, beta={self.beta} must be in (0, 1] and [0, 1]")

    @property
    def name(self) -> str:
        return f"holt(alpha={self.alpha:g},beta={self.beta:g})"

    def init_state(self, load: np.ndarray) -> dict[str, np.ndarray]:
        load = np.asarray(load, dtype=float)
        return {"level": load.copy(), "slope": np.zeros_like(load)}

    def update(self, state: dict[str, np.ndarray], load: np.ndarray) -> None:
        load = np.asarray(load, dtype=float)
        previous = state["level"]
        level = self.alpha * load + (1.0 - self.alpha) * (previous + state["slope"])
        state["slope"] = self.beta * (level - previous) + (1.0 - self.beta) * state["slope"]
        state["level"] = level

    def forecast(self, state: dict[str, np.ndarray], horizon: int) -> np.ndarray:
        return np.maximum(state["level"] + state["slope"] * (horizon + 1) / 2.0, 0.0)


SimplePredictor = EMAPredictor | HoltPredictor

DEFAULT_CANDIDATES: tuple[SimplePredictor, ...] = (
    EMAPredictor(0.5),
    EMAPredictor(0.8),
    EMAPredictor(0.9),
    EMAPredictor(0.99),
    HoltPredictor(0.3, 0.05),
    HoltPredictor(0.5, 0.1),
)

ADAPTIVE_CANDIDATES: tuple[SimplePredictor, ...] = (EMAPredictor(0.0), *DEFAULT_CANDIDATES, HoltPredictor(0.8, 0.3))
"""The bank ``AdaptivePredictor`` runs: from the last step's load (θ = 0, for loads that wander at random)
to a near-static mean (θ = 0.99), and trends from slow drifts to fast cycles (α = 0.8, β = 0.3)."""
ERROR_SMOOTHING = 0.2
"""Weight of the newest step in each candidate's running forecast error (a mean over about 5 steps)."""


@dataclass(frozen=True)
class AdaptivePredictor:
    """Every candidate of ``candidates`` absorbs every step (each O(E)); before it does, each one's
    one-step forecast is scored against the step's load (|forecast − load| summed over experts, over the
    load's sum) and the score enters a running mean (``smoothing``). The forecast is the candidate's
    with the lowest running error; ties go to the earliest candidate.

    The state is flat (``"<i>.<name>"`` for candidate i's arrays, ``"error"`` [C]), so the runtime
    checkpoints it as it does a single predictor's."""

    candidates: tuple[SimplePredictor, ...] = ADAPTIVE_CANDIDATES
    smoothing: float = ERROR_SMOOTHING

    def __post_init__(self) -> None:
        if not self.candidates:
            raise UserError("an adaptive predictor needs at least one candidate")
        if not 0.0 < self.smoothing <= 1.0:
            raise UserError(f"adaptive predictor smoothing={self.smoothing} must be in (0, 1]")

    @property
    def name(self) -> str:
        """``adaptive`` for the default bank and smoothing; otherwise both spelled out (checkpoints
        restore a predictor's state only under the same name)."""
        if self.candidates == ADAPTIVE_CANDIDATES and self.smoothing == ERROR_SMOOTHING:
            return "adaptive"
        return f"adaptive({'|'.join(p.name for p in self.candidates)};smoothing={self.smoothing:g})"

    def _states(self, state: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        split: list[dict[str, np.ndarray]] = [{} for _ in self.candidates]
        for key, value in state.items():
            index, dot, name = key.partition(".")
            if dot:
                split[int(index)][name] = value
        return split

    def init_state(self, load: np.ndarray) -> dict[str, np.ndarray]:
        state = {"error": np.zeros(len(self.candidates))}
        for i, candidate in enumerate(self.candidates):
            state.update({f"{i}.{k}": v for k, v in candidate.init_state(load).items()})
        return state

    def update(self, state: dict[str, np.ndarray], load: np.ndarray) -> None:
        load = np.asarray(load, dtype=float)
        total = max(float(load.sum()), 1e-12)
        errors = state["error"].copy()
        for i, (candidate, own) in enumerate(zip(self.candidates, self._states(state))):
            miss = float(np.abs(candidate.forecast(own, 1) - load).sum()) / total
            errors[i] += self.smoothing * (miss - errors[i])
            candidate.update(own, load)
            state.update({f"{i}.{k}": v for k, v in own.items()})
        state["error"] = errors

    def chosen(self, state: dict[str, np.ndarray]) -> SimplePredictor:
        """The candidate the forecast comes from now."""
        return self.candidates[int(np.argmin(state["error"]))]

    def forecast(self, state: dict[str, np.ndarray], horizon: int) -> np.ndarray:
        index = int(np.argmin(state["error"]))
        return self.candidates[index].forecast(self._states(state)[index], horizon)


Predictor = EMAPredictor | HoltPredictor | AdaptivePredictor

def forecasts(predictor: Predictor, loads: np.ndarray, horizon: int) -> np.ndarray:
    """[T, ...] forecast made after seeing steps 0..t of ``loads`` [T, ...] (row t predicts the mean
    of steps t+1..t+horizon)."""
    loads = np.asarray(loads, dtype=float)
    out = np.empty_like(loads)
    state = predictor.init_state(loads[0])
    out[0] = predictor.forecast(state, horizon)
    for t in range(1, loads.shape[0]):
        predictor.update(state, loads[t])
        out[t] = predictor.forecast(state, horizon)
    return out


def future_means(loads: np.ndarray, horizon: int) -> np.ndarray:
    """[T-horizon, ...] mean of steps t+1..t+horizon, for t = 0..T-horizon-1."""
    loads = np.asarray(loads, dtype=float)
    csum = np.concatenate([np.zeros_like(loads[:1]), np.cumsum(loads, axis=0)])
    num = loads.shape[0] - horizon
    return (csum[horizon + 1 : horizon + 1 + num] - csum[1 : 1 + num]) / horizon


def forecast_error(predictor: Predictor, loads: np.ndarray, horizon: int = 1, warmup: int = 5) -> float:
    """Relative L1 error of the predictor's ``horizon``-step mean forecast over a trace [T, L, E]."""
    loads = np.asarray(loads, dtype=float)
    if loads.shape[0] <= warmup + horizon:
        raise UserError(
            f"trace has {loads.shape[0]} steps; forecast error needs more than warmup {warmup} + horizon {horizon}"
        )
    predicted = forecasts(predictor, loads, horizon)[warmup : loads.shape[0] - horizon]
    actual = future_means(loads, horizon)[warmup:]
    return float(np.abs(predicted - actual).sum() / max(actual.sum(), 1e-12))


def select_predictor(
    loads: np.ndarray,
    horizon: int = 1,
    candidates: tuple[SimplePredictor, ...] = DEFAULT_CANDIDATES,
    warmup: int = 5,
) -> tuple[Predictor, dict[str, float]]:
    """The candidate with the lowest ``forecast_error`` on ``loads``, and every candidate's error."""
    errors = {p.name: forecast_error(p, loads, horizon, warmup) for p in candidates}
    best = min(candidates, key=lambda p: (errors[p.name], p.name))
    return best, errors


def parse_predictor(text: str) -> Predictor:
    """``adaptive``, ``ema:THETA`` or ``holt:ALPHA,BETA`` (the spelling of ``moetrain balance --predictor`` and of
    ``BalanceDefaults.predictor``); ``auto`` is the CLI's own (it selects on the trace's first quarter)."""
    kind, _, values = text.partition(":")
    if text == "adaptive":
        return AdaptivePredictor()
    try:
        if kind == "ema" and values:
            return EMAPredictor(float(values))
        if kind == "holt" and values:
            alpha, beta = (float(x) for x in values.split(","))
            return HoltPredictor(alpha, beta)
    except ValueError:
        pass
    raise UserError(f"--predictor {text!r}: expected adaptive, auto, ema:THETA (e.g. ema:0.9) or holt:ALPHA,BETA")
