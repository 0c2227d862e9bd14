"""Processes sharing fewer cores than there are processes (``moetrain.planner.rl_cores``): processor sharing
of each process's measured CPU-seconds per step, and the disaggregated step priced from them by
``price_rl_step``. Every expected value is worked out by hand in the comments."""

from __future__ import annotations

import pytest

from moetrain.config import ParallelConfig, load_cluster_config, load_model_config
from moetrain.errors import UserError
from moetrain.planner.calibration import load_calibration
from moetrain.planner.rl_cores import RoleCPU, cpu_bounds, processor_sharing_time, shared_cpu_step
from moetrain.planner.rl_step import RLLayout, RLWorkload, price_rl_step


def test_alike_processes_fill_the_cores():
    # 3 processes of 1 s each on 2 cores: each at 2/3 of a core, all done at 1.5 s (the total over the cores)
    assert processor_sharing_time([1.0, 1.0, 1.0], 2.0) == pytest.approx(1.5)
    # no more processes than cores: each on a core of its own, the largest sets the time
    assert processor_sharing_time([0.3, 0.5], 2.0) == pytest.approx(0.5)
    # more cores than processes: still one core each at most
    assert processor_sharing_time([0.3, 0.5], 4.0) == pytest.approx(0.5)
    # one core: time-sliced, the works add up
    assert processor_sharing_time([0.3, 0.5], 1.0) == pytest.approx(0.8)


def test_a_done_process_leaves_its_share_to_the_others():
    # works 0.2, 0.3, 0.6 on 2 cores. All 3 at 2/3 of a core until the 0.2 is done: 0.2 / (2/3) = 0.3 s.
    # Then 2 processes at a core each: the 0.3 one has 0.1 left (0.1 s), the 0.6 one 0.4 left (0.4 s).
    # Total 0.3 + 0.1 + 0.3 = 0.7 s.
    assert processor_sharing_time([0.6, 0.2, 0.3], 2.0) == pytest.approx(0.7)
    # 4 processes (0.1, 0.2, 0.2, 0.5) on 2 cores: 0.1 at half a core each (0.2 s); 3 left at 2/3 of a core,
    # 0.1 more each for the 0.2s (0.15 s); the 0.5 one alone for its last 0.3 (0.3 s): 0.65 s
    assert processor_sharing_time([0.1, 0.2, 0.2, 0.5], 2.0) == pytest.approx(0.65)
    # a machine worth 1.5 cores: 3 processes of 0.3 s at half a core each, 0.6 s
    assert processor_sharing_time([0.3, 0.3, 0.3], 1.5) == pytest.approx(0.6)


def test_processor_sharing_lies_between_the_two_bounds():
    work = RoleCPU(rollout_s=(0.3,), trainer_s=(0.2, 0.28))
    largest, over_cores = cpu_bounds(work, 2.0)
    assert (largest, over_cores) == (pytest.approx(0.3), pytest.approx(0.78 / 2))
    # 3 at 2/3 of a core until the 0.2 is done (0.3 s), then a core each: 0.08 more for the 0.28 one,
    # 0.1 more for the 0.3 one: 0.4 s
    step = shared_cpu_step(work, 2.0)
    assert step == pytest.approx(0.4)
    assert max(largest, over_cores) <= step


def test_overlapped_roles_cost_their_measured_cpu_factor():
    # apart: replica 0.25, trainer ranks 0.20 and 0.25; overlapped a replica's work costs ×1.2 (0.30) and a
    # trainer rank's ×1.1 (0.22, 0.275). On 2 cores: 3 at 2/3 of a core until the 0.22 is done (0.33 s),
    # then a core each: 0.055 more for the 0.275 one, 0.08 more for the 0.30 one: 0.41 s
    work = RoleCPU(rollout_s=(0.25,), trainer_s=(0.20, 0.25), overlap=(1.2, 1.1))
    assert work.processes == pytest.approx((0.30, 0.22, 0.275))
    assert work.total_s == pytest.approx(0.795)
    assert shared_cpu_step(work, 2.0) == pytest.approx(0.41)
    assert cpu_bounds(work, 2.0) == (pytest.approx(0.30), pytest.approx(0.3975))


def test_no_cores_is_refused():
    with pytest.raises(UserError, match=r"processes need cores to run on \(got 0\); give a positive core count"):
        processor_sharing_time([1.0], 0)


def _job(**layout) -> tuple[RLWorkload, RLLayout]:
    w = RLWorkload(load_model_config("tiny-pangu"), load_cluster_config("cpu"), 16, 8, 16, 8, "fp32")
    return w, RLLayout("disaggregated", 3, ParallelConfig(dp=2, micro_batch=64), rollout_devices=1, staleness=1,
                       **layout)


def test_a_step_on_one_cpu_is_its_processes_cpu_shared_over_the_cores():
    """1 replica of 0.30 CPU-s per step beside a DP2 trainer group of 0.20 and 0.28, on 2 cores: 0.40 s
    (above), whatever the priced phases."""
    work = RoleCPU(rollout_s=(0.30,), trainer_s=(0.20, 0.28))
    w, layout = _job(shared_cores=2.0, role_cpu=work)
    predicted = price_rl_step(w, layout, load_calibration())
    assert predicted.step_s == pytest.approx(0.4)
    assert predicted.generated_tokens_per_s == pytest.approx(w.generated_tokens / 0.4)
    # at k = 0 the sides alternate on their own cores: the priced phases, not the shared CPU
    alternating = RLLayout("disaggregated", 3, ParallelConfig(dp=2, micro_batch=64), rollout_devices=1,
                           staleness=0, shared_cores=2.0, role_cpu=work)
    serial = price_rl_step(w, alternating, load_calibration())
    ph = serial.phases
    assert serial.step_s == pytest.approx(ph.generate_s + ph.train_s + ph.push_s)


def test_role_cpu_must_match_the_layout():
    w, layout = _job(shared_cores=2.0, role_cpu=RoleCPU(rollout_s=(0.3, 0.3), trainer_s=(0.2, 0.2)))
    with pytest.raises(UserError, match=r"^CPU-seconds of 2 rollout and 2 trainer processes do not match the layout's "
                                        r"1 and 2; probe this layout.s job \(`moetrain profile --rl-out FILE "
                                        r"--rl-job rl.yaml`\)$"):
        price_rl_step(w, layout, load_calibration())
    w, layout = _job(role_cpu=RoleCPU(rollout_s=(0.3,), trainer_s=(0.2, 0.2)))
    with pytest.raises(UserError, match=r"^measured CPU-seconds per process price a disaggregated job on one CPU"):
        price_rl_step(w, layout, load_calibration())
