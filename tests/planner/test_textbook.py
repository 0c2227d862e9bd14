"""Textbook cases the simulator must reproduce exactly."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from moetrain.config import load_cluster_config, load_model_config
from moetrain.costs.activations import ActivationShape, Sharding, layer_activation_bytes
from moetrain.planner.calibration import Efficiency
from moetrain.planner.comm import RankGroup, alltoall_time, alltoall_volume
from moetrain.planner.device_memory import model_state_bytes
from moetrain.planner.schedules import build_schedule, interleaved_one_f_one_b, one_f_one_b
from moetrain.planner.timeline import StageCosts, simulate_timeline, uniform_costs


@pytest.mark.parametrize("pp,num_micro", [(2, 1), (4, 8), (8, 8), (8, 64), (16, 3)])
def test_1f1b_bubble_is_megatron_formula(pp: int, num_micro: int) -> None:
    result = simulate_timeline(pp, 1, num_micro, uniform_costs(pp, forward=1.0, backward=2.0))
    # (p − 1)/(m + p − 1) idle on every rank, step (m + p − 1)(f + b) (Narayanan et al. SC21 §2.2).
    assert result.step_time_s == pytest.approx((num_micro + pp - 1) * 3.0)
    for fraction in result.bubble_fraction:
        assert fraction == pytest.approx((pp - 1) / (num_micro + pp - 1))


@pytest.mark.parametrize("pp,vpp,num_micro", [(4, 2, 8), (4, 4, 16), (2, 3, 4)])
def test_interleaved_bubble_shrinks_by_vpp(pp: int, vpp: int, num_micro: int) -> None:
    result = simulate_timeline(pp, vpp, num_micro, uniform_costs(pp * vpp, 1.0 / vpp, 2.0 / vpp))
    # Interleaved 1F1B: bubble (p − 1)/v stage times (Narayanan et al. SC21 §2.2.2).
    assert result.step_time_s == pytest.approx(num_micro * 3.0 + (pp - 1) * 3.0 / vpp)


def test_schedules_run_every_pass_once() -> None:
    for ranks in (one_f_one_b(4, 6), interleaved_one_f_one_b(4, 2, 8), build_schedule(4, 1, 6, overlap=True)):
        for actions in ranks:
            forwards = [(a.micro_batch, a.chunk) for a in actions if a.kind in ("F", "FB")]
            backwards = [(a.micro_batch, a.chunk) for a in actions if a.kind == "B"] + [
                (a.bwd_micro_batch, a.bwd_chunk) for a in actions if a.kind == "FB"]
            assert sorted(forwards) == sorted(backwards)
            assert len(set(forwards)) == len(forwards)


def test_overlap_hides_all_to_all_in_steady_state() -> None:
    costs = uniform_costs(4, 1.0, 2.0, a2a=1.0)
    plain = simulate_timeline(4, 1, 16, costs, overlap=False)
    paired = simulate_timeline(4, 1, 16, costs, overlap=True)
    assert plain.a2a_exposed_s == pytest.approx(plain.a2a_total_s)
    # Only rank r's p − r warm-up forwards and as many cool-down backwards run alone (0.5 s of a2a each);
    # the result is averaged over ranks.
    assert paired.a2a_exposed_s == pytest.approx(sum((4 - r) * 2 * 0.5 for r in range(4)) / 4)
    assert paired.a2a_exposed_s < 0.25 * paired.a2a_total_s
    # Without a pipeline the pairing is a pure gain: m·(f + b) plus the unpaired first F and last B's a2a.
    single_plain = simulate_timeline(1, 1, 8, uniform_costs(1, 1.0, 2.0, a2a=1.0), overlap=False)
    single_paired = simulate_timeline(1, 1, 8, uniform_costs(1, 1.0, 2.0, a2a=1.0), overlap=True)
    assert single_plain.step_time_s == pytest.approx(8 * 4.0)
    assert single_paired.step_time_s == pytest.approx(8 * 3.0 + 1.0)


def test_a_paired_step_hides_no_more_than_its_layers_caps() -> None:
    # One rank, two micro-batches: F0 alone, the pair (F1, B0), B1 alone. F 1 s, B 2 s, 2 s of all-to-all
    # each, of which a pair hides at most 0.5 s per half (the layers' caps). Alone nothing hides:
    # F0 = 1 + 2 = 3 s; the pair = 3 + 4 − min(4, 3, 0.5 + 0.5) = 6 s; B1 = 2 + 2 = 4 s: 13 s.
    capped = replace(uniform_costs(1, 1.0, 2.0, a2a=4.0), hide_paired_forward=np.array([0.5]),
                     hide_paired_backward=np.array([0.5]))
    result = simulate_timeline(1, 1, 2, capped, overlap=True)
    assert result.step_time_s == pytest.approx(13.0)
    assert result.a2a_exposed_s == pytest.approx(2.0 + 3.0 + 2.0)
    # Without caps the pair hides as much as its compute, 3 s: 3 + 4 + 4 = 11 s.
    assert simulate_timeline(1, 1, 2, uniform_costs(1, 1.0, 2.0, a2a=4.0), overlap=True).step_time_s == (
        pytest.approx(11.0))


def test_an_action_alone_hides_its_own_share_and_places_its_spans() -> None:
    # One rank, one micro-batch: F (1 s, a2a 0.5 s of which its shared expert hides 0.4 s) then B (2 s, a2a
    # 0.5 s, hides 0.1 s). F exposes 0.1 s and ends at 1.1 s; B exposes 0.4 s and ends at 1.1 + 2.4 = 3.5 s.
    one = lambda x: np.array([x])  # noqa: E731
    costs = StageCosts(one(1.0), one(2.0), one(0.5), one(0.5), one(0.4), one(0.1))
    result = simulate_timeline(1, 1, 1, costs, overlap=True, record_spans=True)
    assert result.step_time_s == pytest.approx(3.5)
    assert result.a2a_exposed_s == pytest.approx(0.1 + 0.4)
    # Per action: compute from its start; the hidden a2a from the start too, the exposed after the compute.
    assert [(s.label, s.lane) for s in result.spans] == [
        ("F0.0", "compute"), ("F0.0", "a2a-hidden"), ("F0.0", "a2a-exposed"),
        ("B0.0", "compute"), ("B0.0", "a2a-hidden"), ("B0.0", "a2a-exposed")]
    assert [x for s in result.spans for x in (s.start, s.end)] == pytest.approx(
        [0.0, 1.0, 0.0, 0.4, 1.0, 1.1, 1.1, 3.1, 1.1, 1.2, 3.1, 3.5])
    # Without overlap nothing hides: 1.5 + 2.5 s.
    assert simulate_timeline(1, 1, 1, costs, overlap=False).step_time_s == pytest.approx(4.0)


def test_zero_memory_matches_zero_paper() -> None:
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N_d = 64, K = 12 → 120, 31.4, 16.6, 1.9 GB.
    psi = 7.5e9
    expected = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gigabytes in expected.items():
        assert model_state_bytes(psi, 64, stage) / 1e9 == pytest.approx(gigabytes, abs=0.05)
    assert model_state_bytes(psi, 64, 0) == 16 * psi


def test_all_to_all_volume_for_top_k() -> None:
    # Each token is sent to each of its k experts: tokens·k·hidden·bytes.
    assert alltoall_volume(4096, 7168, 8, 2.0) == 4096 * 8 * 7168 * 2
    cluster = load_cluster_config("h100-sxm-80gb")
    eff = Efficiency(bus_intra=1.0, bus_inter=1.0)
    send = float(alltoall_volume(4096, 7168, 8))
    # Inside one node: (ep − 1)/ep of the copies leave the rank, over NVLink.
    t = float(alltoall_time(send, RankGroup(8, 8), cluster, False, 8, efficiency=eff))
    expected = 7 / 8 * send / (cluster.intra_node_gbps * 1e9) + cluster.intra_node_latency_us * 1e-6
    assert t == pytest.approx(expected)
    # Across 4 nodes the hierarchical scheme sends each token once per remote node, not once per expert.
    flat = float(alltoall_time(send, RankGroup(32, 8), cluster, False, 8, efficiency=eff))
    hier = float(alltoall_time(send, RankGroup(32, 8), cluster, True, 8, efficiency=eff))
    assert hier < flat / 1.5


def test_activations_broadcast_over_layouts() -> None:
    model = load_model_config("pangu-ultra-moe-718b")
    tp = np.array([1, 2, 4, 8])
    parts = layer_activation_bytes(ActivationShape(model, 8192, 1, sharding=Sharding(tp=tp, sp=tp > 1)), True)
    assert np.asarray(parts.total).shape == (4,)
    assert np.all(np.diff(parts.total) < 0)


def test_no_schedule_deadlocks() -> None:
    for pp in (1, 2, 3, 4, 8):
        for vpp in (1, 2, 3):
            if vpp > 1 and pp == 1:
                continue
            for num_micro in range(1, 2 * pp + 3):
                if vpp > 1 and num_micro % pp:
                    continue
                for overlap in (False, True):
                    result = simulate_timeline(pp, vpp, num_micro, uniform_costs(pp * vpp, 1, 2, a2a=1), overlap)
                    assert result.step_time_s >= num_micro * 3


def test_schedules_equal_the_runtime_lists() -> None:
    """The planner simulates exactly the action lists the runtime executes."""
    from moetrain import schedules as runtime

    def as_tuple(step) -> tuple:
        if isinstance(step, runtime.Overlapped):
            f, b = step.forward, step.backward
            return ("FB", f.micro_batch, f.chunk, b.micro_batch, b.chunk)
        return (step.kind, step.micro_batch, step.chunk, -1, -1)

    for pp, vpp, num_micro in [(1, 1, 4), (2, 1, 1), (4, 1, 3), (4, 1, 8), (4, 2, 8), (3, 3, 6), (8, 2, 16)]:
        for overlap in (False, True):
            ours = [[(a.kind, a.micro_batch, a.chunk, a.bwd_micro_batch, a.bwd_chunk) for a in rank]
                    for rank in build_schedule(pp, vpp, num_micro, overlap)]
            theirs = [[as_tuple(s) for s in rank] for rank in runtime.build_schedule(pp, vpp, num_micro, overlap)]
            assert ours == theirs
