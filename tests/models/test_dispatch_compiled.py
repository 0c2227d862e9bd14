"""The dispatch's autograd functions under torch.compile: the gradients of permute → per-expert scale →
unpermute, compiled, equal the formula's. torch 2.11's Dynamo gave an autograd.Function whose forward
returns a no-op cast (``.to`` its own dtype: the same tensor object) a zero gradient, so the fp32 combine
once lost every expert and gating gradient of a compiled MoE layer (tests/gpu on the H200). Dynamo's own
backends (``eager``, ``aot_eager``) show it without Inductor's compile time; Inductor runs the sums the
compiler is given (the top-k terms added one by one), which the last test checks are element-wise."""

from __future__ import annotations

import pytest
import torch
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

from moetrain.models import permute, unpermute
from moetrain.models.router import Routing, count_tokens_per_expert

TOKENS, EXPERTS, TOP_K, HIDDEN = 12, 4, 2, 8


def _scaled_round_trip(x_TD: torch.Tensor, weights_TK: torch.Tensor, expert_ids_TK: torch.Tensor,
                       scale_E: torch.Tensor) -> torch.Tensor:
    """Each permuted row times its expert's scale (a stand-in for the experts), combined back."""
    routing = Routing(expert_ids_TK, weights_TK, count_tokens_per_expert(expert_ids_TK, EXPERTS),
                      torch.zeros(()))
    tokens_PD, meta = permute(x_TD, routing)
    row_expert_P = expert_ids_TK.reshape(-1)[meta.order_P]
    return unpermute(tokens_PD * scale_E[row_expert_P].unsqueeze(-1).to(tokens_PD.dtype), meta)


@pytest.mark.parametrize(("backend", "dtype"), [("eager", torch.float32), ("aot_eager", torch.float32),
                                                ("eager", torch.bfloat16), ("inductor", torch.float32)])
def test_compiled_permute_and_combine_give_the_formula_gradients(backend, dtype):
    gen = torch.Generator().manual_seed(0)
    expert_ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    scale = torch.tensor([0.5, 1.0, 2.0, 3.0])
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype).requires_grad_(True)
    weights = torch.rand(TOKENS, TOP_K, generator=gen, requires_grad=True)
    grad_out = torch.randn(TOKENS, HIDDEN, generator=gen)
    torch._dynamo.reset()
    out = torch.compile(_scaled_round_trip, backend=backend)(x, weights, expert_ids, scale)
    out.backward(grad_out.to(dtype))
    # By hand: out_t = x_t · Σ_j w_tj·s(e_tj), so dL/dx_t = g_t · Σ_j w_tj·s(e_tj) and dL/dw_tj = s(e_tj)·⟨g_t, x_t⟩.
    s_TK = scale[expert_ids]
    x32 = x.detach().float()
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.detach().float(), x32 * (weights.detach() * s_TK).sum(1, keepdim=True), **tol)
    torch.testing.assert_close(x.grad.float(), grad_out * (weights.detach() * s_TK).sum(1, keepdim=True), **tol)
    torch.testing.assert_close(weights.grad, s_TK * (grad_out * x32).sum(1, keepdim=True), **tol)


def _reductions(graph: torch.fx.Graph) -> list[tuple[tuple[int, ...], list[int]]]:
    """(input shape, reduced dims) of every sum in an ATen graph."""
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (torch.ops.aten.sum.dim_IntList, torch.ops.aten.sum.default):
            shape = tuple(node.args[0].meta["val"].shape)
            dims = node.args[1] if len(node.args) > 1 else list(range(len(shape)))
            found.append((shape, [d % len(shape) for d in dims]))
    return found


def test_compiled_top_k_sums_are_element_wise_not_reductions_over_k():
    """The compiled forward and backward graphs of permute → experts → unpermute sum no [T, K, D] block over
    its K dimension (a strided reduction the H200 ran at a sixth of the memory bandwidth): the combine and
    the token gradients add their K gathered rows term by term. The one reduction left over a [T, K, D]
    block, the gating weights' gradient ⟨g_t, y_row⟩, runs along D."""
    graphs = []

    def capture(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm.graph)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=capture, bw_compiler=capture)

    gen = torch.Generator().manual_seed(0)
    expert_ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    x = torch.randn(TOKENS, HIDDEN, generator=gen, requires_grad=True)
    weights = torch.rand(TOKENS, TOP_K, generator=gen, requires_grad=True)
    torch._dynamo.reset()
    out = torch.compile(_scaled_round_trip, backend=backend)(x, weights, expert_ids, torch.ones(EXPERTS))
    out.sum().backward()
    assert len(graphs) == 2  # forward, backward
    blocks = [(shape, dims) for graph in graphs for shape, dims in _reductions(graph) if len(shape) == 3]
    assert blocks == [((TOKENS, TOP_K, HIDDEN), [2])], blocks
