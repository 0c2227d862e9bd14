"""Every layout trains like the single process, on the loop and step ``moetrain train`` runs: per-step
loss, its parts and the gradient norm within 1e-4 relative (tiny-pangu, fp32, gloo, real data
pipeline on a small corpus), with and without the overlapped schedule.

Several small layouts run side by side on disjoint ranks of one 8-process world (one start-up for all
of them); each process runs single-threaded. With one micro-batch per replica the overlapped schedule
would have nothing to pair, so the hierarchical EP4 layout runs its overlapped variant on micro-batches
of one sequence (two per replica), against its own single-process reference.
"""

from __future__ import annotations

import pytest
from _parity import (
    LOSS_FIELDS,
    assert_parity,
    losses_by_layout,
    run_spec,
    side_by_side,
    train_rows,
)

from moetrain.config import ParallelConfig, TrainingConfig
from moetrain.distributed.world import spawn

STEPS = 3
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
    {  # uneven pipeline chunks (8 layers in 6 and in 3 chunks: ``layers_per_chunk``)
        "pp2_vpp3_uneven": ParallelConfig(pp=2, vpp=3),
        "pp3_uneven": ParallelConfig(pp=3),
    },
]
ROUNDS = BASE_ROUNDS + [
    {f"{name}_overlap": parallel.model_copy(update={"overlap": True}) for name, parallel in layouts.items()}
    for layouts in BASE_ROUNDS
]


def _training(layout: str) -> TrainingConfig:
    return TRAINING_MICRO_1 if layout in MICRO_1 else TRAINING


def _worker(rank: int, world_size: int, data) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for layouts in ROUNDS:
        for name, parallel, dims in side_by_side(layouts, rank, RANKS_PER_NODE):
            spec = run_spec(_training(name), parallel, data, ranks_per_node=RANKS_PER_NODE)
            rows[name] = train_rows(spec, dims)
    return rows


@pytest.fixture(scope="module")
def single_process(references) -> dict[int, list[dict]]:
    """Reference rows by micro-batch size: the same loop with every degree 1."""
    return {cfg.micro_batch: references.rows(cfg) for cfg in (TRAINING, TRAINING_MICRO_1)}


@pytest.fixture(scope="module")
def layout_rows(corpus, single_process) -> dict[str, list[list[dict]]]:
    # after the reference: it has built the data cache the ranks then read
    return losses_by_layout(spawn(_worker, 8, corpus))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", [name for layouts in ROUNDS for name in layouts])
def test_layout_matches_single_process(layout: str, layout_rows: dict, single_process: dict) -> None:
    reference = single_process[_training(layout).micro_batch]
    expected_ranks = next(p.world_size for layouts in ROUNDS for n, p in layouts.items() if n == layout)
    assert len(reference) == STEPS
    assert_parity(layout, layout_rows[layout], reference, expected_ranks, fields=LOSS_FIELDS)
    # The run trains: the loss moves (a frozen model would also "match" a frozen reference).
    assert reference[-1]["loss"] < reference[0]["loss"]
    # The router's load statistics are those of the same global batch.
    for got, want in zip(layout_rows[layout][0], reference):
        assert got["expert_load_max_over_mean"] == pytest.approx(want["expert_load_max_over_mean"], rel=1e-4)
