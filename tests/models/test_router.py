import math

import torch

from moetrain.config import RouterConfig
from moetrain.models import Router


def _router(**kw) -> Router:
    cfg = RouterConfig(**kw)
    r = Router(2, 4, cfg)
    with torch.no_grad():
        r.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.5, 0.5]]))
    return r


X = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.9]])
LOGITS = torch.tensor([[2.0, 0.0, -2.0, 1.0], [0.0, 1.0, 0.0, 0.5], [1.0, 0.9, -1.0, 0.95]])


def test_softmax_top2_renormalised_equals_softmax_over_chosen_logits():
    r = _router(top_k=2, score_function="softmax", normalize_top_k=True)
    out = r(X)
    # token 0 picks experts 0 and 3; renormalised softmax = softmax over the two logits
    assert out.expert_ids_TK[0].tolist() == [0, 3]
    expected = torch.softmax(torch.tensor([2.0, 1.0]), 0)
    assert torch.allclose(out.weights_TK[0], expected)
    assert out.tokens_per_expert_E.tolist() == [2, 1, 0, 3]


def test_sigmoid_scaling_and_bias_only_steers_choice():
    r = _router(top_k=1, score_function="sigmoid", normalize_top_k=False, scaling_factor=2.5, score_bias=True)
    r.score_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    out = r(X)
    assert out.expert_ids_TK[:, 0].tolist() == [3, 3, 3]
    # the weight is the unbiased sigmoid score times the scaling factor
    assert torch.allclose(out.weights_TK[:, 0], 2.5 * torch.sigmoid(LOGITS[:, 3]))


def test_group_limited_routing_uses_best_groups_only():
    # 2 groups of 2; with top-1 group, token 1 (logits 0,1 | 0,.5) must stay inside group 0
    r = _router(top_k=2, score_function="sigmoid", num_groups=2, num_top_groups=1)
    out = r(X)
    assert sorted(out.expert_ids_TK[1].tolist()) == [0, 1]


def test_balance_losses_equal_hand_computed_values():
    coef_e, coef_d, coef_z = 0.1, 0.2, 0.01
    r = _router(top_k=2, score_function="softmax", expert_balance_coef=coef_e, device_balance_coef=coef_d,
                num_device_groups=2, z_loss_coef=coef_z)
    out = r(X)
    probs = torch.softmax(LOGITS, -1)
    f = torch.tensor([2, 1, 0, 3]) / 6.0
    p = probs.mean(0)
    expert_loss = 4 * (f * p).sum()
    device_loss = 2 * ((f[0] + f[1]) * (p[0] + p[1]) + (f[2] + f[3]) * (p[2] + p[3]))
    z = torch.logsumexp(LOGITS, -1).pow(2).mean()
    expected = coef_e * expert_loss + coef_d * device_loss + coef_z * z
    assert math.isclose(out.aux_loss.item(), expected.item(), rel_tol=1e-6)


def test_uniform_routing_gives_balance_loss_one():
    r = Router(4, 4, RouterConfig(top_k=1, expert_balance_coef=1.0))
    with torch.no_grad():
        r.weight.zero_()
    out = r(torch.randn(8, 4))
    # all scores equal: topk picks expert 0 for everyone, P uniform: loss = 4 * (1 * 1/4) = 1
    assert math.isclose(out.aux_loss.item(), 1.0, rel_tol=1e-6)


def test_aux_free_bias_moves_against_load():
    r = _router(top_k=1, score_bias=True, bias_update_rate=0.1)
    r.update_bias(torch.tensor([10, 0, 5, 5]))
    assert torch.allclose(r.score_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
