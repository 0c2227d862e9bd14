"""Layout grids, validation before start, and schedules as data (no process group needed)."""

from __future__ import annotations

import pytest

from moetrain.config import ParallelConfig, load_model_config
from moetrain.distributed.layout import rank_groups, validate_layout
from moetrain.distributed.parallelize import chunk_layers
from moetrain.errors import UserError
from moetrain.schedules import Action, build_schedule, interleaved_1f1b, one_f_one_b

TINY = load_model_config("tiny-pangu")


def test_rank_groups_tp2_pp2_ep2() -> None:
    groups = rank_groups(ParallelConfig(tp=2, pp=2, dp=2, ep=2), ranks_per_node=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["stage"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # Experts regroup one stage's 4 ranks as edp=2 × ep=2.
    assert groups["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["edp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["embed"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_hierarchical_groups_two_nodes_of_two() -> None:
    groups = rank_groups(ParallelConfig(dp=4, ep=4), ranks_per_node=2, rank_offset=4)
    assert groups["ep"] == [[4, 5, 6, 7]]
    assert groups["ep_intra"] == [[4, 5], [6, 7]]
    assert groups["ep_inter"] == [[4, 6], [5, 7]]


@pytest.mark.parametrize(("parallel", "world", "message"), [
    (ParallelConfig(dp=2), 4, "tp·cp·pp·dp = 1·1·1·2 = 2 but the world has 4 processes"),
    (ParallelConfig(pp=2, vpp=8), 2, "8 layers cannot fill pp·vpp = 16 pipeline chunks of at least one layer"),
    (ParallelConfig(tp=8, dp=1), 8, "4 attention heads do not divide by tp=8"),
    (ParallelConfig(dp=8, ep=8, a2a="hierarchical"), 8, "needs the node size"),
])
def test_layout_refused_before_start(parallel: ParallelConfig, world: int, message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_layout(parallel, TINY, world)


def test_experts_must_divide_by_ep() -> None:
    odd = TINY.model_copy(update={"moe": TINY.moe.model_copy(update={"num_experts": 12})})
    with pytest.raises(UserError, match="12 experts do not divide by ep=8"):
        validate_layout(ParallelConfig(dp=8, ep=8), odd, 8)


def test_batch_must_split_over_replicas() -> None:
    with pytest.raises(UserError, match="global batch 6 does not split into dp=4"):
        validate_layout(ParallelConfig(dp=4), TINY, 4, global_batch=6, micro_batch=1)


def test_one_f_one_b_known_lists() -> None:
    f, b = (lambda m: Action("F", 0, m)), (lambda m: Action("B", 0, m))
    assert one_f_one_b(2, 3, 0) == [f(0), f(1), b(0), f(2), b(1), b(2)]
    assert one_f_one_b(2, 3, 1) == [f(0), b(0), f(1), b(1), f(2), b(2)]


def test_interleaved_schedule_covers_every_unit_once_in_order() -> None:
    pp, vpp, micro = 2, 2, 4
    for rank, actions in enumerate(build_schedule(pp, vpp, micro)):
        forwards = [(a.chunk, a.micro_batch) for a in actions if a.kind == "F"]
        backwards = [(a.chunk, a.micro_batch) for a in actions if a.kind == "B"]
        assert sorted(forwards) == sorted(backwards) == [(c, m) for c in range(vpp) for m in range(micro)]
        for key in forwards:  # a backward never precedes its forward
            assert actions.index(Action("F", *key)) < actions.index(Action("B", *key))
        # Warm-up of Megatron's interleaved schedule: 2·(pp - r - 1) + (vpp - 1)·pp forwards.
        warmup = next(i for i, a in enumerate(actions) if a.kind == "B") - 1
        assert warmup == 2 * (pp - rank - 1) + (vpp - 1) * pp
    with pytest.raises(ValueError, match="divisible by pp=2"):
        interleaved_1f1b(2, 2, 3, 0)


def test_chunks_interleave_over_ranks() -> None:
    chunks = chunk_layers(8, pp=2, vpp=2, pp_rank=1)
    assert [(c.index, c.layers, c.is_first, c.is_last) for c in chunks] == [
        (1, (2, 3), False, False), (3, (6, 7), False, True)]


def test_hidden_fraction_counts_only_async_exchanges_under_compute() -> None:
    from moetrain.distributed.trace import Span, hidden_fraction

    spans = [
        Span("F0", "compute", 0.0, 10.0),
        Span("a2a_dispatch", "comm", 2.0, 4.0),  # synchronous: the main thread waits, nothing hidden
        Span("a2a_combine", "comm", 5.0, 13.0, lane="async"),  # 5..10 under compute, 10..13 exposed
    ]
    assert hidden_fraction(spans) == pytest.approx(5.0 / 10.0)
    assert hidden_fraction([Span("F0", "compute", 0.0, 1.0)]) == 1.0


def test_uneven_pipeline_chunks_even_out_the_ranks_work() -> None:
    from moetrain.distributed.layout import layers_per_chunk

    assert layers_per_chunk(8, 2, 2) == [2, 2, 2, 2]  # divisible: equal chunks
    # Pangu: 61 layers over pp8 × vpp6, one MTP module; counts by hand: every rank carries 8 layer-equivalents
    # but the first (7: it also embeds) and the last (6 + MTP + head)
    counts = layers_per_chunk(61, 8, 6, 1)
    assert sum(counts) == 61 and min(counts) == 1 and max(counts) == 2
    assert [sum(counts[r::8]) for r in range(8)] == [7, 8, 8, 8, 8, 8, 8, 6]
    assert counts[0] == 1 and counts[-1] == 1  # the first and last chunks take no extra layer
    assert layers_per_chunk(8, 3, 1, 1) == [3, 3, 2]
