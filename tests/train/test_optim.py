import math

import pytest
import torch

from moetrain.config import TrainingConfig
from moetrain.runtime_base.optim import build_lr_scheduler, build_optimizer, lr_multiplier


def test_warmup_then_cosine_to_the_floor():
    cfg = TrainingConfig(steps=11, warmup_steps=2, lr=1.0, min_lr_ratio=0.1)
    values = [lr_multiplier(s, cfg) for s in range(cfg.steps)]
    assert values[:3] == [0.5, 1.0, 1.0]
    assert values[-1] == pytest.approx(0.1)
    # halfway through the decay the cosine is at its midpoint
    assert values[2 + 4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(values[1:], values[2:]))


def test_scheduler_drives_the_optimizer_lr_and_decay_skips_1d_params():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = TrainingConfig(steps=4, warmup_steps=2, lr=0.2, weight_decay=0.1)
    optimizer = build_optimizer(model, cfg)
    decayed, not_decayed = optimizer.param_groups
    assert [p.ndim for p in decayed["params"]] == [2] and decayed["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in not_decayed["params"]) and not_decayed["weight_decay"] == 0.0
    scheduler = build_lr_scheduler(optimizer, cfg)
    seen = []
    for _ in range(cfg.steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.2 * lr_multiplier(s, cfg) for s in range(4)])
