"""The simulator's activation memory equals what the runtime keeps for backward (tiny presets, CPU)."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ParallelConfig, load_cluster_config, load_model_config
from moetrain.memory.measure import measure_activations
from moetrain.memory.options import uses_flash_attention
from moetrain.models import build_model
from moetrain.planner.calibration import Efficiency
from moetrain.planner.costmodel import evaluate
from moetrain.planner.strategy import Strategies
from moetrain.planner.workload import Workload


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-pangu", "tiny-qwen3", "tiny-mixtral"])
def test_simulated_activations_match_measured(name: str) -> None:
    torch.set_num_threads(1)
    cfg = load_model_config(name)
    seq, batch = 64, 2
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    measured = measure_activations(build_model(cfg, seed=0), ids, ids).total_bytes
    workload = Workload(cfg, load_cluster_config("cpu"), seq, batch, precision="fp32",
                        flash_attention=uses_flash_attention(cfg, "cpu"))
    out = evaluate(workload, Strategies.from_parallel([ParallelConfig(micro_batch=batch)]), Efficiency())
    assert float(out.memory.activations[0]) == pytest.approx(measured, rel=0.01)
