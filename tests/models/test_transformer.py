import math

import pytest
import torch

from moetrain.config import load_model_config, model_presets
from moetrain.costs.params import count_params
from moetrain.models import build_model, param_counts_by_part


@pytest.mark.parametrize("name", model_presets())
def test_meta_model_matches_analytic_parameter_counts(name):
    cfg = load_model_config(name)
    model = build_model(cfg, device="meta")
    assert param_counts_by_part(model) == {k: v for k, v in count_params(cfg).as_dict().items() if v}


def test_pangu_718b_counts_agree_with_spec():
    counts = count_params(load_model_config("pangu-ultra-moe-718b"))
    assert abs(counts.total / 1e9 - 719.1) < 0.1
    assert abs(counts.active / 1e9 - 39.2) < 0.05


def test_tiny_pangu_forward_backward_and_init():
    cfg = load_model_config("tiny-pangu")
    model = build_model(cfg, seed=0)
    layer = model.layers[0]
    assert torch.allclose(layer.attn_post_norm.weight, torch.full_like(layer.attn_post_norm.weight,
                                                                      0.283 / math.sqrt(8)))
    std = math.sqrt(1 / (2 * 128 * 8))
    assert abs(model.layers[3].moe.experts.w_up_EDF.std().item() - std) / std < 0.05
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 16, cfg.vocab_size)
    # untrained: the LM loss is near ln(vocab)
    assert abs(out.lm_loss.item() - math.log(cfg.vocab_size)) < 0.5
    assert out.tokens_per_expert.shape == (cfg.num_layers - cfg.num_dense_layers + cfg.num_mtp_layers, 16)
    assert int(out.tokens_per_expert.sum(1)[0]) == 2 * 16 * cfg.moe.router.top_k
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_same_seed_same_weights_and_loss_normaliser():
    cfg = load_model_config("tiny-qwen3")
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    labels = ids.clone()
    labels[0, :3] = -100
    out = a(ids, labels=labels)
    halves = [a(ids[i : i + 1], labels=labels[i : i + 1], loss_normalizer=out.num_label_tokens) for i in (0, 1)]
    assert torch.allclose(halves[0].lm_loss + halves[1].lm_loss, out.lm_loss, atol=1e-6)
