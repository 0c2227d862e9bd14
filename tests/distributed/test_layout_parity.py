"""Per-step loss of every layout == the single-process loss (tiny-pangu, fp32, gloo, 10 steps), with
and without the overlapped schedule.

Several small layouts run side by side on disjoint ranks of one 8-process world (one start-up for
all of them); each process runs single-threaded. With one micro-batch per replica the overlapped
schedule would have nothing to pair, so the hierarchical EP4 layout runs its overlapped variant on
micro-batches of one sequence (two per replica), against its own single-process reference.
"""

from __future__ import annotations

import pytest
import torch
from _parity import assert_parity, losses_by_layout, single_thread_reference

from moetrain.config import ParallelConfig, TrainingConfig, load_model_config
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.step import build_layout, train_step
from moetrain.distributed.world import spawn

STEPS = 10
TRAINING = TrainingConfig(steps=STEPS, global_batch=8, micro_batch=2, seq_len=32, warmup_steps=2)
TRAINING_MICRO_1 = TRAINING.model_copy(update={"micro_batch": 1})
MICRO_1 = {"ep4_hierarchical_overlap"}
"""Layouts trained on micro-batches of one sequence."""
RANKS_PER_NODE = 2
BASE_ROUNDS: list[dict[str, ParallelConfig]] = [
    {
        "dp2": ParallelConfig(dp=2),
        "ep2": ParallelConfig(dp=2, ep=2),
        "pp2": ParallelConfig(pp=2),
        "pp2_vpp2": ParallelConfig(pp=2, vpp=2),
    },
    {
        "ep4_hierarchical": ParallelConfig(dp=4, ep=4, a2a="hierarchical"),
        "tp2_sp": ParallelConfig(tp=2, sp=True),
        "tp2_sp_ep2": ParallelConfig(tp=2, sp=True, ep=2),
    },
    {
        "tp2_pp2_ep2": ParallelConfig(tp=2, sp=True, pp=2, dp=2, ep=2),
    },
]
ROUNDS = BASE_ROUNDS + [
    {f"{name}_overlap": parallel.model_copy(update={"overlap": True}) for name, parallel in layouts.items()}
    for layouts in BASE_ROUNDS
]


def _training(layout: str) -> TrainingConfig:
    return TRAINING_MICRO_1 if layout in MICRO_1 else TRAINING


def _worker(rank: int, world_size: int) -> dict[str, list[float]]:
    model_cfg = load_model_config("tiny-pangu")
    losses: dict[str, list[float]] = {}
    for layouts in ROUNDS:
        offset, members = 0, []
        for name, parallel in layouts.items():
            members.append((name, ParallelDims.build(parallel, rank, RANKS_PER_NODE, rank_offset=offset)))
            offset += parallel.world_size
        for name, dims in members:
            if dims.is_member:
                cfg = _training(name)
                run = build_layout(dims, model_cfg, cfg, torch.device("cpu"))
                losses[name] = [train_step(run, step, cfg, torch.device("cpu")) for step in range(STEPS)]
    return losses


@pytest.fixture(scope="module")
def layout_losses() -> dict[str, list[list[float]]]:
    return losses_by_layout(spawn(_worker, 8))


@pytest.fixture(scope="module")
def single_process_losses() -> dict[int, list[float]]:
    """Reference losses by micro-batch size."""
    return {cfg.micro_batch: single_thread_reference(load_model_config("tiny-pangu"), cfg, STEPS)
            for cfg in (TRAINING, TRAINING_MICRO_1)}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", [name for layouts in ROUNDS for name in layouts])
def test_layout_matches_single_process(layout: str, layout_losses: dict,
                                       single_process_losses: dict[int, list[float]]) -> None:
    reference = single_process_losses[_training(layout).micro_batch]
    expected_ranks = next(p.world_size for layouts in ROUNDS for n, p in layouts.items() if n == layout)
    assert len(reference) == STEPS
    assert_parity(layout, layout_losses[layout], reference, expected_ranks)
    # The run trains: the loss moves (a frozen model would also "match" a frozen reference).
    assert reference[-1] < reference[0]
