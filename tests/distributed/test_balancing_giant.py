"""Issue #43 in the runtime: ``moetrain train --online-balance`` on 4 gloo ranks (EP4, the default one spare slot
per rank) with one expert that carries about twice a rank's mean load. No placement without a replica brings
the busiest rank below that expert's load; the balancer replicates it, the dispatcher splits its tokens by the
shares the solver chose, and the rows each rank's experts compute (measured, not predicted) even out.

tiny-pangu with its router at top-2 (at its own top-4 no expert can exceed a rank's mean on EP4: a token picks
an expert once) and a score bias that sends nearly every token to expert 0.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _parity import run_spec
from rich.console import Console

from moetrain.config import ModelConfig, ParallelConfig, TrainingConfig, load_model_config
from moetrain.config.run import BalanceOptions, RunSpec
from moetrain.distributed.balancing import moe_layers
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.world import spawn
from moetrain.models.transformer import build_model
from moetrain.train import SuppliedParts, Trainer

EP = 4
STEPS = 4
TRAINING = TrainingConfig(steps=STEPS, global_batch=16, micro_batch=2, seq_len=64, warmup_steps=2)
"""1,024 tokens a step, 512 token copies per EP rank: below about a quarter of that the `cpu` preset prices a
replica above its saving (each resident expert adds a padding cost; the replicas sum their gradients)."""
GIANT = 0


def giant_model_config() -> ModelConfig:
    cfg = load_model_config("tiny-pangu")
    router = cfg.moe.router.model_copy(update={"score_bias": True, "bias_update_rate": 0.0, "top_k": 2})
    return cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"router": router})})


def giant_model() -> torch.nn.Module:
    model = build_model(giant_model_config(), "cpu", seed=TRAINING.seed)
    for _, block in moe_layers(model):
        block.router.score_bias[GIANT] = 1.0  # sigmoid scores lie in (0, 1): expert 0 is in every token's top 2
    return model


def _worker(rank: int, world_size: int) -> dict:
    dims = ParallelDims.build(ParallelConfig(dp=EP, ep=EP), rank, EP)
    base = run_spec(TRAINING, ParallelConfig(dp=EP, ep=EP), None, ranks_per_node=EP)
    spec = RunSpec(**{**base.model_dump(), "balance": BalanceOptions(enabled=True, interval=2, horizon=10)})
    trainer = Trainer(spec, SuppliedParts(dims=dims, model_cfg=giant_model_config(), model=giant_model(),
                                          console=Console(file=io.StringIO())))
    trainer.train()
    balancer = trainer.balancer
    rows = torch.tensor([sum(h.local_rows) for h in balancer.history], dtype=torch.float64)
    per_rank = [torch.empty_like(rows) for _ in range(EP)]
    dist.all_gather(per_rank, rows, group=dims.get_group("ep"))
    return {"rows": torch.stack(per_rank).t().numpy(),  # [step, EP rank]
            "tokens_per_expert": np.array([h.tokens_per_expert for h in balancer.history]),  # [step, layer, E]
            "replicas": [p.num_replicas().tolist() for p in balancer.placements],
            "decisions": [d.as_dict() for d in balancer.decisions]}


@pytest.mark.slow
@pytest.mark.dist
def test_the_online_balancer_replicates_a_giant_and_the_measured_rows_even_out() -> None:
    run = spawn(_worker, EP)[0]
    loads = run["tokens_per_expert"]  # every layer's tokens per expert, over the whole stage
    rank_mean = loads.sum(axis=-1) / EP
    giant_share = loads[..., GIANT] / rank_mean
    assert giant_share.min() > 1.7, giant_share  # above a rank's mean: only a replica gets below it
    # the first full re-plan (after step 0) replicated the giant in every MoE layer
    assert all(counts[GIANT] >= 2 for counts in run["replicas"]), run["replicas"]
    assert any(d["migrate"] and d["step"] == 0 for d in run["decisions"])
    rows = run["rows"]
    before, after = rows[0].max() / rows[0].mean(), rows[1:].max(axis=1) / rows[1:].mean(axis=1)
    # step 0 ran the contiguous table: rank 0 holds the giant and three more experts
    assert before > giant_share[0].min(), (before, giant_share[0])
    # after the migration the measured rows are below what any placement without a replica can reach
    assert after.max() < 1.3 < giant_share[1:].min(), (before, after)
