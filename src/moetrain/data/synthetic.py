"""Counting sequences: a corpus-free data source with the ``PackedDataset`` batch interface.

For benchmarks and tests that must not depend on a tokenizer or a text file. Each sequence counts up
by one from a random start modulo a small period, so a model learns it within a few steps; about one
label in ten is ignored, so the loss denominator is not simply batch × length. There are no document boundaries (no
document ids: plain causal attention). Batches are a function
of (seed, step) alone, split over data-parallel ranks exactly as ``PackedDataset.step_batch`` splits
its samples.
"""

from __future__ import annotations

import torch

from moetrain.data.packing import IGNORE_INDEX, MicroBatch, StepBatch


class SyntheticDataset:
    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.num_samples = 0
        """No finite corpus behind it (``describe`` lines read this)."""

    def global_batch(self, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, labels) of the whole global batch of ``step``, each [global_batch, seq_len]."""
        gen = torch.Generator().manual_seed(self.seed * 1000 + step)
        period = min(self.vocab_size, 64)
        starts = torch.randint(0, period, (global_batch, 1), generator=gen)
        tokens = (starts + torch.arange(self.seq_len + 1)) % period
        labels = tokens[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=gen) < 0.1] = IGNORE_INDEX
        return tokens[:, :-1].contiguous(), labels

    def step_batch(self, step: int, global_batch: int, micro_batch: int, dp_rank: int = 0,
                   dp_size: int = 1) -> StepBatch:
        input_ids, labels = self.global_batch(step, global_batch)
        per_rank = global_batch // dp_size
        micro_batches = []
        for start in range(dp_rank * per_rank, (dp_rank + 1) * per_rank, micro_batch):
            rows = slice(start, start + micro_batch)
            micro_batches.append(MicroBatch(input_ids[rows], labels[rows], None,
                                            int((labels[rows] != IGNORE_INDEX).sum())))
        return StepBatch(micro_batches, int((labels != IGNORE_INDEX).sum()), global_batch * self.seq_len)
