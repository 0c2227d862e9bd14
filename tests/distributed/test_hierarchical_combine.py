"""The hierarchical dispatcher's two combine sums (``moetrain.distributed.ep``), in one process: each
equals the scatter-add it replaces, sums in fp32 and rounds once, and has the gradients autograd would
give (``gradcheck`` in float64). Across ranks, ``test_dispatch.py`` checks flat == hierarchical ==
one process and ``test_hierarchical_memory.py`` what the combine keeps for backward."""

from __future__ import annotations

import torch

from moetrain.distributed.ep import _CombineInNode, _row_at, _SumOverNodes

# At a peer: 3 received hop-1 rows with k = 2 assignment slots each. Assignments 0, 1 (row 0) and 2
# (row 1) and 5 (row 2) are for this node; 3 and 4 for another. Expanded rows in (slot, ...) order:
# assignment 2, 0, 5, 1, so expand_order = [2, 0, 5, 1] and each expanded row came from hop-1 row
# expand_order // 2 = [1, 0, 2, 0].
EXPAND_ORDER = torch.tensor([2, 0, 5, 1])
EXPAND_ROW = EXPAND_ORDER // 2
# At the source: 3 tokens, 2 nodes; (node, token) pairs sent node-major: (0, 0), (0, 2), (1, 0), (1, 1),
# i.e. flat positions node·3 + token = [0, 2, 3, 4]; token 0 went to both nodes.
PAIRS = torch.tensor([0, 2, 3, 4])
TOKEN_INDEX = PAIRS % 3


def test_row_at_inverts_positions_and_marks_gaps_with_the_zero_row() -> None:
    # position p holds the row r with EXPAND_ORDER[r] = p; positions 3 and 4 hold none → 4 (the pad row)
    assert _row_at(EXPAND_ORDER, 6).view(3, 2).tolist() == [[1, 3], [0, 4], [4, 2]]
    # [T, N]: token 0 → rows 0 (node 0) and 2 (node 1), token 1 → node 1 only, token 2 → node 0 only
    assert _row_at(PAIRS, 6).view(2, 3).t().tolist() == [[0, 2], [4, 3], [1, 4]]


def test_combine_in_node_equals_a_weighted_scatter_add() -> None:
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    weights = torch.rand(4, generator=gen, dtype=torch.float64)
    out = _CombineInNode.apply(y, weights, EXPAND_ROW, _row_at(EXPAND_ORDER, 6).view(3, 2))
    expected = torch.zeros(3, 5, dtype=torch.float64).index_add_(0, EXPAND_ROW, y * weights.unsqueeze(-1))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)


def test_sum_over_nodes_equals_a_scatter_add() -> None:
    rows = torch.randn(4, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = _SumOverNodes.apply(rows, TOKEN_INDEX, _row_at(PAIRS, 6).view(2, 3).t())
    expected = torch.zeros(3, 5, dtype=torch.float64).index_add_(0, TOKEN_INDEX, rows)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)


def test_bf16_sums_round_once() -> None:
    """bf16 keeps 8 significant bits: near 1 its step is 2^-7, near 2^-7 it is 2^-15.

    At the peer, hop-1 row 0 sums expanded row 1 (1.0, weight 1) and row 3 (1.0, weight 3·2^-8 − 2^-20).
    In fp32: 1 + 3·2^-8 − 2^-20, just under the midpoint of 1 + 2^-7 and 1 + 2^-6, so one rounding
    gives 1 + 2^-7 = 1.0078125. Rounding the weighted row first gives 3·2^-8, the midpoint itself, and
    the sum ties to even: 1 + 2^-6 = 1.015625.

    At the source, a token's rows from 3 nodes, 1, 2^-8 and 2^-8: 1 + 2^-7 = 1.0078125 in fp32. Added
    one by one in bf16, 1 + 2^-8 ties to 1 (even) twice: 1.0."""
    y = torch.tensor([[0.0], [1.0], [0.0], [1.0]], dtype=torch.bfloat16)
    weights = torch.tensor([1.0, 1.0, 1.0, 3 * 2.0 ** -8 - 2.0 ** -20])
    out = _CombineInNode.apply(y, weights, EXPAND_ROW, _row_at(EXPAND_ORDER, 6).view(3, 2))
    assert out[0].item() == 1.0078125
    rows = torch.tensor([[1.0], [2.0 ** -8], [2.0 ** -8]], dtype=torch.bfloat16)
    # one token, 3 nodes: pairs (node, 0) at flat positions 0, 1, 2
    one_token = _row_at(torch.arange(3), 3).view(3, 1).t()
    assert _SumOverNodes.apply(rows, torch.zeros(3, dtype=torch.int64), one_token).item() == 1.0078125


def test_gradients_are_autograds() -> None:
    gen = torch.Generator().manual_seed(2)
    y = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(4, generator=gen, dtype=torch.float64, requires_grad=True)
    grid = _row_at(EXPAND_ORDER, 6).view(3, 2)
    assert torch.autograd.gradcheck(lambda a, w: _CombineInNode.apply(a, w, EXPAND_ROW, grid), (y, weights))
    rows = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    nodes = _row_at(PAIRS, 6).view(2, 3).t()
    assert torch.autograd.gradcheck(lambda a: _SumOverNodes.apply(a, TOKEN_INDEX, nodes), (rows,))
