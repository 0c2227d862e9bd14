import numpy as np
import pytest

from moetrain.balance.data import arrangement_cost, naive_arrangement, rearrange, sample_costs
from moetrain.config import load_model_config
from moetrain.costs.flops import attention_core_flops, layer_forward_flops
from moetrain.errors import UserError


def _documents(seed: int, num_samples: int, seq_len: int = 4096) -> list[list[int]]:
    """Packed samples of seq_len tokens, cut into 1..8 documents of random lengths."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(num_samples):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), size=rng.integers(0, 8), replace=False))
        samples.append(np.diff(np.concatenate([[0], cuts, [seq_len]])).tolist())
    return samples


def test_sample_cost_is_quadratic_plus_linear():
    model = load_model_config("tiny-pangu")
    one_long, two_halves = sample_costs([[1024], [512, 512]], model)
    linear = layer_forward_flops(model, 1, moe_layer=True)
    linear_per_token = linear.total - linear.attention_core
    assert one_long == pytest.approx(1024 * attention_core_flops(model, 1024, causal=True) + 1024 * linear_per_token)
    assert two_halves < one_long  # same tokens, shorter attention spans
    assert two_halves > 1024 * linear_per_token


def test_rearrangement_is_a_deterministic_permutation_that_balances():
    model = load_model_config("pangu-ultra-moe-718b")
    costs = sample_costs(_documents(0, 128, seq_len=32768), model)  # long context: attention matters
    arrangement = rearrange(costs, dp=8, micro_batches=4, micro_batch_size=4)
    assert arrangement.shape == (8, 4, 4)
    assert sorted(arrangement.reshape(-1).tolist()) == list(range(128))  # same samples, each once
    assert np.array_equal(arrangement, rearrange(costs, 8, 4, 4))
    balanced = arrangement_cost(costs, arrangement)
    naive = arrangement_cost(costs, naive_arrangement(128, 8, 4, 4))
    assert balanced["sum_over_microbatches_of_max_rank"] < naive["sum_over_microbatches_of_max_rank"]
    assert balanced["max_rank_of_sum"] < naive["max_rank_of_sum"]
    # within 3% of perfect balance, while the usual order is far off
    assert balanced["sum_over_microbatches_of_max_rank"] < 1.03 * balanced["balanced_bound"]
    assert naive["sum_over_microbatches_of_max_rank"] > 1.05 * naive["balanced_bound"]


def test_equal_costs_keep_a_valid_arrangement():
    arrangement = rearrange(np.ones(12), dp=2, micro_batches=3, micro_batch_size=2)
    assert sorted(arrangement.reshape(-1).tolist()) == list(range(12))


def test_errors():
    with pytest.raises(UserError) as err:
        rearrange(np.ones(10), dp=2, micro_batches=2, micro_batch_size=2)
    assert str(err.value) == "global batch has 10 samples, but dp·micro_batches·micro_batch_size = 2·2·2 = 8"
    with pytest.raises(UserError, match="sample 1 has document lengths"):
        sample_costs([[3], [0, 2]], load_model_config("tiny-pangu"))
