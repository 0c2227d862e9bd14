"""Why one published run is predicted as it is (``moetrain validate --explain ROW``): each term's share of
the predicted step, and how the row's error moves with each fitted efficiency.

The step of the cost model (``costmodel.evaluate``) is

    step = m · stage + bubble + exposed DP traffic + optimizer + per-step overhead,

where ``stage`` is the busiest pipeline stage's time per micro-batch. Of ``m · stage`` the exposed
communication (TP, all-to-all, CP, pipeline send/recv) and the device's wait for the host are priced
per term; the rest is compute: the busiest stage's own parts (``costmodel.ComputeTimes``: its dense and MoE
layers' GEMMs, fused attention, the grouped GEMM of the routed experts, the fixed cost per MoE pass,
element-wise kernels and FP8 operand casts, forward and backward; what recompute runs again; the embedding,
the output head and the MTP modules), as the cost model prices them (``layer_costs.LayerParts``). A layer
count that pp·vpp does not divide is split unevenly: the parts are then the mean rank's, and what the
slowest rank holds beyond them is a term of its own. The terms add up to the predicted step exactly.

Sensitivity: for each fitted efficiency p (``fit.BOUNDS``), d(error)/d(log p) in percentage points of
the row's signed error, by a central difference of ±``LOG_STEP`` in log p. A term that the miss points
to has a large sensitivity of the sign that would close the miss.

Held out (``--explain ROW --cv``): the row as the leave-one-family-out check predicts it, under the
calibration's fit without the row's family (``Calibration.held_out_fits``), and why that miss differs from
the fit on every row: each fitted efficiency moved alone from its all-rows value to its held-out one, and
what the moves do together beyond the sum of the single ones, so the lines add up to the difference. A
parameter that only the left-out family informs falls back to its prior there, and shows at the top.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from moetrain.planner.calibration import Calibration, Efficiency
from moetrain.planner.costmodel import StepCosts, evaluate
from moetrain.planner.validation import PreparedRow, metric_of

LOG_STEP = 0.05
"""Half-width of the central difference in log parameter (±5 %)."""

SAME_VALUE_RTOL = 1e-9
"""Held-out values within this of the all-rows ones did not move (two fits ending at one bound differ in the
last bits)."""

UNEVEN_SPLIT = "uneven PP split (slowest rank over the mean)"
"""The term of a layer count that pp·vpp does not divide: the compute parts are the mean rank's, the
stage time the slowest rank's."""

FITTED = ("gemm_max", "gemm_overhead_us", "moe_overhead_us", "attention", "memory", "fp8_gain", "bus_intra",
          "bus_inter", "grad_overlap", "tp_overlap")
"""The efficiencies a fit on published runs sets (``fit.BOUNDS``)."""


@dataclass(frozen=True)
class Term:
    name: str
    seconds: float
    """Of the predicted step, on the busiest stage."""
    share: float
    """seconds / predicted step."""


@dataclass(frozen=True)
class Explanation:
    row_id: str
    metric: str
    measured: float
    predicted: float
    error_pct: float
    """(predicted − measured) / measured · 100."""
    step_time_s: float
    terms: tuple[Term, ...]
    sensitivity: dict[str, float]
    """Fitted efficiency → d(error %)/d(log p), largest magnitude first."""
    efficiency: dict[str, float]
    """The efficiencies the prediction used (the row's device's values)."""
    held_out: HeldOutShift | None = None
    """With ``--cv``: the prediction above is the held-out one, and this is how it differs from the
    all-rows fit's."""

    def to_dict(self) -> dict:
        out = {"id": self.row_id, "metric": self.metric, "measured": self.measured, "predicted": self.predicted,
               "error_pct": self.error_pct, "step_time_s": self.step_time_s,
               "terms": [{"name": t.name, "seconds": t.seconds, "share": t.share} for t in self.terms],
               "sensitivity_pct_per_log": self.sensitivity, "efficiency": self.efficiency}
        if self.held_out is not None:
            out["held_out"] = asdict(self.held_out)
        return out


@dataclass(frozen=True)
class ParameterShift:
    name: str
    all_rows: float
    """Its value (the row's device's) in the fit on every row."""
    held_out: float
    """Its value in the fit without the row's family."""
    alone_pct: float
    """Points of signed error the row's all-rows prediction gains when only this parameter moves to its
    held-out value."""


@dataclass(frozen=True)
class HeldOutShift:
    """How a row's miss under the fit without its family differs from its miss under the fit on every row."""

    family: str
    all_rows_error_pct: float
    held_out_error_pct: float
    shifts: tuple[ParameterShift, ...]
    """The fitted efficiencies whose values differ, largest ``alone_pct`` magnitude first."""
    together_pct: float
    """held-out error − all-rows error − Σ alone: what the moves do together beyond their single effects."""


def compute_terms(costs: StepCosts) -> dict[str, float]:
    """Seconds per step of each compute part on the busiest stage (``StepCosts.compute``: its own dense and
    MoE layers, forward and backward, and its ends; what recompute runs again apart)."""
    trained, again = costs.compute, costs.recompute

    def seconds(*names: str) -> float:
        return sum(float(getattr(trained, n)[0]) - float(getattr(again, n)[0]) for n in names)

    return {
        "dense GEMMs (projections, router, shared experts, dense FFN)": seconds(
            "attention_s", "router_s", "shared_experts_s", "dense_ffn_s") - seconds("attention_core_s"),
        "fused attention": seconds("attention_core_s"),
        "routed experts (grouped GEMM)": seconds("experts_s"),
        "MoE fixed cost per pass": seconds("moe_fixed_s"),
        "element-wise kernels": seconds("elementwise_s"),
        "FP8 operand casts": seconds("fp8_casts_s"),
        "recompute": float(again.total_s()[0]),
        "embedding": seconds("embed_s"),
        "output head and loss": seconds("head_s"),
        "MTP modules": seconds("mtp_s"),
    }


def step_terms(eff: Efficiency, costs: StepCosts) -> tuple[Term, ...]:
    """The predicted step as terms that add up to it (see the module docstring)."""
    p, dp = costs.pipeline, costs.dp
    step = float(costs.step_time_s[0])
    num_micro = float(costs.num_micro_batches[0])
    exposed = {
        "TP collectives (exposed)": float(p.tp_exposed_s[0]),
        "expert all-to-all (exposed)": float(p.a2a_exposed_s[0]),
        "CP exchange (exposed)": float(p.cp_exposed_s[0]),
        "PP send/recv": float(p.p2p_s[0]),
        "device waits for host": float(p.host_wait_s[0]),
    }
    seconds = compute_terms(costs)
    stage_compute = num_micro * float(p.stage_time_s[0]) - sum(exposed.values())
    beyond_mean = stage_compute - sum(seconds.values())
    if abs(beyond_mean) > 1e-9 * max(step, 1e-30):
        seconds[UNEVEN_SPLIT] = beyond_mean
    seconds.update(exposed)
    seconds["PP bubble"] = float(p.bubble_s[0])
    seconds["DP/ZeRO traffic (exposed)"] = float(dp.exposed_s[0])
    seconds["optimizer step"] = float(costs.optimizer_s[0])
    seconds["per-step overhead"] = eff.step_overhead_ms * 1e-3
    named = sum(seconds.values())
    if abs(step - named) > 1e-9 * max(step, 1e-30):
        seconds["other"] = step - named
    return tuple(Term(k, v, v / step) for k, v in seconds.items())


def _error_pct(row: PreparedRow, eff: Efficiency) -> float:
    predicted = metric_of(row, evaluate(row.workload, row.strategy, eff), 0)
    return (predicted - row.measured) / row.measured * 100.0


def sensitivities(row: PreparedRow, eff: Efficiency) -> dict[str, float]:
    """d(error %)/d(log p) for each fitted efficiency p with a positive value, largest magnitude first."""
    out = {}
    for name in FITTED:
        value = float(getattr(eff, name))
        if value <= 0.0:
            continue
        up = _error_pct(row, replace(eff, **{name: value * np.exp(LOG_STEP)}))
        down = _error_pct(row, replace(eff, **{name: value * np.exp(-LOG_STEP)}))
        out[name] = (up - down) / (2.0 * LOG_STEP)
    return dict(sorted(out.items(), key=lambda kv: -abs(kv[1])))


def explain(row: PreparedRow, calibration: Calibration) -> Explanation:
    eff = calibration.for_device(row.workload.cluster.device)
    costs = evaluate(row.workload, row.strategy, eff)
    predicted = metric_of(row, costs, 0)
    return Explanation(
        row.row_id, row.metric, row.measured, predicted, (predicted - row.measured) / row.measured * 100.0,
        float(costs.step_time_s[0]), step_terms(eff, costs), sensitivities(row, eff),
        {name: float(getattr(eff, name)) for name in FITTED})


def held_out_shift(row: PreparedRow, all_rows: Calibration, held_out: Calibration,
                   target: float) -> HeldOutShift:
    """The row's error under ``held_out`` (the fit without its family; ``target``, that error as ``explain``
    found it) against ``all_rows``, by parameter (module docstring)."""
    device = row.workload.cluster.device
    eff_all, eff_held = all_rows.for_device(device), held_out.for_device(device)
    base = _error_pct(row, eff_all)
    shifts = []
    for name in FITTED:
        before, after = float(getattr(eff_all, name)), float(getattr(eff_held, name))
        if not np.isclose(before, after, rtol=SAME_VALUE_RTOL, atol=0.0):
            alone = _error_pct(row, replace(eff_all, **{name: after})) - base
            shifts.append(ParameterShift(name, before, after, alone))
    shifts.sort(key=lambda p: -abs(p.alone_pct))
    together = target - base - sum(p.alone_pct for p in shifts)
    return HeldOutShift(row.family, base, target, tuple(shifts), together)


def explain_held_out(row: PreparedRow, calibration: Calibration) -> Explanation:
    """``explain`` under the calibration's fit without the row's family (``Calibration.held_out_fits``,
    which must hold it), with the ``HeldOutShift`` from the all-rows fit attached."""
    held_out = calibration.held_out_fits[row.family]
    e = explain(row, held_out)
    return replace(e, held_out=held_out_shift(row, calibration, held_out, e.error_pct))


def format_explanation(e: Explanation) -> str:
    width = max(len(t.name) for t in e.terms)
    lines = [f"{e.row_id}: {e.metric} measured {e.measured:.4g}, predicted {e.predicted:.4g} "
             f"({e.error_pct:+.1f} %); predicted step {e.step_time_s:.4g} s",
             "", f"{'term (busiest stage, per step)':{width + 2}s} {'seconds':>10s} {'share':>7s}"]
    for t in e.terms:
        lines.append(f"  {t.name:{width}s} {t.seconds:10.4g} {t.share * 100:6.1f}%")
    lines += ["", "sensitivity of the error to each fitted efficiency (points of error per unit log p):"]
    for name, d in e.sensitivity.items():
        lines.append(f"  {name:20s} {d:+8.2f}   (value {e.efficiency[name]:.4g})")
    if e.held_out is not None:
        h = e.held_out
        without = f"without {h.family}"
        width = max(len(without), 11)
        lines += ["", f"held out: the fit without family {h.family} (above) misses by {h.held_out_error_pct:+.1f} %, "
                  f"the fit on every row by {h.all_rows_error_pct:+.1f} %; each parameter moved alone from the "
                  "second to the first:",
                  f"  {'parameter':20s} {'every row':>11s} {without:>{width}s} {'points':>8s}"]
        for p in h.shifts:
            lines.append(f"  {p.name:20s} {p.all_rows:11.4g} {p.held_out:{width}.4g} {p.alone_pct:+8.2f}")
        lines.append(f"  {'together, beyond the single moves':{33 + width}s} {h.together_pct:+8.2f}")
    return "\n".join(lines)
