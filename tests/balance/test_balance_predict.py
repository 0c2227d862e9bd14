import numpy as np
import pytest

from moetrain.balance.predict import (
    EMAPredictor,
    HoltPredictor,
    forecast_error,
    forecasts,
    future_means,
    select_predictor,
)
from moetrain.balance.traces import drifting_trace, zipf_trace
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
    drift = drifting_trace(120, 2, 32, 50000, 2, num_hot=4, hot_weight=10.0, period=30, seed=0)
    best, errors = select_predictor(drift.tokens_per_expert, horizon=5)
    assert best.name.startswith("holt"), errors
    assert errors[best.name] == min(errors.values())
    noise = zipf_trace(60, 2, 32, 2000, 2, exponent=1.0, seed=0)
    best, errors = select_predictor(noise.tokens_per_expert, horizon=5)
    assert best.name.startswith("ema") and best.theta >= 0.8, errors


def test_errors_are_user_errors():
    with pytest.raises(UserError, match=r"EMA theta=1.5 must be in \[0, 1\)"):
        EMAPredictor(1.5)
    with pytest.raises(UserError, match="trace has 4 steps"):
        forecast_error(EMAPredictor(0.5), np.ones((4, 1, 2)))
