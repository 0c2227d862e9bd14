"""The grouped GEMM at EP = 1 keeps its group sizes on the device: torch's kernel where it runs (Hopper
bf16; CPU fp32/bf16), behind an opaque op for fp32 so that a compiled layer can call it too. Checked
against the per-expert loop it replaces, forward and backward, with empty groups."""

from __future__ import annotations

import pytest
import torch

from moetrain.models import experts
from moetrain.models.experts import grouped_mm, grouped_weight_grad, native_grouped_mm_ok

COUNTS = [5, 0, 17, 8, 0, 2]


def _loop(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.cat([block @ w[e] for e, block in enumerate(torch.split(x, counts))])


@pytest.fixture
def operands():
    torch.manual_seed(0)
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), 16, requires_grad=True)
    w = torch.randn(len(COUNTS), 16, 24, requires_grad=True)
    return x, w, counts


def test_cpu_fp32_takes_the_native_kernel_when_torch_has_one(operands):
    x, w, _ = operands
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no grouped_mm")
    assert native_grouped_mm_ok(x, w) == experts._probe_grouped_mm("cpu", (0, 0), torch.float32)
    assert not native_grouped_mm_ok(x[:, :12], w[:, :12])  # 12 is not a multiple of 8: the loop


def test_native_grouped_mm_equals_the_per_expert_loop_forward_and_backward(operands):
    x, w, counts = operands
    grad = torch.randn(sum(COUNTS), 24)
    out = grouped_mm(x, w, counts)
    out.backward(grad)
    got = (out.detach(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    ref = _loop(x, w, COUNTS)
    ref.backward(grad)
    torch.testing.assert_close(got[0], ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], w.grad, rtol=1e-5, atol=1e-5)
    assert torch.all(got[2][1] == 0) and torch.all(got[2][4] == 0)  # experts without tokens: no gradient


def test_weight_grad_is_each_expert_blocks_transposed_product(operands):
    x, _, counts = operands
    grad = torch.randn(sum(COUNTS), 24)
    expected = torch.stack([a.t() @ g for a, g in zip(x.detach().split(COUNTS), grad.split(COUNTS))])
    torch.testing.assert_close(grouped_weight_grad(x.detach(), grad, counts), expected, rtol=1e-5, atol=1e-5)


def test_a_compiled_function_calls_the_fp32_kernel_without_breaking_its_graph(operands):
    x, w, counts = operands
    experts.probe_grouped_mm(torch.device("cpu"))
    compiled = torch.compile(lambda a, b, c: torch.relu(grouped_mm(a, b, c)), fullgraph=True, backend="aot_eager")
    out = compiled(x, w, counts)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), torch.relu(_loop(x, w, COUNTS)).detach(), rtol=1e-5, atol=1e-5)
    assert x.grad is not None and w.grad is not None
