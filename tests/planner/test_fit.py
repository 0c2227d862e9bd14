"""The efficiency fit: its robust loss, row weights by family, and parameters fitted per architecture."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from moetrain.planner import calibration as calibration_module
from moetrain.planner import fit
from moetrain.planner.calibration import (
    HOST_US_PER_KERNEL_EAGER,
    MEASURED_PRIORS,
    Calibration,
    Efficiency,
    default_calibration,
)
from moetrain.planner.fit import FitOptions, fit_calibration, predict_rows
from moetrain.planner.validation import PreparedRow, prepare_row


def _copies(published_rows: list[dict], row_id: str, family: str, values: list[float]) -> list[PreparedRow]:
    row = prepare_row(next(r for r in published_rows if r["id"] == row_id))
    assert isinstance(row, PreparedRow)
    return [replace(row, row_id=f"{family}-{i}", family=family, measured=v) for i, v in enumerate(values)]


@pytest.mark.parametrize(("power", "expected_log"), [
    # Every row counts the same: the fit lands on the mean log over the four rows.
    (0.0, (3 * math.log(0.40) + math.log(0.50)) / 4),
    # Every family counts the same: the mean log over the two families.
    (1.0, (math.log(0.40) + math.log(0.50)) / 2),
], ids=["each_row_counts_once", "each_family_counts_once"])
def test_family_weights_decide_where_disagreeing_sources_meet(published_rows: list[dict], power: float,
                                                              expected_log: float) -> None:
    # Two sources measure the same run: three rows of one family at MFU 0.40, one row of another at 0.50.
    rows = _copies(published_rows, "MPT-6", "A", [0.40, 0.40, 0.40]) + _copies(published_rows, "MPT-6", "B", [0.50])
    calibration = fit_calibration(rows, options=FitOptions(family_weight_power=power, loss="linear"))
    predicted = predict_rows(rows[:1], calibration)[0]
    # The weak pull towards the prior moves the optimum by far less than the 5.6 % between the answers.
    assert math.log(predicted) == pytest.approx(expected_log, abs=0.01)


def test_the_shipped_huber_loss_bounds_the_pull_of_a_row_far_off(published_rows: list[dict]) -> None:
    # Three rows at MFU 0.40 and one at 0.50 (log-ratio 0.22 apart, beyond the 0.1 where the loss turns
    # linear). Least squares lands on the mean log, 0.056 above log 0.40; under the Huber loss the far row
    # pulls with a constant 0.1 against 3·(L − log 0.40) from the others, so L = log 0.40 + 0.1/3.
    rows = _copies(published_rows, "MPT-6", "A", [0.40, 0.40, 0.40, 0.50])
    assert fit.LOSS == "huber" and fit.LOSS_SCALE == 0.1
    robust = math.log(predict_rows(rows[:1], fit_calibration(rows))[0])
    squares = math.log(predict_rows(rows[:1], fit_calibration(rows, options=FitOptions(loss="linear")))[0])
    assert robust == pytest.approx(math.log(0.40) + 0.1 / 3, abs=0.004)
    assert squares == pytest.approx((3 * math.log(0.40) + math.log(0.50)) / 4, abs=0.004)


def test_per_architecture_parameters_are_fitted_per_architecture(published_rows: list[dict]) -> None:
    ampere = _copies(published_rows, "MPT-6", "A", [0.60, 0.62, 0.64, 0.66])
    hopper = _copies(published_rows, "MPT-7", "H", [0.44, 0.45, 0.46, 0.47])
    shipped_layout = fit_calibration(ampere + hopper)
    with_memory = fit_calibration(ampere + hopper, options=FitOptions(per_arch_params=("gemm_max", "memory")))
    assert set(shipped_layout.per_arch) == set(with_memory.per_arch) == {"ampere", "hopper"}
    assert all(set(v) == {"gemm_max"} for v in shipped_layout.per_arch.values())
    assert all(set(v) == {"gemm_max", "memory"} for v in with_memory.per_arch.values())
    # Two per-architecture values replace one global value: one more free parameter.
    assert with_memory.free_parameter_count == shipped_layout.free_parameter_count + 1
    # The global value is the geometric mean of the per-architecture ones (what an unseen architecture uses).
    fitted = [v["memory"] for v in with_memory.per_arch.values()]
    assert with_memory.global_params.memory == pytest.approx(math.sqrt(fitted[0] * fitted[1]))


def test_a_fixed_parameter_keeps_its_value_and_the_others_absorb_the_data(published_rows: list[dict]) -> None:
    rows = _copies(published_rows, "MPT-6", "A", [0.60, 0.62, 0.64, 0.66])
    free = fit_calibration(rows)
    held = fit_calibration(rows, options=FitOptions(per_arch_params=("gemm_max", "memory"),
                                                 fixed={"memory": 0.89}))
    # Held, never fitted, not even per architecture.
    assert held.global_params.memory == 0.89
    assert all("memory" not in v for v in held.per_arch.values())
    # The data still sets the prediction: the fit's level moves to the other parameters.
    measured_log = sum(math.log(v) for v in (0.60, 0.62, 0.64, 0.66)) / 4
    for calibration in (free, held):
        assert math.log(predict_rows(rows[:1], calibration)[0]) == pytest.approx(measured_log, abs=0.02)


def test_fit_loss_is_the_huber_sum_the_fit_minimises(published_rows: list[dict]) -> None:
    # Four rows of one run at MFU 0.40, 0.42, 0.50 and 0.60, priced at the priors (no prior pull there).
    rows = _copies(published_rows, "MPT-6", "A", [0.40, 0.42, 0.50, 0.60])
    priors = default_calibration()
    predicted = predict_rows(rows[:1], priors)[0]
    by_hand = 0.0
    for measured in (0.40, 0.42, 0.50, 0.60):
        r = abs(math.log(predicted / measured))
        by_hand += 0.5 * r * r if r <= 0.1 else 0.1 * r - 0.5 * 0.1**2  # Huber at 0.1, halved as scipy's cost
    at_priors = fit.fit_loss(rows, priors)
    assert at_priors.prior == 0.0
    assert at_priors.data == pytest.approx(by_hand, rel=1e-12)
    # the fit's optimum scores lower than the priors and than the same point moved by 5 % either way
    fitted = fit_calibration(rows)
    best = fit.fit_loss(rows, fitted).total
    assert best < at_priors.total
    for factor in (0.95, 1.05):
        moved = replace(fitted, per_arch={a: {p: v * factor for p, v in values.items()}
                                          for a, values in fitted.per_arch.items()})
        assert best < fit.fit_loss(rows, moved).total


def test_a_fit_started_elsewhere_reaches_the_same_single_optimum(published_rows: list[dict]) -> None:
    rows = _copies(published_rows, "MPT-6", "A", [0.40, 0.42, 0.44, 0.46])
    from_priors = fit_calibration(rows)
    elsewhere = replace(from_priors, global_params=replace(from_priors.global_params, memory=0.3, attention=0.8),
                        per_arch={a: {"gemm_max": 0.3} for a in from_priors.per_arch})
    from_elsewhere = fit_calibration(rows, start=elsewhere)
    assert fit.fit_loss(rows, from_elsewhere).total == pytest.approx(fit.fit_loss(rows, from_priors).total, rel=1e-3)
    assert math.log(predict_rows(rows[:1], from_elsewhere)[0]) == pytest.approx(
        math.log(predict_rows(rows[:1], from_priors)[0]), abs=0.005)


def test_cross_validation_fits_every_fold_with_the_options(published_rows: list[dict]) -> None:
    # Two families: each fold fits on the other alone. ``memory`` held at 0.89 stays 0.89 in every fold,
    # also where it would be fitted per architecture, so no fold may fall back to the shipped options.
    rows = (_copies(published_rows, "MPT-6", "A", [0.60, 0.62, 0.64, 0.66])
            + _copies(published_rows, "MPT-6", "B", [0.50, 0.52, 0.54, 0.56]))
    options = FitOptions(per_arch_params=("gemm_max", "memory"), fixed={"memory": 0.89})
    fits = fit.fits_without_each_family(rows, options)
    assert set(fits) == {"A", "B"}
    for calibration in fits.values():
        assert calibration.global_params.memory == 0.89
        assert all(set(v) == {"gemm_max"} for v in calibration.per_arch.values())
    # leave_one_family_out fits the same folds when handed the options instead of the fits
    held_out = fit.leave_one_family_out(rows, options=options)
    assert list(held_out) == list(fit.leave_one_family_out(rows, fits))


def test_fit_loss_takes_the_loss_from_the_options(published_rows: list[dict]) -> None:
    # At the priors (no prior pull) the plain least-squares objective is half the sum of squared log-ratios.
    rows = _copies(published_rows, "MPT-6", "A", [0.40, 0.50])
    priors = default_calibration()
    predicted = predict_rows(rows[:1], priors)[0]
    by_hand = sum(0.5 * math.log(predicted / measured) ** 2 for measured in (0.40, 0.50))
    assert fit.fit_loss(rows, priors, FitOptions(loss="linear")).data == pytest.approx(by_hand, rel=1e-12)


def test_the_moe_pass_prior_is_the_measured_host_time_of_its_kernels() -> None:
    # A host-bound step of this project's eager runtime on an H100 host: its measured time over its kernels.
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    step_s = json.loads((results / "planner_step_check_gpu.json").read_text())["measured_step_time_s"]
    kernels = json.loads((results / "gpu_step_profile_tiny.json").read_text())["device_events_per_step"]
    per_kernel_us = step_s / kernels * 1e6
    assert per_kernel_us == pytest.approx(HOST_US_PER_KERNEL_EAGER, rel=1e-4)  # 22.9 µs
    # 30 to 50 kernels after the count sync: their geometric mean, 38.7 kernels, 0.89 ms.
    assert Efficiency().moe_overhead_us == pytest.approx(math.sqrt(30 * 50) * per_kernel_us, rel=1e-4)
    assert default_calibration().global_params.moe_overhead_us == pytest.approx(885.7, abs=0.1)


def test_rows_without_an_moe_layer_leave_the_moe_pass_cost_at_its_prior(published_rows: list[dict]) -> None:
    fitted = fit_calibration(_copies(published_rows, "MPT-6", "A", [0.60, 0.62, 0.64, 0.66]))
    assert fitted.global_params.moe_overhead_us == pytest.approx(885.7, abs=0.1)


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_hoppers_gemm_prior_is_the_rate_moetrain_profile_fitted_on_each_hopper_device() -> None:
    profiled = []
    for name in ("planner_step_check_gpu.json", "planner_step_check_gpu_pangu-shaped-small.json",
                 "planner_step_check_h200_pangu-shaped-small.json"):
        check = json.loads((RESULTS / name).read_text())
        assert "H100" in check["machine"]["device"] or "H200" in check["machine"]["device"]
        profiled.append(yaml.safe_load(check["calibration"])["per_arch"]["hopper"]["gemm_max"])
    assert profiled == pytest.approx([0.7218, 0.7181, 0.6855], abs=1e-4)
    geometric_mean = math.exp(sum(math.log(v) for v in profiled) / 3)  # 0.7082
    prior = MEASURED_PRIORS[("hopper", "gemm_max")]
    assert prior.value == pytest.approx(geometric_mean, rel=1e-9) and prior.spread == 0.10
    # the priors a fit starts from and falls back to: the measured rate on Hopper, the generic one elsewhere
    assert default_calibration().for_device("h100-sxm-80gb").gemm_max == pytest.approx(0.7082, abs=1e-4)
    assert default_calibration().for_device("a100-sxm-80gb").gemm_max == Efficiency().gemm_max == 0.75


def test_a_measured_prior_one_spread_off_costs_what_a_row_ten_percent_off_costs(published_rows: list[dict]) -> None:
    # Four H100 rows, each measured exactly as the priors predict them, so the data costs nothing there.
    hopper = default_calibration()
    rows = _copies(published_rows, "MPT-7", "H", [predict_rows(_copies(published_rows, "MPT-7", "H", [1.0]),
                                                               hopper)[0]] * 4)
    assert fit.fit_loss(rows, hopper).total == pytest.approx(0.0, abs=1e-20)

    def moved(param: str, factor: float) -> Calibration:
        per_arch = {"hopper": dict(hopper.per_arch["hopper"])}
        if param == "gemm_max":
            per_arch["hopper"]["gemm_max"] *= factor
        glob = hopper.global_params if param == "gemm_max" else replace(
            hopper.global_params, **{param: getattr(hopper.global_params, param) * factor})
        return replace(hopper, global_params=glob, per_arch=per_arch)

    # Hopper's GEMM rate 10 % (one spread) above its measurement: a residual of 0.1, in the Huber loss's
    # squared part, halved as scipy's cost: 0.5 · 0.1² = 0.005, what one row 10 % off costs.
    assert fit.fit_loss(rows, moved("gemm_max", 1.10)).prior == pytest.approx(0.5 * 0.1**2, rel=1e-9)
    # a parameter with a generic prior moved as far pulls with PRIOR_WEIGHT 0.05: 0.5 · (0.05 · 0.1)²
    assert fit.fit_loss(rows, moved("memory", 1.10)).prior == pytest.approx(0.5 * (0.05 * 0.1) ** 2, rel=1e-9)


def test_the_measured_prior_holds_a_fit_back_from_rows_that_alone_would_move_it(
        published_rows: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    # Four H100 rows measured as the model predicts them at a GEMM rate 30 % above the measured one; every
    # other parameter held, so the GEMM rate alone answers them.
    g0 = MEASURED_PRIORS[("hopper", "gemm_max")].value
    at_data = replace(default_calibration(), per_arch={"hopper": {"gemm_max": 1.3 * g0}})
    measured = predict_rows(_copies(published_rows, "MPT-7", "H", [1.0]), at_data)[0]
    rows = _copies(published_rows, "MPT-7", "H", [measured] * 4)
    only_gemm = FitOptions(fixed={p: getattr(Efficiency(), p) for p in fit.BOUNDS if p != "gemm_max"})
    held_back = fit_calibration(rows, options=only_gemm).per_arch["hopper"]["gemm_max"]
    monkeypatch.setattr(fit, "MEASURED_PRIORS", {})
    monkeypatch.setattr(calibration_module, "MEASURED_PRIORS", {})
    generic = fit_calibration(rows, options=only_gemm).per_arch["hopper"]["gemm_max"]
    # The generic prior's weak pull leaves the rows' answer.
    assert generic == pytest.approx(1.3 * g0, rel=0.01)

    # The measured one holds the rate back to where the pulls balance. Beyond one spread the prior is in the
    # Huber loss's linear part and pulls with C/g0 (C = 0.1); the four rows, each within C of its measurement
    # there, pull with 4·r·dr/dg, r their log-ratio.
    def log_ratio(g: float) -> float:
        at = replace(default_calibration(), per_arch={"hopper": {"gemm_max": g}})
        return math.log(predict_rows(rows[:1], at)[0] / measured)

    assert 1.1 * g0 < held_back < generic
    r, slope = log_ratio(held_back), (log_ratio(1.001 * held_back) - log_ratio(0.999 * held_back)) / (0.002 * held_back)
    assert -0.1 < r < 0.0
    assert 4 * r * slope == pytest.approx(-0.1 / g0, rel=0.03)
