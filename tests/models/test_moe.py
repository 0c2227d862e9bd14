import pytest
import torch

from moetrain.config import MoEConfig, RouterConfig
from moetrain.models import MoE, permute, unpermute
from moetrain.models.experts import GroupedExperts, grouped_mm
from moetrain.models.router import Routing, count_tokens_per_expert


def _routing(expert_ids: torch.Tensor, num_experts: int) -> Routing:
    weights = torch.rand(expert_ids.shape)
    return Routing(expert_ids, weights, count_tokens_per_expert(expert_ids, num_experts), torch.zeros(()))


def _naive_experts(x, routing, experts: GroupedExperts):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(routing.expert_ids_TK.shape[1]):
            e = int(routing.expert_ids_TK[t, k])
            h = torch.nn.functional.silu(x[t] @ experts.w_gate_EDF[e]) * (x[t] @ experts.w_up_EDF[e])
            out[t] += routing.weights_TK[t, k] * (h @ experts.w_down_EFD[e])
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_permute_grouped_gemm_unpermute_equals_per_expert_loop(seed):
    torch.manual_seed(seed)
    num_experts, tokens, top_k, hidden, ffn = 8, 37, 3, 16, 24
    experts = GroupedExperts(num_experts, hidden, ffn)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(tokens, hidden)
    # experts 5 and 7 receive no token at all
    choices = torch.tensor([0, 1, 2, 3, 4, 6])
    expert_ids = torch.stack([choices[torch.randperm(6)[:top_k]] for _ in range(tokens)])
    routing = _routing(expert_ids, num_experts)
    assert routing.tokens_per_expert_E[5] == 0 and routing.tokens_per_expert_E[7] == 0

    tokens_PD, meta = permute(x, routing)
    # permuted rows are grouped by expert, in token order inside each block
    sorted_ids = expert_ids.reshape(-1)[torch.argsort(expert_ids.reshape(-1), stable=True)]
    assert torch.equal(sorted_ids, torch.sort(expert_ids.reshape(-1)).values)
    y = unpermute(experts(tokens_PD, routing.tokens_per_expert_E), meta)
    ref = _naive_experts(x, routing, experts)
    assert (y - ref).abs().max().item() <= 1e-5


def test_grouped_mm_handles_empty_groups():
    x = torch.randn(6, 4)
    w = torch.randn(3, 4, 5)
    counts = torch.tensor([0, 6, 0])
    assert torch.allclose(grouped_mm(x, w, counts), x @ w[1])


def test_moe_block_gradients_flow_to_every_used_expert():
    cfg = MoEConfig(num_experts=4, expert_ffn_hidden=8, num_shared_experts=1,
                    router=RouterConfig(top_k=2, score_function="sigmoid", scaling_factor=2.5))
    block = MoE(16, cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, 16, requires_grad=True)
    out = block(x)
    out.out_TD.sum().backward()
    assert out.out_TD.shape == x.shape
    used = out.tokens_per_expert_E > 0
    grad_norm = block.experts.w_up_EDF.grad.flatten(1).norm(dim=1)
    assert torch.equal(grad_norm > 0, used)
    assert block.router.weight.grad.abs().sum() > 0
    assert int(out.tokens_per_expert_E.sum()) == 10 * 2
