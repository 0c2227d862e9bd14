"""``moetrain plan --rl``'s search (``moetrain.planner.rl_search``): the split, the generation layout and k it
picks against a brute force over every one of them, the steady-state rule that carries k = 1's price to larger
k, what today's runtime runs, and what nothing fits."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from moetrain.config import ParallelConfig, load_cluster_config, load_model_config
from moetrain.errors import UserError
from moetrain.planner.calibration import load_calibration
from moetrain.planner.device_memory import GIB
from moetrain.planner.generation import HostCosts
from moetrain.planner.rl_search import (
    RLSearchOptions,
    generation_bytes,
    rl_runtime_limits,
    rollout_grid,
    search_rl,
)
from moetrain.planner.rl_step import RLLayout, RLWorkload, price_rl_step, training_prediction, training_workload
from moetrain.planner.search import TIE_TOLERANCE, SearchOptions, SearchSpace, search

CALIBRATION = load_calibration(None)
CLOUDMATRIX = str(Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "cloudmatrix-384-die.yaml")


def _workload(model: str = "tiny-qwen3", cluster: str = "h100-sxm-80gb", prompts: int = 32, group: int = 8,
              prompt_len: int = 128, response_len: int = 256) -> RLWorkload:
    return RLWorkload(load_model_config(model), load_cluster_config(cluster), prompts, group, prompt_len, response_len)


def _brute_force(w: RLWorkload, devices: int, max_k: int, host: HostCosts):
    """Every placement, split, generation replica size and k, each priced from scratch by ``price_rl_step``
    with the training search's best layout on its training devices; the fastest, ties to the smaller k, then
    colocated, then fewer rollout devices, then smaller replicas."""
    eff = CALIBRATION.for_device(w.cluster.device)
    experts = w.model.moe.num_experts
    best, trainers = None, {}
    splits = [("colocated", 0)] + [("disaggregated", r) for r in range(1, devices)]
    for (placement, rollout), g, k in itertools.product(splits, range(1, experts + 1), range(max_k + 1)):
        train_devices = devices - rollout if placement == "disaggregated" else devices
        if train_devices not in trainers:
            trainers[train_devices] = search(training_workload(w), train_devices, eff, SearchOptions(
                SearchSpace(cp=(1,)), top_k=1, timeline_top=1, time_every_choice=False)).ranked
        if experts % g or not trainers[train_devices]:
            continue
        layout = RLLayout(placement, devices, trainers[train_devices][0].parallel, g, rollout, k)
        try:
            step = price_rl_step(w, layout, CALIBRATION, host).step_s
        except UserError:  # g does not divide the generating devices, the samples do not split, colocated k ≥ 1
            continue
        key = (step, k, placement != "colocated", rollout, g)
        if best is None or key < best:
            best = key
    return best


@pytest.mark.parametrize("graphs", [False, True])
def test_the_search_picks_the_brute_force_best(graphs):
    w, devices = _workload(), 8
    host = HostCosts(moe_pass_us=0.0 if graphs else None)
    result = search_rl(w, devices, CALIBRATION, host, RLSearchOptions(max_staleness=2))
    assert not any("fit" in reason for reason in result.left_out)  # memory never binds: the brute force has no check
    step, k, disaggregated, rollout, g = _brute_force(w, devices, 2, host)
    win = result.winner.layout
    assert (win.placement == "disaggregated", win.rollout_devices, win.gen_devices_per_replica, win.staleness) == \
        (disaggregated, rollout, g, k)
    assert result.winner.step_s == pytest.approx(step, rel=1e-12)
    steps = [c.step_s for c in result.ranked]
    assert steps == sorted(steps)


def test_every_k_from_one_up_prices_the_same_and_the_smallest_is_kept():
    w = _workload()
    result = search_rl(w, 8, CALIBRATION, options=RLSearchOptions(placements=("disaggregated",), rollout_devices=4,
                                                                  gen_devices_per_replica=1, max_staleness=4))
    by_k = {c.staleness: c for c in result.ranked}
    assert sorted(by_k) == [0, 1, 2, 3, 4]
    layout = by_k[1].layout
    for k in (2, 3, 4):  # the carried price is what rl_step gives for that k
        direct = price_rl_step(w, RLLayout(layout.placement, 8, layout.train, 1, 4, k), CALIBRATION)
        assert by_k[k].step_s == pytest.approx(direct.step_s, rel=1e-12)
    assert result.winner.staleness == (1 if by_k[1].step_s < by_k[0].step_s else 0)
    assert any("prices the same" in line for line in result.why)


def test_colocated_generation_sits_beside_the_training_state_of_its_k():
    """Colocated at k = 0 a device holds the replica beside the weights, grads and optimizer state; at k ≥ 1 the
    update runs beside generation, so its activations too (the trainer's whole peak). A device that holds the
    first but not the second leaves the k ≥ 1 jobs out, by name."""
    w = _workload()
    options = RLSearchOptions(placements=("colocated",), max_staleness=1)
    result = search_rl(w, 1, CALIBRATION, options=options)
    (k0,), (k1,) = ([c for c in result.ranked if c.staleness == k] for k in (0, 1))
    memory = training_prediction(w, k0.layout, CALIBRATION).memory_gib
    resident = memory["weights"] + memory["grads"] + memory["optimizer"]
    assert memory["total"] > resident
    assert k0.device_gib == pytest.approx(k0.generation_gib + resident, rel=1e-12)
    assert k1.device_gib == pytest.approx(k1.generation_gib + memory["total"], rel=1e-12)
    # 95 % of the HBM at the trainer's peak and half the replica: the trainer and k = 0 fit, k = 1 does not
    limit_gib = memory["total"] + k1.generation_gib / 2
    assert k0.device_gib < limit_gib < k1.device_gib
    small = replace(w, cluster=w.cluster.model_copy(update={"hbm_gb": limit_gib * GIB / 0.95 / 1e9}))
    narrow = search_rl(small, 1, CALIBRATION, options=options)
    assert [c.staleness for c in narrow.ranked] == [0]
    # the trainer may break a tie with a layout that keeps less (a cheap selective recompute), never a slower one
    assert narrow.ranked[0].step_s <= k0.step_s * (1 + TIE_TOLERANCE)
    assert narrow.left_out == {"colocated: generation does not fit beside the training state": 1}


def test_two_devices_plan_what_the_runtime_runs():
    w = _workload("tiny-pangu", "cpu", 16, 8, 16, 8)
    result = search_rl(w, 2, CALIBRATION)
    assert {c.layout.placement for c in result.ranked} == {"colocated", "disaggregated"}
    assert all(not c.not_runnable for c in result.ranked)
    train_dp2 = result.ranked[0].layout.train.model_copy(update={"dp": 2})
    assert not rl_runtime_limits(w, RLLayout("disaggregated", 4, train_dp2, 1, 2, 1))  # 2 replicas, a DP2 trainer
    assert not rl_runtime_limits(w, RLLayout("disaggregated", 4, train_dp2, 2, 2, 1))  # one replica of 2 EP ranks


def test_a_disaggregated_trainer_of_several_ranks_needs_an_equal_share_of_the_samples():
    """The runtime refuses 1 generating beside 3 training ranks for 16 prompts × 8 (``moetrain rl --plan``: "128
    samples do not split over 3 generation replicas": the trainer's RL Fusion model deals the rows to its ranks)."""
    w = _workload("tiny-pangu", "cpu", 16, 8, 13, 16)  # 16 prompts × 8 = 128 samples
    pp3 = ParallelConfig(pp=3)
    assert rl_runtime_limits(w, RLLayout("disaggregated", 4, pp3, 1, 1, 1)) == [
        "128 samples per step do not split over the trainer's 3 ranks (each scores an equal share)"]
    assert rl_runtime_limits(w, RLLayout("disaggregated", 4, ParallelConfig(dp=2), 1, 2, 1)) == []  # 64 each
    assert rl_runtime_limits(w, RLLayout("disaggregated", 2, ParallelConfig(), 1, 1, 1)) == []  # one rank: no share


def test_jobs_on_several_nodes_run_when_their_groups_sit_on_whole_nodes():
    """Nodes of 8 H100s (``moetrain rl --nnodes``): a job runs when it fills whole nodes, each rollout replica
    inside one node or on whole nodes and each trainer TP group inside one node."""
    w = _workload()  # tiny-qwen3: 8 experts, so replicas of 1, 2, 4 or 8 devices
    assert w.cluster.devices_per_node == 8

    def layout(devices: int, rollout: int, g: int, tp: int = 1, placement: str = "disaggregated") -> RLLayout:
        training = devices - rollout if placement == "disaggregated" else devices
        train = ParallelConfig(tp=tp, sp=tp > 1, dp=training // tp)
        return RLLayout(placement, devices, train, g, rollout, 1)

    assert rl_runtime_limits(w, layout(16, 8, 8, tp=2)) == []  # a replica of a node beside a TP2 trainer's node
    assert rl_runtime_limits(w, layout(32, 16, 2, tp=8)) == []  # 8 replicas of 2 beside two nodes of TP8 groups
    assert rl_runtime_limits(w, layout(16, 0, 4, tp=4, placement="colocated")) == []
    assert rl_runtime_limits(w, layout(12, 4, 1)) == [
        "12 devices do not fill whole nodes of 8: moetrain rl --nnodes runs the same --nproc ranks on every node"]
    assert rl_runtime_limits(_workload(prompts=48), layout(16, 6, 2, tp=4)) == [  # 48 prompts: 16 per replica
        "on nodes of 8: the trainer's tp 4 group of ranks 6–9 would span nodes of 8 ranks: give each node (--nproc) "
        "a multiple of the group's 4 ranks, and start the trainer group on a node (its first rank 6 a multiple of the "
        "ranks per node)", "384 samples per step do not split over the trainer's 10 ranks (each scores an equal share)"]


def test_the_grid_keeps_small_jobs_whole_and_large_ones_in_powers_of_two():
    assert rollout_grid(2) == [1]
    assert rollout_grid(12) == list(range(1, 12))
    assert rollout_grid(768) == list(range(64, 768, 64))


def test_a_replica_holds_the_dense_weights_whole_and_its_share_of_the_experts():
    w = _workload("pangu-ultra-moe-718b", CLOUDMATRIX, 1, 1, 0, 1)
    one, two = generation_bytes(w, 32, 0), generation_bytes(w, 64, 0)
    # halving the share of the routed experts saves half of a 32-device share of them
    from moetrain.costs.params import count_params

    experts = count_params(w.model).experts * 2.0
    assert one - two == pytest.approx(experts / 64, rel=1e-9)


@pytest.mark.parametrize(("options", "devices", "expected"), [
    (RLSearchOptions(rollout_devices=2), 2, "leaves no trainer"),
    (RLSearchOptions(placements=("disaggregated",)), 1, "too few"),
    (RLSearchOptions(max_staleness=-1), 2, "cannot be negative"),
])
def test_options_that_leave_nothing_to_search_are_refused(options, devices, expected):
    with pytest.raises(UserError, match=expected):
        search_rl(_workload("tiny-pangu", "cpu", 16, 8, 16, 8), devices, CALIBRATION, options=options)


def test_too_few_devices_for_the_smallest_job_names_what_it_needs():
    w = _workload("pangu-ultra-moe-718b", CLOUDMATRIX, 96, 16, 1024, 4096)
    with pytest.raises(UserError, match="fits 8 × cloudmatrix-384-die.*one generation replica alone needs 64 devices"):
        search_rl(w, 8, CALIBRATION)
