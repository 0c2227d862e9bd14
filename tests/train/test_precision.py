"""The training step's precision rule and gradient clipping, shared by the trainer and the planner's probe."""

from __future__ import annotations

import pytest
import torch

from moetrain.runtime_base.optim import clip_gradients
from moetrain.runtime_base.precision import autocast, autocast_dtype


@pytest.mark.parametrize(("setting", "device", "expected"), [
    ("auto", "cpu", None), ("auto", "cuda", torch.bfloat16), ("bf16", "cpu", torch.bfloat16), ("fp32", "cuda", None),
])
def test_autocast_dtype_rule(setting: str, device: str, expected: torch.dtype | None) -> None:
    assert autocast_dtype(setting, device) == expected


def test_autocast_region_on_cpu() -> None:
    x = torch.ones(4, 4)
    with autocast(None, "cpu"):
        assert (x @ x).dtype == torch.float32
    with autocast(torch.bfloat16, "cpu"):
        assert (x @ x).dtype == torch.bfloat16


def test_clip_gradients_returns_the_norm_before_clipping() -> None:
    a, b, unused = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    a.grad, b.grad = torch.tensor([3.0]), torch.tensor([4.0])
    norm = clip_gradients([a, b, unused], max_norm=1.0)
    assert float(norm) == pytest.approx(5.0)
    # Scaled by max_norm / (norm + 1e-6), torch's rule: the clipped norm is 1.
    assert float(torch.cat([a.grad, b.grad]).norm()) == pytest.approx(1.0, rel=1e-5)
    assert unused.grad is None
    a.grad, b.grad = torch.tensor([3.0]), torch.tensor([4.0])
    assert float(clip_gradients([a, b], max_norm=0.0)) == pytest.approx(5.0)
    assert float(a.grad) == 3.0 and float(b.grad) == 4.0
