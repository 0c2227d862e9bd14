import numpy as np
import pytest

from moetrain.balance.costs import BalanceCostModel, OverlapWindow
from moetrain.balance.placement import ExpertPlacement, Move
from moetrain.balance.predict import EMAPredictor, HoltPredictor
from moetrain.balance.replay import replay
from moetrain.balance.schedule import LayerSchedule, ReplanRule
from moetrain.balance.traces import drifting_trace
from moetrain.config import load_cluster_config, load_model_config


@pytest.fixture(scope="module")
def costs() -> BalanceCostModel:
    return BalanceCostModel(load_model_config("deepseek-v3-671b"), load_cluster_config("h100-sxm-80gb"), 16)


@pytest.mark.slow
def test_adaptive_replan_follows_a_fast_drift_better_than_a_fixed_interval(costs):
    # a hot expert hands over every 10 steps, as fast as the fixed schedule re-plans
    trace = drifting_trace(60, 1, 256, 16 * 8192, 8, num_hot=8, hot_weight=6.0, period=10, seed=1)
    fixed = replay(trace, costs, HoltPredictor(0.5, 0.1), interval=10, adaptive=False)
    adaptive = replay(trace, costs, HoltPredictor(0.5, 0.1), interval=10)
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
    decision, adopted = rule.step(0, 0, schedule, placement, predictor, state, even)
    assert decision is not None and not decision.early and not decision.migrate and adopted is placement
    # an even load again: nothing drifted, so no solve until the interval has passed
    assert rule.step(1, 0, schedule, placement, predictor, state, even) == (None, placement)
    assert schedule.forecast_noise == 0.0  # the even load was forecast exactly
    # one expert takes a rank's worth of extra load: worth more than the cheapest move over the horizon
    skewed = even.copy()
    skewed[0] += 256 * 512 / 16
    predictor.update(state, skewed)
    decision, adopted = rule.step(2, 0, schedule, placement, predictor, state, skewed)
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
