"""Fitting the efficiency parameters on published runs, and leave-one-family-out cross-validation.

The fit minimises a robust (Huber) loss of the log-ratio of predicted to measured metric over all rows
that measure speed (memory rows do not depend on efficiencies), plus a weak pull of each parameter towards its
physical prior so that parameters the training rows cannot identify stay at their prior instead of
drifting. Per-architecture values (``PER_ARCH_PARAMS``) are fitted only for architectures with at
least ``MIN_ROWS_PER_ARCH`` speed rows in the training set; others use the global value.

Regenerate the shipped file, with its cross-validated error and the held-out fits recorded in it, with::

    moetrain validate shared/validation/calibration.csv --fit src/moetrain/planner/calibration_default.yaml --cv
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from moetrain.errors import UserError
from moetrain.planner.calibration import (
    MEASURED_PRIORS,
    PER_ARCH_PARAMS,
    Calibration,
    Efficiency,
    arch_of,
    default_calibration,
)
from moetrain.planner.costmodel import evaluate
from moetrain.planner.strategy import Strategies
from moetrain.planner.validation import PreparedRow, metric_of

MIN_ROWS_PER_ARCH = 4
# Loss on the log-ratios, as scipy's least_squares names it. The shipped fit uses "huber": squared below
# LOSS_SCALE (a 10 % miss) and linear above, so that the few rows no mechanism reproduces (25-46 % off, see
# benchmarks/notes/planner.md, "Validation on published runs" and "Residual analysis of the vTrain rows")
# pull on the shared efficiencies like any row 10 % off instead of with their squared error.
# Plain least squares ("linear") and the smooth "soft_l1" and "cauchy" losses cross-validated worse
# (benchmarks/planner_fit_variants.py, "loss" variants). scipy applies the loss to the prior residuals too;
# they stay in its squared part unless a parameter moves more than two prior scales from its prior.
LOSS = "huber"
LOSS_SCALE = 0.1
# ``Efficiency`` fields not in BOUNDS (``calibration.NOT_FITTED``) keep their default in a fit.
# The pull towards a generic prior: weak, so that only a parameter the rows leave unidentified stays there.
# A measured prior (``calibration.MEASURED_PRIORS``) pulls with LOSS_SCALE / spread instead: a parameter one
# spread away from its measurement costs what a row LOSS_SCALE off costs.
PRIOR_WEIGHT = 0.05
BOUNDS: dict[str, tuple[float, float]] = {
    "gemm_max": (0.2, 0.95),
    "gemm_overhead_us": (0.0, 300.0),
    "moe_overhead_us": (0.0, 5000.0),
    "attention": (0.05, 0.9),
    "memory": (0.1, 1.0),
    "fp8_gain": (1.0, 2.0),
    "bus_intra": (0.1, 1.0),
    "bus_inter": (0.1, 1.0),
    "grad_overlap": (0.0, 1.0),
    "tp_overlap": (0.0, 0.95),
}


@dataclass(frozen=True)
class FitOptions:
    """How a fit weighs the rows and which parameters it frees. The defaults are the shipped fit; the rest
    are variants it does not use (benchmarks/notes/planner.md, "Fit variants")."""

    per_arch_params: tuple[str, ...] = PER_ARCH_PARAMS
    """The parameters fitted per architecture."""
    family_weight_power: float = 0.0
    """p: each row's log-ratio weighs n^(−p/2) (its squared error n^−p), n being the number of speed rows
    of its family (0: every row counts the same, as shipped; 1: every family counts the same)."""
    fixed: Mapping[str, float] = field(default_factory=dict)
    """Parameters held at given values (a kernel measurement, say) instead of fitted."""
    loss: str = LOSS
    """scipy's loss on the log-ratios."""
    loss_scale: float = LOSS_SCALE
    """The log-ratio where that loss turns linear."""


def predict_rows(rows: list[PreparedRow], calibration: Calibration) -> np.ndarray:
    """Each row's metric as predicted; rows sharing a workload are scored in one vectorised call."""
    groups: dict[object, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        groups[row.workload].append(i)
    predicted = np.empty(len(rows))
    for workload, index in groups.items():
        strategies = Strategies.concat([rows[i].strategy for i in index])
        costs = evaluate(workload, strategies, calibration.for_device(workload.cluster.device))
        for j, i in enumerate(index):
            predicted[i] = metric_of(rows[i], costs, j)
    return predicted


def _layout(rows: list[PreparedRow], per_arch_params: tuple[str, ...],
            fixed: dict[str, float]) -> tuple[list[str], list[tuple[str, str]]]:
    counts = Counter(arch_of(r.workload.cluster.device) for r in rows if r.metric != "peak_memory_gib")
    per_arch = [(arch, p) for arch, n in sorted(counts.items()) if n >= MIN_ROWS_PER_ARCH for p in per_arch_params
                if p not in fixed]
    # A parameter fitted per architecture is not fitted again globally: its global value (what an
    # architecture without data uses) is the geometric mean over the fitted architectures.
    derived = {p for _, p in per_arch}
    glob = [p for p in BOUNDS if p not in derived and p not in fixed]
    return glob, per_arch


def _unpack(x: np.ndarray, glob: list[str], per_arch: list[tuple[str, str]], note: str,
            fixed: dict[str, float] | None = None) -> Calibration:
    values = {**(fixed or {}), **{k: float(v) for k, v in zip(glob, x[: len(glob)])}}
    arch: dict[str, dict[str, float]] = defaultdict(dict)
    for (name, param), value in zip(per_arch, x[len(glob):]):
        arch[name][param] = float(value)
    for param in {p for _, p in per_arch}:
        fitted = [v[param] for v in arch.values() if param in v]
        values[param] = float(np.exp(np.mean(np.log(fitted))))
    return Calibration(replace(Efficiency(), **values), dict(arch), note)


@dataclass(frozen=True)
class FitLoss:
    """The fit's objective at one parameter point, as scipy's ``least_squares`` minimises it: half the sum
    of the loss ρ over the rows' weighted log-ratios (``data``) and the prior pulls (``prior``)."""

    data: float
    prior: float

    @property
    def total(self) -> float:
        return self.data + self.prior


@dataclass(frozen=True)
class _Problem:
    """The residuals a fit minimises: which parameters are free, their prior, bounds and scale."""

    speed_rows: list[PreparedRow]
    glob: list[str]
    per_arch: list[tuple[str, str]]
    fixed: dict[str, float]
    x0: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    prior_weights: np.ndarray
    """Per free parameter: PRIOR_WEIGHT, or LOSS_SCALE / spread for a measured prior."""

    def residuals(self, x: np.ndarray) -> np.ndarray:
        predicted = predict_rows(self.speed_rows, _unpack(x, self.glob, self.per_arch, "", self.fixed))
        measured = np.array([r.measured for r in self.speed_rows])
        fit_term = self.weights * np.log(np.maximum(predicted, 1e-12) / measured)
        return np.concatenate([fit_term, self.prior_weights * (x - self.x0) / self.scale])

    def point(self, calibration: Calibration) -> np.ndarray:
        """``calibration``'s values of the free parameters (per-architecture ones where it has them)."""
        return _free_values(calibration, self.glob, self.per_arch)


def _free_values(calibration: Calibration, glob: list[str], per_arch: list[tuple[str, str]]) -> np.ndarray:
    """The values of the free parameters ``glob`` and ``per_arch`` in ``calibration``: a per-architecture one
    where it has one, else the global value."""
    def value(arch: str | None, param: str) -> float:
        overrides = calibration.per_arch.get(arch, {}) if arch else {}
        return overrides.get(param, getattr(calibration.global_params, param))
    return np.array([value(None, p) for p in glob] + [value(a, p) for a, p in per_arch])


def _problem(rows: list[PreparedRow], options: FitOptions) -> _Problem:
    speed_rows = [r for r in rows if r.metric != "peak_memory_gib"]
    if not speed_rows:
        raise UserError("no speed rows to fit on (memory rows do not constrain efficiencies)")
    fixed = dict(options.fixed)
    glob, per_arch = _layout(speed_rows, options.per_arch_params, fixed)
    x0 = _free_values(default_calibration(), glob, per_arch)
    prior_weights = np.array([PRIOR_WEIGHT] * len(glob) + [
        LOSS_SCALE / MEASURED_PRIORS[(a, p)].spread if (a, p) in MEASURED_PRIORS else PRIOR_WEIGHT
        for a, p in per_arch])
    lower = np.array([BOUNDS[p][0] for p in glob] + [BOUNDS[p][0] for _, p in per_arch])
    upper = np.array([BOUNDS[p][1] for p in glob] + [BOUNDS[p][1] for _, p in per_arch])
    family_rows = Counter(r.family for r in speed_rows)
    weights = np.array([family_rows[r.family] ** (-options.family_weight_power / 2) for r in speed_rows])
    weights = weights / np.sqrt(np.mean(weights**2))  # the prior keeps its pull relative to the data
    return _Problem(speed_rows, glob, per_arch, fixed, x0, lower, upper, np.maximum(np.abs(x0), upper * 0.05),
                    weights, prior_weights)


def _rho(residuals: np.ndarray, loss: str, loss_scale: float) -> np.ndarray:
    """scipy's ρ(z) of z = (r/C)², times C²: what ``least_squares`` sums (and halves) for ``loss``."""
    z = (residuals / loss_scale) ** 2
    forms = {"linear": z, "huber": np.where(z <= 1.0, z, 2.0 * np.sqrt(z) - 1.0),
             "soft_l1": 2.0 * (np.sqrt(1.0 + z) - 1.0), "cauchy": np.log1p(z)}
    if loss not in forms:
        raise UserError(f"unknown fit loss {loss!r}; use one of {', '.join(forms)}")
    return loss_scale**2 * forms[loss]


def fit_loss(rows: list[PreparedRow], calibration: Calibration, options: FitOptions | None = None) -> FitLoss:
    """The objective ``fit_calibration`` minimises on ``rows``, at ``calibration``'s parameters: the way to
    tell which of two fits of the same rows is the better optimum (same ``options`` as ``fit_calibration``)."""
    options = options or FitOptions()
    problem = _problem(rows, options)
    rho = 0.5 * _rho(problem.residuals(problem.point(calibration)), options.loss, options.loss_scale)
    n = len(problem.speed_rows)
    return FitLoss(float(np.sum(rho[:n])), float(np.sum(rho[n:])))


def fit_calibration(rows: list[PreparedRow], note: str = "", options: FitOptions | None = None,
                    start: Calibration | None = None) -> Calibration:
    """Robust least-squares fit of the efficiency parameters on ``rows`` (speed rows only), the shipped fit
    unless ``options`` say otherwise; ``start`` starts the search from another fit's values instead of the
    priors (the prior pull stays).
    """
    try:
        from scipy.optimize import least_squares  # optional: only a refit needs scipy
    except ImportError as exc:  # scipy is needed only to refit, not to simulate
        raise UserError("fitting needs scipy; install it with `pip install scipy`") from exc
    options = options or FitOptions()
    problem = _problem(rows, options)
    begin = problem.x0 if start is None else problem.point(start)
    result = least_squares(problem.residuals, np.clip(begin, problem.lower, problem.upper),
                           bounds=(problem.lower, problem.upper), x_scale=problem.scale, diff_step=1e-3,
                           max_nfev=400, loss=options.loss, f_scale=options.loss_scale)
    return _unpack(result.x, problem.glob, problem.per_arch, note, problem.fixed)


def fits_without_each_family(rows: list[PreparedRow], options: FitOptions | None = None) -> dict[str, Calibration]:
    """For each family of ``rows``, the parameters fitted (with ``options``) on every *other* family: the fits
    leave-one-family-out cross-validation predicts with. ``moetrain plan`` re-ranks its best layouts under
    each to show how much the choice depends on the calibration."""
    fits = {}
    for family in sorted({r.family for r in rows}):
        train = [r for r in rows if r.family != family]
        fits[family] = (fit_calibration(train, note=f"fitted without {family}", options=options)
                        if any(r.metric != "peak_memory_gib" for r in train) else default_calibration())
    return fits


def leave_one_family_out(rows: list[PreparedRow], fits: dict[str, Calibration] | None = None,
                         options: FitOptions | None = None) -> np.ndarray:
    """Predict each row with parameters fitted on every *other* family (memory rows need no fit);
    ``fits`` from ``fits_without_each_family`` if already computed, else fitted here with ``options``."""
    fits = fits if fits is not None else fits_without_each_family(rows, options)
    predicted = np.empty(len(rows))
    for family, calibration in fits.items():
        held = [i for i, r in enumerate(rows) if r.family == family]
        predicted[held] = predict_rows([rows[i] for i in held], calibration)
    return predicted
