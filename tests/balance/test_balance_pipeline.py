import itertools

import pytest

from moetrain.balance.pipeline import Piece, balance_stages, model_pieces, uniform_stages
from moetrain.config import load_cluster_config, load_model_config
from moetrain.errors import UserError


def _brute_force(pieces: list[Piece], num_stages: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(pieces)), num_stages - 1):
        bounds = [0, *cuts, len(pieces)]
        stages = [pieces[a:b] for a, b in zip(bounds, bounds[1:])]
        if all(any(p.is_layer for p in s) for s in stages):
            best = min(best, max(sum(p.seconds for p in s) for s in stages))
    return best


def test_dynamic_program_is_exact():
    seconds = [0.5, 1, 1, 3, 3, 3, 3, 2, 3, 6]
    pieces = [Piece("embedding", seconds[0], False)]
    pieces += [Piece(f"layer{i}", s, True) for i, s in enumerate(seconds[1:-1])]
    pieces.append(Piece("head", seconds[-1], False))
    for stages in (2, 3, 4):
        plan = balance_stages(pieces, stages)
        assert max(plan.stage_seconds) == pytest.approx(_brute_force(pieces, stages))
        assert sum(plan.stage_layers) == 8
        assert plan.boundaries[0] == 0


@pytest.mark.parametrize("stages", [4, 8])
def test_pangu_stages_even_out(stages):
    model = load_model_config("pangu-ultra-moe-718b")
    pieces = model_pieces(model, load_cluster_config("atlas-800t-a2"), 4096)
    assert pieces[0].name == "embedding" and pieces[-1].name == "head+mtp1"
    assert pieces[1].name == "layer0:dense" and pieces[4].name == "layer3:moe"
    uniform = uniform_stages(pieces, stages)
    balanced = balance_stages(pieces, stages)
    assert max(balanced.stage_seconds) < max(uniform.stage_seconds)
    assert balanced.max_over_mean < uniform.max_over_mean
    # the last stage carries the head and MTP, so it gets fewer layers, filled with no-ops
    assert balanced.stage_layers[-1] < balanced.stage_layers[0]
    assert balanced.noop_layers[-1] > 0
    assert all(n + k == max(balanced.stage_layers) for n, k in zip(balanced.stage_layers, balanced.noop_layers))


def test_too_many_stages():
    pieces = model_pieces(load_model_config("tiny-pangu"), load_cluster_config("cpu"), 256)
    with pytest.raises(UserError, match="num_stages=9 must be between 1 and the 8 decoder layers"):
        balance_stages(pieces, 9)
