"""moetrain computes the reference function: logits equal transformers' on random tokens (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from hf_reference import make_reference, reference_logits

from moetrain.hf import load_pretrained, save_pretrained

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max abs difference of logits

VARIANTS = {
    "deepseek_v3": {},
    # no q latent, rotate-half rotary layout, a single expert group, unnormalised top-k
    "deepseek_v3-plain": {"q_lora_rank": None, "rope_interleave": False, "n_group": 1, "topk_group": 1,
                          "norm_topk_prob": False, "routed_scaling_factor": 1.5},
    # YaRN long-context rotary, as in the published DeepSeek-V3 config (factor 40 from 4096)
    "deepseek_v3-yarn": {"max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
    "qwen3_moe": {},
    "qwen3_moe-yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                           "original_max_position_embeddings": 8}},
    "qwen3_moe-dense-first": {"mlp_only_layers": [0], "norm_topk_prob": True},
    "mixtral": {},
    "mixtral-tied": {"tie_word_embeddings": True},
}


def _family(variant: str) -> str:
    return variant.split("-")[0]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant: str, tmp_path, random_tokens) -> None:
    reference, folder = make_reference(_family(variant), tmp_path, **VARIANTS[variant])
    model, cfg = load_pretrained(folder)
    expected = reference_logits(reference, random_tokens)
    with torch.no_grad():
        logits = model(random_tokens).logits
    assert logits.shape == (*random_tokens.shape, cfg.vocab_size)
    # The logits are O(1), so a wrong mapping (a swapped or skipped tensor, a missed rotary
    # permutation) is far outside the tolerance.
    assert expected.abs().max() > 1.0
    assert (logits - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_save_then_transformers_load_round_trips(variant: str, tmp_path, random_tokens) -> None:
    reference, folder = make_reference(_family(variant), tmp_path, **VARIANTS[variant])
    model, _ = load_pretrained(folder)
    out = save_pretrained(model, tmp_path / "exported")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reloaded) is type(reference)
    expected = reference_logits(reference, random_tokens)
    assert (reference_logits(reloaded, random_tokens) - expected).abs().max().item() < TOLERANCE
    # and the exported folder reads back into the same moetrain weights
    again, _ = load_pretrained(out)
    for (name, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(again.state_dict().items())):
        assert torch.equal(a, b), name


def test_router_matches_reference_choice_and_weights(tmp_path) -> None:
    """Group-limited sigmoid routing with the correction bias, renormalisation and scaling: same experts
    and the same gating weights as DeepSeek-V3's reference router."""
    reference, folder = make_reference("deepseek_v3", tmp_path)
    model, _ = load_pretrained(folder)
    x = torch.randn(64, 32)
    with torch.no_grad():
        _, ref_weights, ref_ids = reference.model.layers[1].mlp.gate(x)
        routing = model.layers[1].moe.router(x)
    ref_order, our_order = ref_ids.sort(-1), routing.expert_ids_TK.sort(-1)
    assert torch.equal(ref_order.values, our_order.values)
    torch.testing.assert_close(routing.weights_TK.gather(1, our_order.indices),
                               ref_weights.gather(1, ref_order.indices))
