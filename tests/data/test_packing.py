import numpy as np
import pytest

from moetrain.data.packing import IGNORE_INDEX, PackedDataset, TokenStream
from moetrain.errors import UserError

# Three documents of lengths 5, 3 and 9 (EOS = 0 ends each); token values encode (doc, position).
DOC_LENGTHS = [5, 3, 9]
TOKENS = np.concatenate(
    [np.append(np.arange(1, n) + 100 * (d + 1), 0) for d, n in enumerate(DOC_LENGTHS)]
).astype(np.int32)
DOCS = np.repeat(np.arange(3, dtype=np.int32), DOC_LENGTHS)


def _dataset(seq_len: int = 4, seed: int = 0) -> PackedDataset:
    return PackedDataset(TokenStream(TOKENS, DOCS), seq_len=seq_len, seed=seed)


def test_samples_shift_labels_and_ignore_the_eos_that_would_predict_another_document():
    dataset = _dataset()
    assert dataset.num_samples == (17 - 1) // 4
    inputs, labels, documents = dataset.sample(1)  # window stream[4:9] = [0 | 201 202 0 | 301]
    assert inputs.tolist() == [0, 201, 202, 0]
    assert labels.tolist() == [IGNORE_INDEX, 202, 0, IGNORE_INDEX]
    assert documents.tolist() == [0, 1, 1, 1]  # each EOS belongs to the document it ends; ids restart at 0
    assert dataset.sample(2)[2].tolist() == [0, 0, 0, 0]  # all of document 2, renumbered from 0
    inputs, labels, _ = dataset.sample(0)
    assert inputs.tolist() == [101, 102, 103, 104] and labels.tolist() == [102, 103, 104, 0]


def test_order_is_a_seeded_permutation_per_epoch_and_a_pure_function_of_the_step():
    dataset = _dataset()
    first_epoch = dataset.global_batch_indices(0, 4)
    assert sorted(first_epoch) == [0, 1, 2, 3]
    assert [dataset.global_batch_indices(s, 2) for s in range(4)] == [first_epoch[:2], first_epoch[2:]] + [
        dataset.global_batch_indices(1, 4)[:2], dataset.global_batch_indices(1, 4)[2:]]
    assert _dataset().global_batch_indices(5, 3) == dataset.global_batch_indices(5, 3)
    orders = {tuple(_dataset(seed=s).global_batch_indices(0, 4)) for s in range(8)}
    assert len(orders) > 1


def test_data_parallel_ranks_split_the_same_global_batch():
    dataset = _dataset(seq_len=2)
    whole = dataset.step_batch(step=3, global_batch=4, micro_batch=2)
    ranks = [dataset.step_batch(step=3, global_batch=4, micro_batch=1, dp_rank=r, dp_size=2) for r in range(2)]
    rows = [m.input_ids for rank in ranks for m in rank.micro_batches]
    assert np.array_equal(np.concatenate(rows), np.concatenate([m.input_ids for m in whole.micro_batches]))
    assert {r.global_label_tokens for r in ranks} == {whole.global_label_tokens}
    assert whole.global_label_tokens == sum(m.num_label_tokens for m in whole.micro_batches)
    assert whole.global_tokens == 8


def test_layout_that_does_not_divide_and_a_too_short_corpus_are_user_errors():
    with pytest.raises(UserError, match="make it a multiple of 4"):
        _dataset().step_batch(0, global_batch=6, micro_batch=2, dp_rank=0, dp_size=2)
    with pytest.raises(UserError, match="fewer than one sequence of --seq-len 64"):
        _dataset(seq_len=64)
