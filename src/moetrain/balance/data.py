"""Data rearrangement: order a global batch's samples over data-parallel ranks and micro-batches so
that every rank has the same attention work in every micro-batch.

A packed sample's cost grows with the square of each document's length (attention over the document)
plus a linear term (projections and FFN per token). With expert parallelism every micro-batch ends
in an all-to-all that waits for the slowest rank, so the time of a step is
``sum over micro-batches of max over ranks`` of the micro-batch's cost; with data parallelism alone
it is ``max over ranks of the sum``. We minimise the first (which bounds the second):

1. sort samples by cost (ties by index: deterministic);
2. give each micro-batch round ``dp · micro_batch_size`` consecutive samples of that order, so that a
   round holds samples of similar cost;
3. inside a round, longest-processing-time-first over ranks, each rank taking exactly
   ``micro_batch_size`` samples.

The result is a permutation of the global batch: the same samples, so the same gradient (the loss is
normalised by the global token count), up to the order of floating-point sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moetrain.config.model import ModelConfig
from moetrain.costs.flops import attention_core_flops, layer_forward_flops
from moetrain.errors import UserError


def sample_costs(document_lengths: Sequence[Sequence[int]], model: ModelConfig) -> np.ndarray:
    """[N] forward FLOPs of one MoE-layer-shaped layer for each packed sample (documents attend only
    within themselves): per document of L tokens, L·(attention core at context L, causal) + L·(the
    rest of the layer per token). From ``moetrain.costs.flops``; the layer shape is the same for all
    samples, so one layer's cost orders them as the whole model's would."""
    per_token = layer_forward_flops(model, 1, moe_layer=model.moe is not None)
    linear = per_token.total - per_token.attention_core
    out = np.empty(len(document_lengths))
    for i, lengths in enumerate(document_lengths):
        lengths_array = np.asarray(lengths, dtype=float)
        if lengths_array.size == 0 or (lengths_array <= 0).any():
            raise UserError(f"sample {i} has document lengths {list(lengths)}; each must be a positive integer")
        core = lengths_array * attention_core_flops(model, lengths_array, causal=True)
        out[i] = float(core.sum() + linear * lengths_array.sum())
    return out


def _check(num_samples: int, dp: int, micro_batches: int, micro_batch_size: int) -> None:
    if min(dp, micro_batches, micro_batch_size) < 1:
        raise UserError(f"dp={dp}, micro_batches={micro_batches}, micro_batch_size={micro_batch_size} must be >= 1")
    if num_samples != dp * micro_batches * micro_batch_size:
        raise UserError(
            f"global batch has {num_samples} samples, but dp·micro_batches·micro_batch_size = "
            f"{dp}·{micro_batches}·{micro_batch_size} = {dp * micro_batches * micro_batch_size}"
        )


def naive_arrangement(num_samples: int, dp: int, micro_batches: int, micro_batch_size: int) -> np.ndarray:
    """[dp, M, mbs] the usual order: rank r takes the r-th contiguous slice of the batch."""
    _check(num_samples, dp, micro_batches, micro_batch_size)
    return np.arange(num_samples).reshape(dp, micro_batches, micro_batch_size)


def rearrange(costs: np.ndarray, dp: int, micro_batches: int, micro_batch_size: int) -> np.ndarray:
    """[dp, M, mbs] sample indices: balanced per (rank, micro-batch); see the module docstring."""
    costs = np.asarray(costs, dtype=float)
    _check(costs.size, dp, micro_batches, micro_batch_size)
    order = np.lexsort((np.arange(costs.size), -costs))  # heaviest first, ties by index
    arrangement = np.empty((dp, micro_batches, micro_batch_size), dtype=np.int64)
    per_round = dp * micro_batch_size
    for m in range(micro_batches):
        rank_cost = np.zeros(dp)
        filled = np.zeros(dp, dtype=np.int64)
        for sample in order[m * per_round : (m + 1) * per_round]:
            rank = int(np.argmin(np.where(filled < micro_batch_size, rank_cost, np.inf)))
            arrangement[rank, m, filled[rank]] = sample
            filled[rank] += 1
            rank_cost[rank] += costs[sample]
    return arrangement


def arrangement_cost(costs: np.ndarray, arrangement: np.ndarray) -> dict[str, float]:
    """Step cost of an arrangement: ``sum_m max_r`` (ranks synchronised every micro-batch, as with
    expert parallelism), ``max_r sum_m`` (synchronised once per step) and their perfect-balance bound."""
    per_cell = np.asarray(costs, dtype=float)[arrangement].sum(axis=-1)  # [dp, M]
    return {
        "sum_over_microbatches_of_max_rank": float(per_cell.max(axis=0).sum()),
        "max_rank_of_sum": float(per_cell.sum(axis=1).max()),
        "balanced_bound": float(per_cell.sum() / arrangement.shape[0]),
    }
