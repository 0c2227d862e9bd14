import numpy as np
import pytest

from moetrain.balance.predict import (
    AdaptivePredictor,
    EMAPredictor,
    HoltPredictor,
    forecast_error,
    forecasts,
    future_means,
    select_predictor,
)
from moetrain.balance.traces import TraceShape, drifting_trace, zipf_trace
from moetrain.errors import UserError


def test_ema_known_values():
    predictor = EMAPredictor(0.5)
    out = forecasts(predictor, np.array([[4.0], [8.0], [0.0]]), horizon=3)
    assert out[:, 0].tolist() == [4.0, 6.0, 3.0]


def test_holt_follows_a_linear_trend_exactly():
    loads = np.arange(20, dtype=float)[:, None] * 3.0 + 10.0
    out = forecasts(HoltPredictor(1.0, 1.0), loads, horizon=4)
    # after two steps level and slope are exact; mean of the next 4 steps = last + 3·2.5
    assert out[5:, 0] == pytest.approx(loads[5:, 0] + 3.0 * 2.5)
    assert forecast_error(HoltPredictor(1.0, 1.0), loads, horizon=4) < 1e-12
    assert forecast_error(EMAPredictor(0.9), loads, horizon=4) > 0.1


def test_future_means():
    loads = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert future_means(loads, 2).tolist() == [2.5, 3.5, 4.5]


def test_constant_loads_have_zero_error():
    loads = np.full((30, 2, 8), 5.0)
    assert forecast_error(EMAPredictor(0.9), loads) == 0.0


def test_selection_prefers_trend_on_drift_and_smoothing_on_noise():
    drift = drifting_trace(TraceShape(120, 2, 32, 1, 50000, 2), num_hot=4, hot_weight=10.0, period=30, seed=0)
    best, errors = select_predictor(drift.tokens_per_expert, horizon=5)
    assert best.name.startswith("holt"), errors
    assert errors[best.name] == min(errors.values())
    noise = zipf_trace(TraceShape(60, 2, 32, 1, 2000, 2), exponent=1.0, seed=0)
    best, errors = select_predictor(noise.tokens_per_expert, horizon=5)
    assert best.name.startswith("ema") and best.theta >= 0.8, errors


def test_errors_are_user_errors():
    with pytest.raises(UserError, match=r"EMA theta=1.5 must be in \[0, 1\)"):
        EMAPredictor(1.5)
    with pytest.raises(UserError, match="trace has 4 steps"):
        forecast_error(EMAPredictor(0.5), np.ones((4, 1, 2)))


def test_adaptive_errors_known_values():
    # last value vs half-way smoothing, loads 10 → 20 → 20, smoothing 0.2:
    # step 2: both forecast 10, miss |10 − 20| / 20 = 0.5 → errors 0.2·0.5 = 0.1 each
    # step 3: last value forecasts 20 (miss 0), EMA(0.5) 15 (miss 0.25) → 0.08 and 0.1 + 0.2·0.15 = 0.13
    predictor = AdaptivePredictor((EMAPredictor(0.0), EMAPredictor(0.5)), smoothing=0.2)
    state = predictor.init_state(np.array([10.0]))
    predictor.update(state, np.array([20.0]))
    np.testing.assert_allclose(state["error"], [0.1, 0.1])
    assert predictor.chosen(state).theta == 0.0  # a tie goes to the first candidate
    predictor.update(state, np.array([20.0]))
    np.testing.assert_allclose(state["error"], [0.08, 0.13])
    assert predictor.forecast(state, 5).tolist() == [20.0]
    np.testing.assert_allclose(state["1.level"], [17.5])  # EMA(0.5) of 10, 20, 20 (every candidate updates)


def test_adaptive_picks_the_trend_on_a_ramp_and_smoothing_on_noise():
    ramp = np.arange(40, dtype=float)[:, None] * 5.0 + np.array([100.0, 400.0])  # two experts, both rising
    predictor = AdaptivePredictor()
    state = predictor.init_state(ramp[0])
    for row in ramp[1:]:
        predictor.update(state, row)
    assert isinstance(predictor.chosen(state), HoltPredictor)
    # Holt's mean over the next 4 steps of a line: last + slope·2.5, within its smoothing's lag
    np.testing.assert_allclose(predictor.forecast(state, 4), ramp[-1] + 5.0 * 2.5, rtol=0.02)
    rng = np.random.default_rng(5)
    noise = 1000.0 + rng.normal(0.0, 50.0, (80, 8))  # stationary: the long averages forecast best
    state = predictor.init_state(noise[0])
    for row in noise[1:]:
        predictor.update(state, row)
    chosen = predictor.chosen(state)
    assert isinstance(chosen, EMAPredictor) and chosen.theta >= 0.9, chosen.name


def test_adaptive_state_survives_a_json_round_trip():
    # the runtime checkpoints predictor states as lists (``OnlineExpertBalancer.state_dict``)
    predictor = AdaptivePredictor()
    loads = zipf_trace(TraceShape(12, 1, 8, 1, 4000, 2), exponent=1.0, seed=3).tokens_per_expert[:, 0].astype(float)
    state = predictor.init_state(loads[0])
    for row in loads[1:6]:
        predictor.update(state, row)
    restored = {k: np.array(v.tolist(), dtype=np.float64) for k, v in state.items()}
    for row in loads[6:]:
        predictor.update(state, row)
        predictor.update(restored, row)
    np.testing.assert_array_equal(predictor.forecast(state, 3), predictor.forecast(restored, 3))
    assert predictor.name == "adaptive"
    assert AdaptivePredictor((EMAPredictor(0.5),)).name == "adaptive(ema(theta=0.5);smoothing=0.2)"
    with pytest.raises(UserError, match="at least one candidate"):
        AdaptivePredictor(())
