"""Supervised warm-up on the task format: ``<bos>prompt answer<eos>``, loss on the answer and EOS only.

A randomly initialised tiny model almost never samples a correct answer, and GRPO learns nothing from a
group whose rewards are all equal (every advantage is 0). A few hundred steps of SFT on reference
answers give it the format and some successes; RL then improves on them. Problems come from the
training split only (``tasks.split_of``), so held-out evaluation stays unseen.

``TaskSFTDataset`` has the trainer's batch interface (``step_batch``): batches are a function of
(seed, step), so a resumed warm-up replays the same data, as ``PackedDataset`` does.
"""

from __future__ import annotations

import torch

from moetrain.data.packing import IGNORE_INDEX, MicroBatch, StepBatch
from moetrain.errors import UserError
from moetrain.rl.tasks import Problem, Task, problem_at, sequence_len_for
from moetrain.rl.tokenizer import CharTokenizer

__all__ = ["TaskSFTDataset", "prompt_ids", "sequence_len_for", "sft_sequence"]
"""``sequence_len_for`` lives in the torch-free ``tasks`` (the RL run spec derives the sequence length
with it); it is still importable from here."""


def prompt_ids(tokenizer: CharTokenizer, problem: Problem) -> list[int]:
    """What generation starts from: BOS and the prompt."""
    return [tokenizer.bos_id] + tokenizer.encode(problem.prompt)


def sft_sequence(tokenizer: CharTokenizer, problem: Problem) -> tuple[list[int], int]:
    """(BOS prompt answer EOS, number of prompt tokens)."""
    prompt = prompt_ids(tokenizer, problem)
    return prompt + tokenizer.encode(problem.answer) + [tokenizer.eos_id], len(prompt)


class TaskSFTDataset:
    def __init__(self, task: Task, tokenizer: CharTokenizer, seq_len: int, seed: int) -> None:
        self.task, self.tokenizer, self.seq_len, self.seed = task, tokenizer, seq_len, seed
        self.num_samples = 0
        """Problems are drawn without end (the trainer's description reads this)."""

    def rows(self, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, labels) [global_batch, seq_len] of step ``step``."""
        input_BS = torch.full((global_batch, self.seq_len), self.tokenizer.pad_id, dtype=torch.long)
        labels_BS = torch.full((global_batch, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        for row in range(global_batch):
            problem = problem_at(self.task, self.seed, "sft", step * global_batch + row)
            sequence, num_prompt = sft_sequence(self.tokenizer, problem)
            if len(sequence) - 1 > self.seq_len:
                raise UserError(f"a {self.task.name} example needs {len(sequence) - 1} tokens, more than "
                                f"--seq-len {self.seq_len}")
            inputs = torch.tensor(sequence[:-1])
            input_BS[row, : len(inputs)] = inputs
            labels_BS[row, num_prompt - 1: len(inputs)] = torch.tensor(sequence[num_prompt:])
        return input_BS, labels_BS

    def step_batch(self, step: int, global_batch: int, micro_batch: int, dp_rank: int = 0,
                   dp_size: int = 1) -> StepBatch:
        input_BS, labels_BS = self.rows(step, global_batch)
        per_rank = global_batch // dp_size
        micro_batches = []
        for start in range(dp_rank * per_rank, (dp_rank + 1) * per_rank, micro_batch):
            rows = slice(start, start + micro_batch)
            micro_batches.append(MicroBatch(input_BS[rows], labels_BS[rows], None,
                                            int((labels_BS[rows] != IGNORE_INDEX).sum())))
        return StepBatch(micro_batches, int((labels_BS != IGNORE_INDEX).sum()), global_batch * self.seq_len)
