"""The ``permute`` recompute under expert parallelism: the MoE block's staged dispatch
(``start_dispatch`` … ``finish``) is discarded and dispatched again in backward, with the same
gradients as without it (2 gloo ranks, tiny-pangu, EP2, flat and hierarchical all-to-all)."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ParallelConfig, TrainingConfig, load_model_config
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.parallelize import model_moe_blocks, parallelize
from moetrain.distributed.pipeline import Executor
from moetrain.distributed.step import LayoutRun, train_step
from moetrain.distributed.world import spawn
from moetrain.distributed.zero import ZeroAdamW
from moetrain.memory import MemoryPlan
from moetrain.memory.policy import num_blocks
from moetrain.memory.runtime import apply_memory_policy
from moetrain.models import build_model

EP = 2
TRAINING = TrainingConfig(steps=2, global_batch=4, micro_batch=2, seq_len=32, warmup_steps=1)


def _grads(rank: int, a2a: str, options: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], list[float], int]:
    """Two training steps: the second step's gradients (before ZeRO's reduction leaves them in place),
    both losses and the number of dispatches."""
    cfg = load_model_config("tiny-pangu")
    dims = ParallelDims.build(ParallelConfig(dp=EP, ep=EP, a2a=a2a), rank, 1 if a2a == "hierarchical" else EP)
    stage = parallelize(build_model(cfg, "cpu", seed=TRAINING.seed), dims)
    starts = []
    for block in model_moe_blocks(stage.model):
        original = block.dispatcher.start_dispatch
        block.dispatcher.start_dispatch = lambda x, r, original=original: starts.append(1) or original(x, r)
    if options:
        apply_memory_policy(stage.model, MemoryPlan.uniform(options, num_blocks(cfg)))
    run = LayoutRun(stage, ZeroAdamW(stage.model, dims, TRAINING, stage.tp_kinds), Executor(stage))
    losses = [train_step(run, step, TRAINING, torch.device("cpu")) for step in range(2)]
    grads = {name: p.grad.clone() for name, p in stage.model.named_parameters() if p.grad is not None}
    return grads, losses, len(starts)


def _worker(rank: int, world_size: int) -> dict:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    out = {}
    for a2a in ("flat", "hierarchical"):
        out[a2a] = {"plain": _grads(rank, a2a, ()), "permute": _grads(rank, a2a, ("permute",)),
                    "mixed": _grads(rank, a2a, ("norm", "permute", "activation", "router"))}
    return out


@pytest.mark.slow
@pytest.mark.dist
def test_permute_recompute_under_ep_keeps_gradients() -> None:
    for rank_out in spawn(_worker, EP):
        for a2a, runs in rank_out.items():
            plain, plain_losses, plain_dispatches = runs["plain"]
            for name in ("permute", "mixed"):
                grads, losses, dispatches = runs[name]
                assert losses == plain_losses, (a2a, name, losses, plain_losses)
                assert grads.keys() == plain.keys() and len(plain) > 0
                mismatched = [k for k in plain if not torch.equal(plain[k], grads[k])]
                assert mismatched == [], (a2a, name, mismatched)
                # every MoE layer dispatched once more, in backward: the tokens were rebuilt, not kept
                assert dispatches == 2 * plain_dispatches, (a2a, name, dispatches, plain_dispatches)
