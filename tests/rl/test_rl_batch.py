"""Micro-batches of an RL step: cut to their longest sample, grouped by length, the same in every layout."""

import pytest
import torch
from rl_models import small_model

from moetrain.rl.batch import Batching, TrainingSequences, input_lengths, length_chunks, step_batch, trained_rows
from moetrain.rl.config import GRPOConfig
from moetrain.rl.grpo import OtherLogprobs, ScoredTokens, StepStats, grpo_token_loss
from moetrain.rl.loop import policy_logprobs

IGNORE = -100


def _sequences(inputs: list[int], labels: list[tuple[int, int]], seq_len: int, seed: int = 0) -> TrainingSequences:
    """Rows of ``inputs[b]`` input tokens (the rest padding, id 0) whose labels sit at positions
    [first, last) of ``labels[b]``."""
    g = torch.Generator().manual_seed(seed)
    batch = len(inputs)
    input_BS = torch.zeros(batch, seq_len, dtype=torch.long)
    labels_BS = torch.full((batch, seq_len), IGNORE)
    for row, (count, (first, last)) in enumerate(zip(inputs, labels, strict=True)):
        input_BS[row, :count] = torch.randint(3, 60, (count,), generator=g)
        labels_BS[row, first:last] = torch.randint(3, 60, (last - first,), generator=g)
    return TrainingSequences(input_BS, labels_BS, -torch.rand(batch, seq_len, generator=g),
                             torch.randn(batch, 1, generator=g).expand(batch, seq_len).clone(), None)


def test_input_lengths_end_at_each_rows_last_label():
    labels = torch.full((3, 8), IGNORE)
    labels[0, 2:5] = 7   # last label at 4: positions 0..4 are needed
    labels[1, 7] = 7     # the whole row
    assert input_lengths(labels).tolist() == [5, 8, 0]


def test_chunks_cut_to_their_longest_row_rounded_up_to_the_granule():
    lengths = torch.tensor([5, 2, 7, 3])
    plain = length_chunks(lengths, range(4), 2, seq_len=8)
    assert [(c.rows.tolist(), c.length) for c in plain] == [([0, 1], 5), ([2, 3], 7)]
    grouped = length_chunks(lengths, range(4), 2, seq_len=8, group_by_length=True)
    assert [(c.rows.tolist(), c.length) for c in grouped] == [([1, 3], 3), ([0, 2], 7)]
    split = length_chunks(lengths, range(4), 2, seq_len=8, granule=4, group_by_length=True)
    assert [c.length for c in split] == [4, 8]  # 7 rounds up to 8, never past the batch's length


def test_every_layout_trains_the_one_process_runs_micro_batches():
    labels = torch.full((8, 16), IGNORE)
    for row, last in enumerate([9, 3, 12, 5, 16, 2, 7, 11]):
        labels[row, last - 1] = 1
    one = Batching(micro_batch=2).chunks(labels)
    assert [c.length for c in one] == [3, 7, 11, 16]  # shortest first: rows (5, 1), (3, 6), (0, 7), (2, 4)
    ranks = [Batching(micro_batch=2, dp_rank=r, dp_size=2).chunks(labels) for r in range(2)]
    assert [[c.rows.tolist() for c in rank] for rank in ranks] == [[[5, 1], [0, 7]], [[3, 6], [2, 4]]]
    ungrouped = Batching(micro_batch=2, group_by_length=False, dp_rank=1, dp_size=2).chunks(labels)
    assert [c.rows.tolist() for c in ungrouped] == [[4, 5], [6, 7]]  # the rank's block, as before
    with pytest.raises(ValueError, match="3 micro-batches of 2 do not deal evenly to 2 data-parallel ranks"):
        Batching(micro_batch=2, dp_size=2).chunks(labels[:6])


def test_a_cut_micro_batch_scores_its_tokens_as_the_padded_rows_do():
    """Attention is causal and routing per token: the positions kept give the padded forward's log-probs."""
    seq_len = 12
    sequences = _sequences([6, 12, 4, 9], [(3, 6), (5, 12), (1, 4), (4, 9)], seq_len)
    model = small_model(vocab_size=64)
    full = policy_logprobs(model, sequences.input_ids_BS, sequences.labels_BS, 1.0)
    batch = step_batch(sequences, GRPOConfig(group_size=2), Batching(micro_batch=2, granule=2), StepStats.zeros("cpu"),
                       replay=False)
    assert [tuple(m.input_ids.shape) for m in batch.micro_batches] == [(2, 6), (2, 12)]  # rows (2, 0), (3, 1)
    assert batch.global_tokens == 2 * 6 + 2 * 12 and batch.global_label_tokens == 3 + 7 + 3 + 5
    for micro, rows in zip(batch.micro_batches, ([2, 0], [3, 1]), strict=True):
        cut = policy_logprobs(model, micro.input_ids, micro.labels, 1.0)
        length = micro.input_ids.shape[1]
        torch.testing.assert_close(cut, full[rows, :length], rtol=1e-5, atol=1e-6)
        assert micro.num_label_tokens == int((sequences.labels_BS[rows] != IGNORE).sum())
        # the objective's tokens are the rows' labels, in the cut micro-batch's row-major order
        torch.testing.assert_close(micro.objective.labels_T, micro.labels[micro.labels != IGNORE])



def test_each_micro_batch_carries_its_rows_reference_and_proximal_log_probs():
    # rows (2, 0) cut to 6 positions, then (3, 1) to 12, as above: each objective holds the [B, S] log-probs of
    # its rows at their label positions, row-major (row 2 labels 1-3, row 0 labels 3-5, ...)
    seq_len = 12
    sequences = _sequences([6, 12, 4, 9], [(3, 6), (5, 12), (1, 4), (4, 9)], seq_len)
    ref_BS = -torch.arange(4 * seq_len, dtype=torch.float32).reshape(4, seq_len) / 100
    old_BS = ref_BS - 1.0
    batch = step_batch(sequences, GRPOConfig(group_size=2), Batching(micro_batch=2, granule=2), StepStats.zeros("cpu"),
                       replay=False, others=OtherLogprobs(ref_BS, old_BS))
    expected_ref = [[ref_BS[2, t] for t in (1, 2, 3)] + [ref_BS[0, t] for t in (3, 4, 5)],
                    [ref_BS[3, t] for t in (4, 5, 6, 7, 8)] + [ref_BS[1, t] for t in range(5, 12)]]
    for micro, ref in zip(batch.micro_batches, expected_ref, strict=True):
        torch.testing.assert_close(micro.objective.ref_logp_T, torch.stack(ref))
        torch.testing.assert_close(micro.objective.old_logp_T, torch.stack(ref) - 1.0)

def test_filtered_steps_train_the_groups_whose_rewards_differ():
    # groups of 4: mixed, all wrong, all right, mixed
    rewards = torch.tensor([1., 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0])
    assert trained_rows(rewards, 4, micro_batch=16).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert trained_rows(torch.zeros(8), 4, micro_batch=8) is None  # no group differs: keep the step whole
    assert trained_rows(torch.tensor([1., 0, 0, 1]), 2, micro_batch=4) is None  # every group differs


def test_filtered_rows_still_deal_evenly_to_the_ranks():
    rewards = torch.tensor([1., 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0])  # one mixed group of 4
    # 2 ranks, micro-batches of 4: the first uniform group is added back, so 2 micro-batches deal
    assert trained_rows(rewards, 4, micro_batch=4, dp_size=2, micro_batch_multiple=2).tolist() == list(range(8))
    # ... to 2 ranks × 2 interleaved stages, 4 micro-batches: the first two uniform groups are added back
    assert trained_rows(rewards, 4, micro_batch=4, dp_size=2, micro_batch_multiple=4).tolist() == list(range(16))
    # 3 rows do not split over 2 ranks: groups of 3 come back until the rows do
    rewards_of_3 = torch.tensor([1., 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0])
    assert trained_rows(rewards_of_3, 3, micro_batch=3, dp_size=2, micro_batch_multiple=2).tolist() == list(range(6))


def test_a_filtered_step_has_the_same_policy_gradient_up_to_the_token_normaliser():
    """Uniform groups have zero advantage: dropping them changes only the loss's normaliser (DAPO's
    token-level mean over the trained tokens)."""
    seq_len = 12
    sequences = _sequences([6, 12, 4, 9], [(3, 6), (5, 12), (1, 4), (4, 9)], seq_len)
    advantages = sequences.advantages_BS.clone()
    advantages[2:] = 0.0  # the second group of 2 is uniform
    sequences = TrainingSequences(sequences.input_ids_BS, sequences.labels_BS, sequences.rollout_logp_BS,
                                  advantages, None)
    rows = trained_rows(torch.tensor([1., 0, 1, 1]), 2, micro_batch=4)
    assert rows.tolist() == [0, 1]
    model = small_model(vocab_size=64)
    cfg = GRPOConfig(group_size=2)

    def policy_gradient(seqs: TrainingSequences) -> tuple[torch.Tensor, int]:
        """The gradient of the step's summed GRPO loss, through the objective each micro-batch carries."""
        batch = step_batch(seqs, cfg, Batching(micro_batch=4), StepStats.zeros("cpu"), replay=False)
        model.zero_grad()
        for micro in batch.micro_batches:
            objective = micro.objective
            logp_T = policy_logprobs(model, micro.input_ids, micro.labels, 1.0)[micro.labels != IGNORE]
            ones_T = torch.ones_like(logp_T, dtype=torch.bool)
            terms = grpo_token_loss(logp_T, ScoredTokens(objective.rollout_logp_T, objective.advantages_T, ones_T), cfg)
            terms.loss_BS.sum().backward()
        return model.embed.weight.grad.clone(), batch.global_label_tokens

    whole, whole_tokens = policy_gradient(sequences)
    kept, kept_tokens = policy_gradient(sequences.select(rows))
    assert (whole_tokens, kept_tokens) == (3 + 7 + 3 + 5, 3 + 7)
    torch.testing.assert_close(kept, whole, rtol=1e-4, atol=1e-7)  # both are sums; the runtime divides after
