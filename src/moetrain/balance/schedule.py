"""When to re-plan a layer's expert placement, and the plan-and-trigger step itself.

One rule, shared by the trace replay (``balance.replay``) and the runtime
(``distributed.balancing.OnlineExpertBalancer``), for every layer and every trace:

1. **A cheap check after every step.** The predictor's forecast of the load over the plan's expected
   life is priced twice by the cost model: under the current placement and under the perfectly even
   ideal. Their difference is the current placement's *excess*, per step. It costs two cost-model
   evaluations (about a millisecond), no solve.
2. **Solve when it can pay.** A re-plan can at best bring the excess back to the level the solver
   reached at the last plan (the *reference*: the adopted plan's excess on its forecast, or the
   current placement's when the trigger kept it). Part of any forecast excess is noise: after each
   step the check prices the placement that ran on the step's actual load and keeps a running mean
   of |realized − predicted excess| (the *forecast noise*, in seconds per step). The check asks the
   solver for an incremental plan when the recoverable time beyond that noise, over ``horizon``
   steps, exceeds the cheapest migration there is (one expert moved between two ranks of one node);
   a full re-plan runs every ``interval`` steps regardless (it also catches changes the reference
   cannot see). Stationary loads keep the excess at its reference, so they are solved every
   ``interval`` steps as before; a load that drifts is re-planned as soon as the drift has cost
   more than a move.
3. **Forecast at the middle of the plan's life.** An incremental plan serves the steps until the next
   solve: its expected life is the spacing of the last two solves (at most ``interval``), and the
   forecast is the predicted mean over that life (for Holt's trend, the value at its midpoint), not
   the load now. A full re-plan forecasts the ``interval`` steps until the next full one.
4. **Trigger.** The planner's candidates include incremental moves (a local search warm-started from
   the current placement, after 1, 2, 4, ... exchanges) beside full re-plans; each is scored by the
   cost model with its migration time spread over ``horizon``. Early (drift-triggered) solves offer
   only the incremental candidates; full re-plans offer all. The chosen plan migrates when its
   saving over ``horizon`` steps, less ``horizon`` × the forecast noise, exceeds ``trigger_margin`` ×
   its migration time; a plan that only changes replicas' token shares moves no weights and is
   applied whenever it saves time.
5. **A saving lasts as long as the skew does.** Every "over ``horizon`` steps" above counts
   ``lasting_steps``, not ``horizon``: the sum over k < horizon of ρ^k, where ρ is the running lag-1
   correlation of the experts' load deviations from their mean (``LayerSchedule.persistence``). A
   stationary or slowly drifting skew has ρ near 1 and keeps the whole horizon; a hot set that
   changes from step to step (routing noise, a router whose balance loss pulls load back) has a small ρ
   and pays for few moves.
6. **A jump in the load mix is a shift** (``LayerSchedule.observe_shift``, issue #28): the predictor
   restarts from the step's load, the step's miss counts neither as forecast noise nor as fading
   skew, and a full re-plan runs at once.
7. **Global fallback.** An incremental plan that stays ``FALLBACK_GAP`` of the ideal's time further
   from the ideal than the last solve left the layer has stalled in a local optimum: the placements
   from scratch are scored beside it (``Decision.fallback``), migration included, and the trigger
   still decides.
8. **Count noise, where it is the forecast's error.** A step's tokens per expert are counts: even a perfect
   forecast of the mean misses them by about its square root. A placement with many ranks at its maximum
   loses more to that than one whose maximum is a single rank. Where the measured forecast noise is at most
   ``COUNT_NOISE_GATE`` (1.5) × what the count noise alone causes (stationary loads; it is measured from the first
   plan on), candidates and the trigger's
   saving are priced as the cost model's mean over ``COUNT_NOISE_SAMPLES`` loads drawn around the forecast
   (``count_noise_samples``), not on the forecast itself (``Decision.count_noise``). Where the forecast
   misses by more (a walk, a drift, a router's own noise), the draws would price the wrong noise, and the
   forecast alone prices the candidates as before. Only where the expert-parallel group spans more than one
   node: there the node-aware candidates bridge replicas between ranks that then share the maximum, and the
   draws choose among them (giants on EP64 5.25 % → 4.81 % from the ideal); within one node (EP ≤ ranks per
   node) they only ever cost a little on the benchmark's traces (the recorded tiny-pangu traces, the sudden
   shift, many-hot 5 %: benchmarks/notes/balance.md, "Trace families"), choosing among near-ties on eight noisy draws.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from enum import StrEnum

import numpy as np

from moetrain.balance.bound import ImbalanceBound, imbalance_bound
from moetrain.balance.costs import BalanceCostModel, OverlapWindow
from moetrain.balance.online import BALANCE_DEFAULTS
from moetrain.balance.placement import ExpertPlacement, Move, diff
from moetrain.balance.predict import Predictor
from moetrain.balance.solver import PlanRequest, check_solver, timed_plan
from moetrain.errors import UserError

NOISE_SMOOTHING = 0.2
"""Weight of the newest step in ``LayerSchedule.forecast_noise`` (a running mean over about 5 steps)."""
PERSISTENCE_SMOOTHING = 0.1
"""Weight of the newest step in the running lag-1 statistics behind ``LayerSchedule.persistence``."""
SHIFT_FACTOR = 4.0
"""A step whose load mix moved this many times more than the running mean change is a *shift*."""
SHIFT_FLOOR = 0.02
"""...and moved at least this share of the tokens (total variation), so sampling noise is never one."""
SHIFT_WARMUP = 3
"""Step-to-step changes seen before a shift can be called (the running mean needs a few)."""
FALLBACK_GAP = 0.02
"""An incremental plan this much (relative to the ideal's step time) further from the ideal than the last
solve's plan was asks for a global solve."""
COUNT_NOISE_SAMPLES = 8
"""Loads drawn around the forecast when candidates are priced under count noise (rule 8)."""
COUNT_NOISE_GATE = 1.5
"""Count noise prices the candidates while the measured forecast noise is at most this many times the step-time
noise that the count noise alone causes on the current placement."""
AT_BOUND_TOLERANCE = 0.01
"""A kept placement whose forecast max/mean is within this fraction of the lower bound counts as at the bound."""


class KeepReason(StrEnum):
    """Why a solve kept the current placement (``Decision.keep_reason``): a closed set."""

    BELOW_THRESHOLD = "below the threshold"
    """The candidate moves weights and saves time, but not more than the forecast noise over the same steps
    (``Decision.noise_s``): the saving may be noise, and the trigger counts only what lasts beyond it."""
    COST_EXCEEDS_SAVING = "cost exceeds saving"
    """The saving beyond the noise does not exceed ``trigger_margin`` × the migration time."""
    AT_BOUND = "no better candidate: at the bound"
    """No candidate saves time, and the current placement is within ``AT_BOUND_TOLERANCE`` of the lower bound
    (``Decision.bound``): nothing better exists."""
    STUCK = "no better candidate: stuck above the bound"
    """No candidate saves time, yet the lower bound leaves room: the solver's candidates miss a better one."""


def keep_reason(moves: bool, saving_s: float, noise_s: float, imbalance_current: float,
                bound: ImbalanceBound) -> KeepReason:
    """The reason for a solve that neither migrates nor reshares (rules 4 and 5 of the module docstring)."""
    if moves and saving_s > 0.0:
        return KeepReason.BELOW_THRESHOLD if saving_s <= noise_s else KeepReason.COST_EXCEEDS_SAVING
    if imbalance_current <= bound.value * (1.0 + AT_BOUND_TOLERANCE):
        return KeepReason.AT_BOUND
    return KeepReason.STUCK


def count_noise_samples(forecast: np.ndarray, num_samples: int = COUNT_NOISE_SAMPLES, seed: int = 0) -> np.ndarray:
    """[num_samples, E] loads drawn around ``forecast`` [E] with a count's spread: forecast + √forecast · z,
    z standard normal (the normal limit of a Poisson count with that mean), clipped at 0. A fixed ``seed``:
    every candidate of a solve is priced on the same draws, and a solve is repeatable."""
    mean = np.maximum(np.asarray(forecast, dtype=float), 0.0)
    z = np.random.default_rng(seed).standard_normal((num_samples, mean.size))
    return np.maximum(mean + np.sqrt(mean) * z, 0.0)


@dataclass(frozen=True)
class Decision:
    """One solve (a trigger evaluation) for one layer."""

    step: int
    layer: int
    migrate: bool
    predicted_saving_s: float
    """Forecast step-time saving of the candidate placement, over ``lasting_steps``."""
    migration_s: float
    """Predicted time to move the experts' weights and optimizer state."""
    moves: tuple[Move, ...]
    """The candidate's copies (``placement.diff``; carried out only when ``migrate``)."""
    imbalance_current: float
    """Forecast max/mean rank load with the current placement."""
    imbalance_candidate: float
    solve_ms: float
    """Wall-clock time of the solve (both solves with a fallback)."""
    reshare: bool = False
    """Only replicas' token shares change (no weights move): applied for free."""
    early: bool = False
    """Solved before ``interval`` steps had passed, because the drift since the last plan could pay a move."""
    forecast_steps: int = 0
    """Steps the forecast averages over (the plan's expected life)."""
    lasting_steps: float = 0.0
    """Steps the saving was counted over (``ReplanRule.lasting_steps``: the horizon, shortened when the
    load skew does not persist)."""
    gap_candidate: float = 0.0
    """The candidate's forecast layer time over the ideal's, minus 1: how far from even it still is."""
    fallback: bool = False
    """The incremental search stayed more than ``FALLBACK_GAP`` above the ideal, so a global solve ran."""
    solve_cpu_ms: float = 0.0
    """This process's CPU time for the same solves: on a host shared with other jobs the wall clock counts
    their time too."""
    shift: bool = False
    """The load mix jumped (see ``LayerSchedule.observe_shift``): the forecast restarted from the step's load."""
    count_noise: bool = False
    """Candidates and the saving were priced under count noise (rule 8 of the module docstring)."""
    noise_s: float = 0.0
    """The part of a saving the trigger discounts as forecast noise: ``lasting_steps`` × the forecast noise."""
    bound: ImbalanceBound | None = None
    """Lower bound on the forecast max/mean of any placement with these slots (``balance.bound``)."""
    keep_reason: KeepReason | None = None
    """Why the current placement stays (None when the decision migrates or reshares)."""

    @property
    def num_moves(self) -> int:
        return len(self.moves)

    @property
    def outcome(self) -> str:
        """``migrate``, ``reshare`` (new token shares, no weights move: applied) or ``keep``."""
        return "migrate" if self.migrate else "reshare" if self.reshare else "keep"

    def as_dict(self) -> dict:
        return {
            "step": self.step, "layer": self.layer, "migrate": self.migrate,
            "predicted_saving_s": self.predicted_saving_s, "migration_s": self.migration_s,
            "num_moves": self.num_moves, "imbalance_current": round(self.imbalance_current, 4),
            "imbalance_candidate": round(self.imbalance_candidate, 4), "solve_ms": round(self.solve_ms, 3),
            "reshare": self.reshare, "early": self.early, "forecast_steps": self.forecast_steps,
            "lasting_steps": round(self.lasting_steps, 2), "gap_candidate": round(self.gap_candidate, 5),
            "fallback": self.fallback, "shift": self.shift, "solve_cpu_ms": round(self.solve_cpu_ms, 3),
            "count_noise": self.count_noise, "outcome": self.outcome, "noise_s": self.noise_s,
            "keep_reason": None if self.keep_reason is None else self.keep_reason.value,
            "bound": None if self.bound is None else round(self.bound.value, 4),
            "bound_kind": None if self.bound is None else self.bound.kind,
        }


@dataclass
class LayerSchedule:
    """Per-layer state of the re-plan rule."""

    last_solve: int | None = None
    """Step after which the last solve ran."""
    last_full: int | None = None
    """Step after which the last full re-plan (placements from scratch too) ran."""
    life: int = 0
    """Expected life of the next plan, in steps (the spacing of the last two solves, at most ``interval``)."""
    reference_excess: float = 0.0
    """Excess over the ideal, per step, that the last solve left (see the module docstring)."""
    checks: int = 0
    predicted_excess: float | None = None
    """The excess the last check forecast for the placement that runs the next step."""
    forecast_noise: float = 0.0
    """Running mean of |realized − predicted excess| per step: how much of a forecast's excess is noise."""
    lag_cross: float = 0.0
    """Running mean of the product of consecutive steps' load deviations (from the mean expert)."""
    lag_norm: float = 0.0
    """Running mean of the product of their norms."""
    previous_deviation: np.ndarray | None = field(default=None, compare=False)
    """The last step's deviation (compared by the state tests, not by ``==``)."""
    step_change: float = 0.0
    """Running mean of the step-to-step change of the load mix (total variation of the token shares)."""
    changes: int = 0
    """Step-to-step changes absorbed into ``step_change``."""
    previous_share: np.ndarray | None = field(default=None, compare=False)
    """The last step's token share per expert."""

    def observe_shift(self, tokens_per_expert: np.ndarray) -> bool:
        """Whether this step's load mix jumped away from the last one's: its total variation
        ½·Σ|p_t − p_{t−1}| (the share of tokens that changed expert) exceeds ``SHIFT_FACTOR`` × its running
        mean and ``SHIFT_FLOOR``. Sampling noise and drifts move the mix a little every step and set the
        mean; a hot set handed over at once moves it by the hot experts' share in one step. A shift is
        not absorbed into the mean, so the next one is still seen."""
        loads = np.asarray(tokens_per_expert, dtype=float)
        share = loads / max(float(loads.sum()), 1e-12)
        previous, self.previous_share = self.previous_share, share
        if previous is None:
            return False
        change = 0.5 * float(np.abs(share - previous).sum())
        if self.changes >= SHIFT_WARMUP and change > max(SHIFT_FACTOR * self.step_change, SHIFT_FLOOR):
            return True
        self.changes += 1
        self.step_change += max(PERSISTENCE_SMOOTHING, 1.0 / self.changes) * (change - self.step_change)
        return False

    def observe_deviation(self, tokens_per_expert: np.ndarray, absorb: bool = True) -> None:
        """Absorb the lag-1 pair (last step, this step) into the running statistics; ``absorb=False``
        only makes this step the next pair's first."""
        deviation = np.asarray(tokens_per_expert, dtype=float) - float(np.mean(tokens_per_expert))
        if self.previous_deviation is not None and absorb:
            cross = float(deviation @ self.previous_deviation)
            norm = float(np.linalg.norm(deviation) * np.linalg.norm(self.previous_deviation))
            weight = 1.0 if self.lag_norm == 0.0 else PERSISTENCE_SMOOTHING  # the first pair sets them
            self.lag_cross += weight * (cross - self.lag_cross)
            self.lag_norm += weight * (norm - self.lag_norm)
        self.previous_deviation = deviation

    @property
    def persistence(self) -> float:
        """Lag-1 correlation of the experts' load deviations, in [0, 1]: how much of a step's skew
        the next step keeps (1 before there is evidence)."""
        if self.lag_norm <= 0.0:
            return 1.0
        return min(max(self.lag_cross / self.lag_norm, 0.0), 1.0)

    def state_dict(self) -> dict:
        """JSON-ready: every field by name."""
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in _ARRAY_FIELDS:
            if state[name] is not None:
                state[name] = state[name].tolist()
        return state

    @classmethod
    def from_state_dict(cls, state: dict) -> LayerSchedule:
        """Fields missing from an older checkpoint keep their defaults."""
        values = {f.name: state[f.name] for f in fields(cls) if f.name in state}
        for name in _ARRAY_FIELDS:
            if values.get(name) is not None:
                values[name] = np.array(values[name], dtype=float)
        return cls(**values)


_ARRAY_FIELDS = ("previous_deviation", "previous_share")


@dataclass
class ReplanRule:
    """The check, solve and trigger of the module docstring, for one cost model."""

    costs: BalanceCostModel
    interval: int = BALANCE_DEFAULTS.interval
    horizon: int = BALANCE_DEFAULTS.horizon
    solver: str = BALANCE_DEFAULTS.solver
    trigger_margin: float = BALANCE_DEFAULTS.trigger_margin
    adaptive: bool = True
    """False: solve every ``interval`` steps only, forecasting ``interval`` steps (the fixed schedule)."""
    stall_remedies: bool = True
    """False: without the shift check, the global fallback, the count-noise pricing and the solver's node-aware
    candidates (rules 6-8; ``plan_placement`` gets no ``ranks_per_node``), the rule as it was before issue #28,
    for comparison."""
    _cheapest_move_s: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.interval < 1 or self.horizon < 1:
            raise UserError(f"interval={self.interval} and horizon={self.horizon} must be >= 1")
        check_solver(self.solver)

    @property
    def cheapest_move_seconds(self) -> float:
        """One expert copied between two ranks of one node with unlimited compute to hide under: the
        least any weight-moving plan pays (zero when the copies overlap compute; then any drift beyond
        the forecast noise is worth a solve)."""
        if self._cheapest_move_s is None:
            same_node = 1 if self.costs.ep > 1 and self.costs.cluster.devices_per_node > 1 else 0
            dst_rank = 1 if same_node else min(1, self.costs.ep - 1)
            self._cheapest_move_s = self.costs.migration_seconds([Move(0, (0, 0), (dst_rank, 0))],
                                                                 OverlapWindow(float("inf"), float("inf")))
        return self._cheapest_move_s

    def forecast_steps(self, schedule: LayerSchedule) -> int:
        """The next plan's expected life: the forecast window."""
        if not self.adaptive or schedule.life <= 0:
            return min(self.interval, self.horizon)
        return min(schedule.life, self.interval, self.horizon)

    def lasting_steps(self, schedule: LayerSchedule) -> float:
        """Steps of the horizon a saving is counted on to last: sum over k < horizon of persistence^k
        (a skew that decays like a first-order autoregression; ``horizon`` when it persists)."""
        rho = schedule.persistence if self.adaptive else 1.0
        if rho >= 1.0:
            return float(self.horizon)
        return (1.0 - rho ** self.horizon) / (1.0 - rho)

    def excess_seconds(self, placement: ExpertPlacement, forecast: np.ndarray) -> float:
        return float(self.costs.layer_seconds(placement, forecast) - self.costs.ideal_layer_seconds(forecast))

    def step(
        self, ran: LayerStep, schedule: LayerSchedule, predictor: Predictor, predictor_state: dict[str, np.ndarray],
    ) -> tuple[Decision | None, ExpertPlacement]:
        """After ``ran`` (its loads run on its placement) has been absorbed by the predictor: check, and maybe
        solve. Returns the decision (None when no solve ran) and the placement for the next step (``ran``'s
        unless the trigger fired or the shares changed). ``check``, ``search`` and ``finish`` in turn: a
        caller with many layers may run the searches elsewhere (``distributed.balancing``)."""
        job = self.check(ran, schedule, predictor, predictor_state)
        if job is None:
            return None, ran.placement
        return self.finish(job, schedule, self.search(job))

    def check(
        self, ran: LayerStep, schedule: LayerSchedule, predictor: Predictor, predictor_state: dict[str, np.ndarray],
    ) -> SolveJob | None:
        """The cheap part after every step (rules 1, 2, 5, 6, and the solve's pricing): the solve the layer is
        due, or None (keep ``ran.placement``, no decision). Updates ``schedule`` and, on a shift,
        ``predictor_state``."""
        schedule.checks += 1
        current, actual = ran.placement, np.asarray(ran.loads, dtype=float)
        shift = self.adaptive and self.stall_remedies and schedule.observe_shift(actual)
        if shift:
            # the old regime's level (and trend) forecast the new one worse than the step itself does
            predictor_state.clear()
            predictor_state.update(predictor.init_state(actual))
        if self.adaptive:
            # a shift is a new regime, not evidence that skews fade: it restarts the lag-1 pair only
            schedule.observe_deviation(actual, absorb=not shift)
        if self.adaptive and schedule.predicted_excess is not None and not shift:
            realized = self.excess_seconds(current, actual)
            error = abs(realized - schedule.predicted_excess)
            schedule.forecast_noise += NOISE_SMOOTHING * (error - schedule.forecast_noise)
        due = shift or schedule.last_full is None or ran.step - schedule.last_full >= self.interval
        early = False
        if not due:
            if not self.adaptive:
                return None
            forecast = predictor.forecast(predictor_state, self.forecast_steps(schedule))
            excess = self.excess_seconds(current, forecast)
            # what a re-plan could win back beyond the forecast's own noise, over the horizon
            recoverable = self.lasting_steps(schedule) * (excess - schedule.reference_excess
                                                          - schedule.forecast_noise)
            if not recoverable > self.cheapest_move_seconds:
                schedule.predicted_excess = excess
                return None
            early = True
        if schedule.last_solve is not None and self.adaptive:
            schedule.life = min(ran.step - schedule.last_solve, self.interval)
        # a full re-plan serves until the next one (``interval`` steps); an incremental one until the next check
        window = self.forecast_steps(schedule) if early else min(self.interval, self.horizon)
        forecast = predictor.forecast(predictor_state, window)
        seconds_current = float(self.costs.layer_seconds(current, forecast))
        ideal = float(self.costs.ideal_layer_seconds(forecast))
        draws = count_noise_samples(forecast)
        count_noise = self._prices_count_noise(schedule, current, draws, seconds_current)
        # the copies travel under the next step's compute; the solver's score assumes the least compute
        # any placement can have (the even one), the trigger the candidate's own
        pricing = _Pricing(self.costs, current, draws if count_noise else forecast,
                           self.costs.ideal_overlap_window_seconds(forecast), self.lasting_steps(schedule))
        return SolveJob(ran, shift, early, window, forecast, seconds_current, ideal, count_noise, pricing,
                        ideal + schedule.reference_excess + FALLBACK_GAP * ideal)

    def search(self, job: SolveJob) -> SearchResult:
        """The expensive part, the plan itself (incremental when ``job.early``, with the global fallback): reads
        ``job`` only, so any process holding the same job finds the same placement."""
        return self._search(job.pricing, job.forecast, job.fallback_above_s, job.early)

    def finish(self, job: SolveJob, schedule: LayerSchedule, found: SearchResult) -> tuple[Decision, ExpertPlacement]:
        """The trigger (rules 4 and 5) on ``found``: the decision and the placement for the next step; updates
        ``schedule``."""
        ran, pricing, forecast, ideal = job.ran, job.pricing, job.forecast, job.ideal
        current, lasting = ran.placement, pricing.lasting
        candidate, seconds_candidate = found.candidate, found.seconds
        moves = diff(current, candidate)
        saving = lasting * (pricing.seconds(current) - pricing.seconds(candidate))
        migration = self.costs.migration_seconds(moves, self.costs.overlap_window_seconds(candidate, forecast))
        # only the saving beyond the forecast's measured noise is counted on to last
        noise = lasting * schedule.forecast_noise
        sure_saving = saving - noise
        migrate = bool(moves) and sure_saving > 0.0 and sure_saving > self.trigger_margin * migration
        reshare = not moves and saving > 0.0 and candidate != current
        adopted = candidate if (migrate or reshare) else current
        imbalance_current = float(current.imbalance(forecast))
        bound = imbalance_bound(forecast, current.num_ranks, current.slots_per_rank)
        reason = None if adopted is candidate else keep_reason(bool(moves), saving, noise, imbalance_current, bound)
        schedule.reference_excess = (seconds_candidate if adopted is candidate else job.seconds_current) - ideal
        schedule.predicted_excess = schedule.reference_excess
        schedule.last_solve = ran.step
        if not job.early:  # a fallback leaves the full re-plans' schedule as it was
            schedule.last_full = ran.step
        decision = Decision(
            step=ran.step, layer=ran.layer, migrate=migrate, predicted_saving_s=saving, migration_s=migration,
            moves=tuple(moves), imbalance_current=imbalance_current,
            imbalance_candidate=float(candidate.imbalance(forecast)), solve_ms=found.solve_s * 1e3,
            solve_cpu_ms=found.solve_cpu_s * 1e3,
            reshare=reshare, early=job.early, forecast_steps=job.window, lasting_steps=lasting,
            gap_candidate=seconds_candidate / ideal - 1.0 if ideal > 0 else 0.0, fallback=found.fallback,
            count_noise=job.count_noise, noise_s=noise, bound=bound, keep_reason=reason, shift=job.shift,
        )
        return decision, adopted

    def _prices_count_noise(self, schedule: LayerSchedule, current: ExpertPlacement, draws: np.ndarray,
                            seconds_current: float) -> bool:
        """Rule 8: where the forecast's measured error is about what the counts' own scatter causes, price
        the loads a step will bring (``draws`` around the forecast), not their mean."""
        return bool(
            self.adaptive and self.stall_remedies
            and schedule.predicted_excess is not None  # a forecast error measured at all (not before the first plan)
            and self.costs.ep > self.costs.cluster.devices_per_node  # more than one node (see rule 8)
            and schedule.forecast_noise <= COUNT_NOISE_GATE * float(
                np.mean(np.abs(self.costs.layer_seconds(current, draws) - seconds_current))))

    def _search(self, pricing: _Pricing, forecast: np.ndarray, fallback_above_s: float, early: bool,
                ) -> SearchResult:
        """The solver's best candidate by ``pricing.score``, and its layer seconds on ``forecast``; an early solve
        whose incremental plan takes more than ``fallback_above_s`` also scores the placements from scratch."""
        current = pricing.current

        def plan(candidates: str) -> tuple[ExpertPlacement, float]:
            request = PlanRequest(forecast, current.num_ranks, current.slots_per_rank, self.solver, current,
                                  candidates, self.costs.cluster.devices_per_node if self.stall_remedies else None)
            return timed_plan(request, pricing.score)

        cpu_start = time.process_time()
        # early (drift-triggered) solves offer only moves that build on the current placement ... (the exact
        # program has no such moves: it solves from scratch, then keeps the most experts in place, every time)
        incremental = early and self.solver != "milp"
        candidate, solve_s = plan("incremental" if incremental else "all")
        seconds = float(self.costs.layer_seconds(candidate, forecast))
        # ... unless those stall far from the ideal, and from what the last solve reached (a local optimum
        # a few exchanges cannot leave): then the placements from scratch join them, each still scored with
        # its migration. Where no placement gets near the ideal (a few whole experts per rank, replicas'
        # all-reduces), the reference is as far and the incremental plan stands.
        fallback = incremental and self.stall_remedies and seconds > fallback_above_s
        if fallback:
            scratch, more_s = plan("scratch")
            solve_s += more_s
            if pricing.score(scratch) < pricing.score(candidate):
                candidate, seconds = scratch, float(self.costs.layer_seconds(scratch, forecast))
        return SearchResult(candidate, seconds, solve_s, time.process_time() - cpu_start, fallback)


@dataclass(frozen=True)
class LayerStep:
    """One layer's step as it ran: the step and layer ids, the placement it ran on and its loads [E]."""

    step: int
    layer: int
    placement: ExpertPlacement
    loads: np.ndarray


@dataclass(frozen=True)
class _Pricing:
    """How one solve prices a placement: its mean layer time on ``priced_on`` (the forecast, or draws around
    it under rule 8), plus, for the solver's score, the migration from ``current`` under ``least_window``
    spread over ``lasting`` steps."""

    costs: BalanceCostModel
    current: ExpertPlacement
    priced_on: np.ndarray
    least_window: OverlapWindow
    lasting: float

    def seconds(self, placement: ExpertPlacement) -> float:
        return float(np.mean(self.costs.layer_seconds(placement, self.priced_on)))

    def score(self, placement: ExpertPlacement) -> float:
        migration = self.costs.migration_seconds(diff(self.current, placement), self.least_window)
        return self.seconds(placement) + migration / self.lasting


@dataclass(frozen=True)
class SolveJob:
    """One layer's solve as the check left it (``ReplanRule.check``): the step it follows, why and over which
    window it plans, the forecast and its prices, and above which time an incremental plan falls back."""

    ran: LayerStep
    shift: bool
    early: bool
    window: int
    forecast: np.ndarray
    seconds_current: float
    ideal: float
    count_noise: bool
    pricing: _Pricing
    fallback_above_s: float


@dataclass(frozen=True)
class SearchResult:
    """The candidate one solve found, its layer seconds on the forecast, the solve's wall and CPU time, and
    whether the global fallback ran."""

    candidate: ExpertPlacement
    seconds: float
    solve_s: float
    solve_cpu_s: float
    fallback: bool
