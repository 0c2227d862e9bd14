"""A micro-batch whose rows each lie inside one document carries no documents: plain causal attention."""

import numpy as np
import torch

from moetrain.data.packing import PackedDataset


class _Stream:
    """Two documents of 10 and 30 tokens: with sequences of 8, sample 1 (tokens 8..16) crosses the boundary."""

    tokens = np.arange(40, dtype=np.int64)
    document_index = np.array([0] * 10 + [1] * 30, dtype=np.int64)


def test_only_micro_batches_that_cross_a_document_boundary_carry_documents():
    dataset = PackedDataset(_Stream(), seq_len=8, seed=0)
    step = 0
    order = dataset.global_batch_indices(step, 4)
    batch = dataset.step_batch(step, 4, 1)
    for index, micro in zip(order, batch.micro_batches):
        if index == 1:
            assert torch.equal(micro.document_ids, torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]]))
        else:
            assert micro.document_ids is None
    together = dataset.step_batch(step, 4, 4).micro_batches[0].document_ids
    assert together is not None and together.shape == (4, 8)  # one crossing row keeps the batch's documents
