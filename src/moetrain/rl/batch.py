"""Rollouts → the step's micro-batches: token sequences, the GRPO objective and the replay record.

Row b of a step is its prompt followed by its completion, as one training sequence: inputs are the
sequence less its last token, right-padded to ``seq_len``; the labels are the completion tokens (the
prompt and the padding are -100), so the runtime's loss normaliser, the label tokens of the global
batch, is the completion-token count GRPO's token-level mean divides by. At each label position sit the
token's rollout log-prob and its sample's advantage. The replay record's position axis is the
sequence's, so it is cut (or padded with -1) to ``seq_len`` as it is.

Legend: B samples, S sequence slots, N generated slots, M decoder MoE layers, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.data.packing import IGNORE_INDEX, MicroBatch, StepBatch
from moetrain.rl.config import GRPOConfig
from moetrain.rl.generate import Generation
from moetrain.rl.grpo import PolicyObjective, StepStats
from moetrain.rl.tasks import Problem


@dataclass(frozen=True)
class Rollouts:
    """One step's samples, scored: the record a StaleSync buffer will hold (with its weight version)."""

    problems: list[Problem]
    """Per sample (each prompt repeated group_size times, groups contiguous)."""
    generation: Generation
    texts: list[str]
    rewards_B: torch.Tensor
    advantages_B: torch.Tensor

    @property
    def weight_version(self) -> int:
        return self.generation.weight_version


@dataclass(frozen=True)
class TrainingSequences:
    input_ids_BS: torch.Tensor
    labels_BS: torch.Tensor
    rollout_logp_BS: torch.Tensor
    advantages_BS: torch.Tensor
    expert_ids_BSMK: torch.Tensor | None


def training_sequences(rollouts: Rollouts, seq_len: int, pad_id: int) -> TrainingSequences:
    generation = rollouts.generation
    batch = len(generation.prompt_ids)
    input_BS = torch.full((batch, seq_len), pad_id, dtype=torch.long)
    labels_BS = torch.full((batch, seq_len), IGNORE_INDEX, dtype=torch.long)
    logp_BS = torch.zeros(batch, seq_len)
    advantages_BS = torch.zeros(batch, seq_len)
    logprobs_BN, advantages_B = generation.logprobs_BN.cpu(), rollouts.advantages_B.cpu()
    for row, prompt in enumerate(generation.prompt_ids):
        completion = generation.completion(row)
        sequence = prompt + completion
        num_inputs, first = len(sequence) - 1, len(prompt) - 1  # first: the label index of completion token 0
        assert num_inputs <= seq_len, f"sample of {num_inputs} input tokens exceeds seq_len {seq_len}"
        input_BS[row, :num_inputs] = torch.tensor(sequence[:-1])
        labels_BS[row, first:num_inputs] = torch.tensor(completion)
        logp_BS[row, first:num_inputs] = logprobs_BN[row, : len(completion)]
        advantages_BS[row, first:num_inputs] = advantages_B[row]
    record = generation.expert_ids_BSMK
    if record is not None:
        record = record.cpu()[:, :seq_len]
        if record.shape[1] < seq_len:
            pad = record.new_full((batch, seq_len - record.shape[1], *record.shape[2:]), -1)
            record = torch.cat([record, pad], dim=1)
    return TrainingSequences(input_BS, labels_BS, logp_BS, advantages_BS, record)


def step_batch(sequences: TrainingSequences, cfg: GRPOConfig, micro_batch: int, stats: StepStats,
               replay: bool, ref_logp_BS: torch.Tensor | None = None, dp_rank: int = 0,
               dp_size: int = 1, old_logp_BS: torch.Tensor | None = None) -> StepBatch:
    """This data-parallel rank's micro-batches of the step (rows split as ``PackedDataset`` splits them);
    ``old_logp_BS``: π_old of the ratio (the decoupled loss's proximal policy), None: the trained weights."""
    labels_BS = sequences.labels_BS
    batch, seq_len = labels_BS.shape
    per_rank = batch // dp_size
    micro_batches = []
    for start in range(dp_rank * per_rank, (dp_rank + 1) * per_rank, micro_batch):
        rows = slice(start, start + micro_batch)
        objective = PolicyObjective.of_rows(labels_BS[rows], sequences.rollout_logp_BS[rows],
                                            sequences.advantages_BS[rows], cfg, stats,
                                            None if ref_logp_BS is None else ref_logp_BS[rows],
                                            None if old_logp_BS is None else old_logp_BS[rows])
        record = sequences.expert_ids_BSMK
        micro_batches.append(MicroBatch(sequences.input_ids_BS[rows], labels_BS[rows], None,
                                        int((labels_BS[rows] != IGNORE_INDEX).sum()), objective,
                                        record[rows] if replay and record is not None else None))
    return StepBatch(micro_batches, int((labels_BS != IGNORE_INDEX).sum()), batch * seq_len)
