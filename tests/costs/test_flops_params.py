import numpy as np

from moetrain.config import load_model_config
from moetrain.costs.flops import (
    LinearWidths,
    attention_core_flops,
    attention_linear_widths,
    mlp_linear_widths,
    model_forward_flops,
)
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


def test_linear_widths_of_mla_and_gqa_by_hand() -> None:
    # DeepSeek-V3's MLA: q latent 1,536, kv latent 512 (+ 64 rope), 128 heads of qk 128 + 64 and v 128
    mla = attention_linear_widths(load_model_config("deepseek-v3-671b"))
    assert mla.inner_inputs == 1536 + 512 + 128 * 128
    assert mla.inner_outputs == 1536 + (512 + 64) + 128 * 192 + 128 * (128 + 128)
    # Mixtral's GQA: 32 heads and 8 kv heads of 128; its SwiGLU experts write gate and up
    mixtral = load_model_config("mixtral-8x7b")
    gqa = attention_linear_widths(mixtral)
    assert (gqa.inner_inputs, gqa.inner_outputs) == (32 * 128, (32 + 2 * 8) * 128)
    assert mlp_linear_widths(mixtral, 14336) == LinearWidths(14336, 2 * 14336)
