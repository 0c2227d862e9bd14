"""Rollouts → the step's micro-batches: token sequences, the GRPO objective and the replay record.

Row b of a step is its prompt followed by its completion, as one training sequence: inputs are the
sequence less its last token, right-padded to ``seq_len``; the labels are the completion tokens (the
prompt and the padding are -100), so the runtime's loss normaliser, the label tokens of the global
batch, is the completion-token count GRPO's token-level mean divides by. At each label position sit the
token's rollout log-prob and its sample's advantage. The replay record's position axis is the
sequence's, so it is cut (or padded with -1) to ``seq_len`` as it is.

No forward computes the padding after a chunk's longest sample (``length_chunks``): each micro-batch, and
each chunk of a log-prob forward, is cut to its longest sample's inputs (rounded up to what the layout
splits), and with ``group_by_length`` the rows are taken shortest first, so that rows of like length
share a micro-batch (``Batching.chunks``). Attention is causal and routing per token, so a kept
position's output is the same as in the padded row; what changes is the router's balance statistics,
which no longer count the cut padding. The loss is GRPO's token-level sum over the global normaliser,
so neither the cut nor the grouping changes it beyond rounding.

Legend: B samples, S sequence slots, N generated slots, M decoder MoE layers, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.data.packing import IGNORE_INDEX, MicroBatch, StepBatch
from moetrain.rl.config import GRPOConfig
from moetrain.rl.generate import Generation
from moetrain.rl.grpo import OtherLogprobs, PolicyObjective, StepStats
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
    reference_logp_BS: torch.Tensor | None = None
    """The KL reference's log-probs when they come with the samples (a StaleSync reference worker's)."""

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

    def select(self, rows: torch.Tensor) -> TrainingSequences:
        """These rows only (``trained_rows``)."""
        take = lambda t: None if t is None else t.index_select(0, rows)
        return TrainingSequences(take(self.input_ids_BS), take(self.labels_BS), take(self.rollout_logp_BS),
                                 take(self.advantages_BS), take(self.expert_ids_BSMK))


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


def trained_rows(rewards_B: torch.Tensor, group_size: int, micro_batch: int, dp_size: int = 1,
                 micro_batch_multiple: int = 1) -> torch.Tensor | None:
    """The rows a step trains on when groups whose rewards are all equal are filtered out (None: every row).

    Such a group's advantages are all 0: its samples add nothing to the policy gradient, only tokens to the
    loss normaliser and compute to the step. DAPO (Yu et al. 2025, §3.2, "dynamic sampling") drops them
    and samples more prompts until the batch is full; here they are only dropped, so the step trains on
    fewer rows and the token-level mean is over the informative ones. Every row is kept when no group or
    every group differs. Across ranks, uniform groups are added back (in order) until the rows deal
    evenly: a multiple of ``dp_size`` rows in a number of micro-batches that ``micro_batch_multiple``
    divides (the data-parallel ranks, and interleaved pipeline stages, step through them together)."""
    groups_PG = rewards_B.view(-1, group_size)
    keep_P = groups_PG.amax(dim=1) > groups_PG.amin(dim=1)
    if bool(keep_P.all()) or not bool(keep_P.any()):
        return None
    uniform = (~keep_P).nonzero().flatten().tolist()

    def deals(num_groups: int) -> bool:
        rows = num_groups * group_size
        return rows % dp_size == 0 and -(-rows // micro_batch) % micro_batch_multiple == 0

    while not deals(int(keep_P.sum())):
        keep_P[uniform.pop(0)] = True  # the whole batch deals (the run's checks), so this ends
    return keep_P.repeat_interleave(group_size).nonzero().flatten()


@dataclass(frozen=True)
class Chunk:
    """Rows of a batch computed together, and the positions they need."""

    rows: torch.Tensor
    """int64 row indices into the batch, in the order they are computed."""
    length: int
    """Positions kept: the longest row's inputs, rounded up to the granule (at most the batch's length)."""

    def cut(self, t_BS: torch.Tensor | None) -> torch.Tensor | None:
        """``t_BS``'s chunk: its rows, its first ``length`` positions."""
        return None if t_BS is None else t_BS[:, : self.length].index_select(0, self.rows)


def input_lengths(labels_BS: torch.Tensor) -> torch.Tensor:
    """Per row, the positions a forward needs: up to the last label (int64 [B]; 0 for a row without one)."""
    positions_BS = torch.arange(labels_BS.shape[1]).expand_as(labels_BS)
    return torch.where(labels_BS != IGNORE_INDEX, positions_BS + 1, 0).amax(dim=1)


def length_chunks(lengths_B: torch.Tensor, rows: range, size: int, seq_len: int, granule: int = 1,
                  group_by_length: bool = False) -> list[Chunk]:
    """``rows`` of a batch of ``seq_len`` positions in chunks of ``size``, each cut to its longest row
    rounded up to a multiple of ``granule`` (the parts the layout splits a sequence into: tp with sequence
    parallelism; ``seq_len`` is a multiple of it), at most ``seq_len``; rows shortest first when
    ``group_by_length`` (a stable sort: ties keep their order)."""
    index = torch.tensor(list(rows), dtype=torch.long)
    if group_by_length:
        index = index[torch.sort(lengths_B[index], stable=True).indices]
    chunks = []
    for start in range(0, len(index), size):
        part = index[start:start + size]
        longest = max(int(lengths_B[part].max()), 1)
        chunks.append(Chunk(part, min(-(-longest // granule) * granule, seq_len)))
    return chunks


@dataclass(frozen=True)
class Batching:
    """How a step's rows become micro-batches."""

    micro_batch: int
    granule: int = 1
    """Kept positions are a multiple of this (the layout's tensor-parallel split)."""
    group_by_length: bool = True
    dp_rank: int = 0
    dp_size: int = 1

    def deal(self, labels_BS: torch.Tensor) -> list[list[Chunk]]:
        """Every data-parallel rank's micro-batches. Grouped by length: the global batch's rows shortest
        first, in micro-batches dealt to the ranks in turn, so that every layout trains the micro-batches
        of the one-process run (the same rows together: the router's balance statistics are per
        micro-batch) and the ranks get like lengths. Otherwise each rank's block of rows, as
        ``PackedDataset`` splits them."""
        batch, seq_len = labels_BS.shape
        lengths_B = input_lengths(labels_BS)
        if self.group_by_length:
            every = length_chunks(lengths_B, range(batch), self.micro_batch, seq_len, self.granule, True)
            if len(every) % self.dp_size:  # the ranks step through their micro-batches together (EP, PP)
                raise ValueError(f"{len(every)} micro-batches of {self.micro_batch} do not deal evenly to "
                                 f"{self.dp_size} data-parallel ranks")
            return [every[rank::self.dp_size] for rank in range(self.dp_size)]
        per_rank = batch // self.dp_size
        return [length_chunks(lengths_B, range(rank * per_rank, (rank + 1) * per_rank), self.micro_batch, seq_len,
                              self.granule) for rank in range(self.dp_size)]

    def chunks(self, labels_BS: torch.Tensor) -> list[Chunk]:
        """This rank's micro-batches (``deal``)."""
        return self.deal(labels_BS)[self.dp_rank]


def step_batch(sequences: TrainingSequences, cfg: GRPOConfig, batching: Batching, stats: StepStats,
               replay: bool, others: OtherLogprobs | None = None) -> StepBatch:
    """This data-parallel rank's micro-batches of the step (``Batching``), each with the reference's and
    π_old's log-probs of its rows (``others``). The step's token count is what every rank computes,
    padding within a micro-batch included."""
    others = OtherLogprobs() if others is None else others
    labels_BS = sequences.labels_BS
    record = sequences.expert_ids_BSMK if replay else None
    dealt = batching.deal(labels_BS)
    micro_batches = []
    for chunk in dealt[batching.dp_rank]:
        labels = chunk.cut(labels_BS)
        objective = PolicyObjective.of_rows(labels, chunk.cut(sequences.rollout_logp_BS),
                                            chunk.cut(sequences.advantages_BS), cfg, stats,
                                            OtherLogprobs(chunk.cut(others.ref_logp_BS), chunk.cut(others.old_logp_BS)))
        micro_batches.append(MicroBatch(chunk.cut(sequences.input_ids_BS), labels, None,
                                        int((labels != IGNORE_INDEX).sum()), objective, chunk.cut(record)))
    computed = sum(len(chunk.rows) * chunk.length for chunks in dealt for chunk in chunks)
    return StepBatch(micro_batches, int((labels_BS != IGNORE_INDEX).sum()), computed)
