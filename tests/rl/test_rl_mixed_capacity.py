"""The CPU capacity of a disaggregated job as ``rl_scale.py`` prices it: each process's share of a core
while the job's own mix runs (decode processes beside training ones), summed, then shared between the two
sides by processor sharing (``planner.rl_step.overlapped_time``). Values computed here by hand."""

import pytest

from moetrain.planner.rl_step import overlapped_time
from moetrain.rl.rates import DECODE, TRAIN, MixedCapacity, mixed_cores

# A decode step takes 10 ms alone and 20 ms among the others (half a core each); a training micro-batch
# 0.30 s alone and 0.75 s among them (0.4 of a core each): 2 × 0.5 + 2 × 0.4 = 1.8 cores.
TOGETHER = ((DECODE, 0.020), (DECODE, 0.020), (TRAIN, 0.75), (TRAIN, 0.75))


def test_mixed_cores_sum_each_process_share_of_a_core():
    assert mixed_cores({DECODE: 0.010, TRAIN: 0.30}, TOGETHER) == pytest.approx(1.8)
    assert MixedCapacity(0.010, 0.30, TOGETHER).shared == pytest.approx(1.8)
    # the sides need not get alike: 3 decoders at 0.8 of a core beside 1 trainer at 0.25
    uneven = ((DECODE, 0.0125),) * 3 + ((TRAIN, 1.2),)
    assert MixedCapacity(0.010, 0.30, uneven).shared == pytest.approx(2.65)


def test_the_step_shares_the_mixed_capacity_between_rollout_and_trainer():
    """2 replicas of 3 s of generation each beside 2 trainer ranks of 4 s each, on 1.8 cores: all 4 at
    1.8 / 4 = 0.45 of a core until the rollout side's 3 s are done (6.667 s), then the trainer's last
    second at min(1, 1.8 / 2) = 0.9 of a core (1.111 s): 7.778 s."""
    shared = MixedCapacity(0.010, 0.30, TOGETHER).shared
    assert overlapped_time(3.0, 4.0, shared, (2, 2)) == pytest.approx(3 / 0.45 + 1 / 0.9)
    assert overlapped_time(3.0, 4.0, shared, (2, 2)) == pytest.approx(7.7778, abs=1e-4)
