"""Tiny random reference models built with transformers (a test dependency only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _tiny(family: str, vocab_size: int = VOCAB, **overrides):
    fields = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.15)
    if family == "deepseek_v3":
        fields.update(num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=16,
                      n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4, topk_group=2,
                      first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                      qk_rope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5, norm_topk_prob=True,
                      rope_interleave=True, rms_norm_eps=1e-6)
        config_cls, model_cls = transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM
    elif family == "qwen3_moe":
        fields.update(num_key_value_heads=2, head_dim=12, intermediate_size=48, moe_intermediate_size=16,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        config_cls, model_cls = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
    else:
        fields.update(num_key_value_heads=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
        config_cls, model_cls = transformers.MixtralConfig, transformers.MixtralForCausalLM
    cfg = config_cls(**{**fields, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(1234)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        # Random non-trivial norm gains and score biases, so a swapped or skipped tensor shows.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn_like(buf))
    return model


def make_reference(family: str, tmp_path: Path, vocab_size: int = VOCAB, **overrides):
    """(transformers model, folder it was saved to)."""
    model = _tiny(family, vocab_size, **overrides)
    folder = tmp_path / f"hf-{family}"
    model.save_pretrained(folder)
    return model, folder


def reference_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=False).logits.float()
