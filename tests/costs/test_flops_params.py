import numpy as np

from moetrain.config import load_model_config
from moetrain.costs.flops import attention_core_flops, model_forward_flops
from moetrain.costs.params import count_params, swiglu_params


def test_dense_matmul_flops_are_twice_the_weights():
    cfg = load_model_config("tiny-mixtral")
    counts = count_params(cfg)
    flops = model_forward_flops(cfg, seq_len=128)
    # projections: 2 FLOPs per weight per token; experts: top_k of E experts per token
    assert flops.attention_proj == 2 * counts.attention
    assert flops.experts == 2 * counts.experts * 2 / 8
    assert flops.head == 2 * counts.head


def test_attention_core_counts_full_or_causal_context():
    cfg = load_model_config("tiny-pangu")
    # MLA: 4 heads · (48 + 32) dims · 2 FLOPs per multiply-add
    assert attention_core_flops(cfg, 100) == 2 * 4 * 100 * (48 + 32)
    assert attention_core_flops(cfg, 99, causal=True) == 2 * 4 * 50 * (48 + 32)
    seqs = np.array([1024, 2048])
    assert np.allclose(attention_core_flops(cfg, seqs), 2 * 4 * seqs * 80)


def test_training_flops_near_six_times_active_params_for_short_sequences():
    cfg = load_model_config("deepseek-v3-671b")
    counts = count_params(cfg)
    per_token = model_forward_flops(cfg, seq_len=1, include_mtp=False).training
    # router and norms are tiny; 6·active differs only by the norm gains
    assert abs(per_token / (6 * counts.active) - 1) < 1e-3
    assert swiglu_params(10, 20) == 600
