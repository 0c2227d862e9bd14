import numpy as np
import pytest

from moetrain.balance.costs import BalanceCostModel, OverlapWindow
from moetrain.balance.placement import ExpertPlacement, Move
from moetrain.balance.predict import EMAPredictor, HoltPredictor
from moetrain.balance.replay import replay
from moetrain.balance.schedule import (
    COUNT_NOISE_GATE,
    NOISE_SMOOTHING,
    LayerSchedule,
    LayerStep,
    ReplanRule,
    count_noise_samples,
)
from moetrain.balance.traces import TraceShape, drifting_trace
from moetrain.config import load_cluster_config, load_model_config


@pytest.fixture(scope="module")
def costs() -> BalanceCostModel:
    return BalanceCostModel(load_model_config("deepseek-v3-671b"), load_cluster_config("h100-sxm-80gb"), 16)


@pytest.mark.slow
def test_adaptive_replan_follows_a_fast_drift_better_than_a_fixed_interval(costs):
    # a hot expert hands over every 10 steps, as fast as the fixed schedule re-plans
    trace = drifting_trace(TraceShape(60, 1, 256, 16, 16 * 8192, 8), num_hot=8, hot_weight=6.0, period=10, seed=1)
    fixed = replay(trace, ReplanRule(costs, interval=10, adaptive=False), HoltPredictor(0.5, 0.1))
    adaptive = replay(trace, ReplanRule(costs, interval=10), HoltPredictor(0.5, 0.1))
    assert fixed.summary()["early_solves"] == 0 and len(fixed.decisions) == 6
    assert adaptive.summary()["early_solves"] > 0
    # full re-plans keep their schedule: steps 0, 10, 20, ...
    assert [d.step for d in adaptive.decisions if not d.early] == [0, 10, 20, 30, 40, 50]
    assert adaptive.gap_to_ideal < fixed.gap_to_ideal
    assert adaptive.imbalance_after[1:].mean() < fixed.imbalance_after[1:].mean()


def test_check_solves_only_when_the_drift_pays_a_move(costs):
    rule = ReplanRule(costs, interval=10, horizon=50)
    placement = ExpertPlacement.contiguous(256, 16, 17)
    predictor = EMAPredictor(0.0)  # the forecast is the last step's load
    even = np.full(256, 512.0)
    state = predictor.init_state(even)
    schedule = LayerSchedule()
    decision, adopted = rule.step(LayerStep(0, 0, placement, even), schedule, predictor, state)
    assert decision is not None and not decision.early and not decision.migrate and adopted is placement
    # an even load again: nothing drifted, so no solve until the interval has passed
    assert rule.step(LayerStep(1, 0, placement, even), schedule, predictor, state) == (None, placement)
    assert schedule.forecast_noise == 0.0  # the even load was forecast exactly
    # one expert takes a rank's worth of extra load: worth more than the cheapest move over the horizon
    skewed = even.copy()
    skewed[0] += 256 * 512 / 16
    predictor.update(state, skewed)
    decision, adopted = rule.step(LayerStep(2, 0, placement, skewed), schedule, predictor, state)
    # the jump was not forecast: a fifth of the miss enters the running noise
    assert schedule.forecast_noise == pytest.approx(0.2 * rule.excess_seconds(placement, skewed))
    assert decision is not None and decision.early and decision.forecast_steps == 2
    assert decision.migrate and adopted is not placement
    # rank 0 holds experts 0-15 (the first 16 slots of 17)
    assert decision.imbalance_current == pytest.approx((16 * 512 + 8192) / ((256 * 512 + 8192) / 16))
    assert decision.imbalance_candidate < 1.01
    assert rule.cheapest_move_seconds == costs.migration_seconds([Move(0, (0, 0), (1, 0))],
                                                                 OverlapWindow(float("inf"), float("inf")))
    restored = LayerSchedule.from_state_dict(schedule.state_dict())
    assert restored == schedule
    np.testing.assert_array_equal(restored.previous_deviation, skewed - skewed.mean())


def test_savings_are_counted_on_for_as_long_as_the_skew_persists(costs):
    rule = ReplanRule(costs, interval=10, horizon=50)
    assert rule.lasting_steps(LayerSchedule()) == 50  # no evidence yet: the whole horizon
    persistent, alternating = LayerSchedule(), LayerSchedule()
    skew = np.where(np.arange(256) < 8, 2000.0, 500.0)
    for step in range(6):
        persistent.observe_deviation(skew)
        alternating.observe_deviation(skew if step % 2 else skew[::-1])
    assert persistent.persistence == pytest.approx(1.0)
    assert rule.lasting_steps(persistent) == 50
    # a hot set that flips every step keeps nothing of it: a saving lasts one step
    assert alternating.persistence == 0.0 and rule.lasting_steps(alternating) == 1.0
    half = LayerSchedule(lag_cross=1.0, lag_norm=2.0)
    assert half.persistence == 0.5
    assert rule.lasting_steps(half) == pytest.approx((1 - 0.5 ** 50) / 0.5)


def test_count_noise_draws_scatter_like_a_count_around_the_forecast():
    # a count with mean m scatters by √m: 4 ± 2 · z, 100 ± 10 · z, 0 stays 0
    forecast = np.array([0.0, 4.0, 100.0])
    draws = count_noise_samples(forecast, num_samples=8, seed=3)
    z = np.random.default_rng(3).standard_normal((8, 3))
    np.testing.assert_allclose(draws[:, 0], 0.0)
    np.testing.assert_allclose(draws[:, 1], np.maximum(4.0 + 2.0 * z[:, 1], 0.0))
    np.testing.assert_allclose(draws[:, 2], 100.0 + 10.0 * z[:, 2])
    # the same seed gives the same draws (every candidate of a solve is priced on the same loads)
    np.testing.assert_array_equal(draws, count_noise_samples(forecast, num_samples=8, seed=3))
    # many draws of a large count: mean m and spread √m
    many = count_noise_samples(np.array([10_000.0]), num_samples=20_000)[:, 0]
    assert many.mean() == pytest.approx(10_000.0, abs=2.0)
    assert many.std() == pytest.approx(100.0, rel=0.03)


def test_count_noise_prices_the_candidates_only_where_it_is_the_forecasts_error(costs):
    placement = ExpertPlacement.contiguous(256, 16, 17)
    loads = np.full(256, 512.0)
    loads[:16] = 4096.0  # rank 0's experts are hot
    predictor = EMAPredictor(0.0)
    rule = ReplanRule(costs, interval=10, horizon=50)
    # the step-time scatter the counts alone cause on this placement; the gate is 1.5 times it
    count = float(np.mean(np.abs(costs.layer_seconds(placement, count_noise_samples(loads))
                                 - costs.layer_seconds(placement, loads))))
    assert count > 0.0

    # the check first folds this step's miss into the forecast noise (new = 0.8 · old + 0.2 · miss); a schedule
    # that predicted this step's excess exactly misses by 0, so it enters the solve at 0.8 × what it held
    exact = rule.excess_seconds(placement, loads)

    def measured(noise: float) -> LayerSchedule:
        return LayerSchedule(predicted_excess=exact, forecast_noise=noise / (1.0 - NOISE_SMOOTHING))

    def solve(schedule: LayerSchedule, stall_remedies: bool = True) -> bool:
        rule = ReplanRule(costs, interval=10, horizon=50, stall_remedies=stall_remedies)
        decision, _ = rule.step(LayerStep(0, 0, placement, loads), schedule, predictor, predictor.init_state(loads))
        assert decision is not None
        return decision.count_noise

    # before a first plan no forecast error has been measured: the forecast prices the candidates
    assert not solve(LayerSchedule())
    assert COUNT_NOISE_GATE == 1.5
    # measured error within 1.5 times the counts' scatter: priced under count noise
    assert solve(measured(1.45 * count))
    # beyond it (a walk, a drift): on the forecast, as before
    assert not solve(measured(1.55 * count))
    # and never in the rule as it was before issue #28
    assert not solve(measured(0.0), stall_remedies=False)


@pytest.mark.parametrize(("ep", "priced_under_count_noise"), [(8, False), (16, True)])
def test_count_noise_prices_the_candidates_only_over_more_than_one_node(ep, priced_under_count_noise):
    # h100-sxm-80gb has 8 GPUs per node: EP8 is one node, EP16 two; rank 0's experts are hot, and the schedule
    # predicted this step's excess exactly (no forecast error at all, well within the gate)
    costs = BalanceCostModel(load_model_config("deepseek-v3-671b"), load_cluster_config("h100-sxm-80gb"), ep)
    assert costs.cluster.devices_per_node == 8
    placement = ExpertPlacement.contiguous(256, ep, 256 // ep + 1)
    loads = np.full(256, 512.0)
    loads[: 256 // ep] = 4096.0
    predictor = EMAPredictor(0.0)
    rule = ReplanRule(costs, interval=10, horizon=50)
    schedule = LayerSchedule(predicted_excess=rule.excess_seconds(placement, loads), forecast_noise=0.0)
    decision, adopted = rule.step(LayerStep(0, 0, placement, loads), schedule, predictor, predictor.init_state(loads))
    assert decision is not None
    assert decision.count_noise is priced_under_count_noise
    # the saving is priced on what the flag says: the mean over the draws around the forecast, or the forecast
    # itself (an EMA with theta 0 forecasts this step's load)
    assert decision.migrate and adopted is not placement
    priced_on = count_noise_samples(loads) if priced_under_count_noise else loads[None, :]
    per_step = np.mean(costs.layer_seconds(placement, priced_on)) - np.mean(costs.layer_seconds(adopted, priced_on))
    assert decision.predicted_saving_s == pytest.approx(decision.lasting_steps * per_step, rel=1e-12)


def test_the_rule_refuses_bad_tuning_before_any_step(costs):
    """The rule checks its own knobs when it is made (the online balancer and replay both rely on it)."""
    from moetrain.errors import UserError

    with pytest.raises(UserError, match=r"^unknown solver 'simplex'; choose one of: greedy, local, milp$"):
        ReplanRule(costs, solver="simplex")
    with pytest.raises(UserError, match=r"^interval=0 and horizon=50 must be >= 1$"):
        ReplanRule(costs, interval=0, horizon=50)
