"""Model-shape search (``moetrain plan --search-model``): compare expert count, hidden size and depth
near a parameter budget by the throughput of each shape's best layout, as the reference team did
when it chose 256 experts, hidden 7680 and 61 layers for Ascend (SPEC §1, §3).

Each shape keeps the base model's attention proportions (heads scale with hidden) and its activated
expert compute (m× the experts at 1/m the width route to m× the top-k). Shapes are ranked by
predicted training tokens/s at their best layout. A coarser layout space keeps the comparison within seconds per shape.
"""

from __future__ import annotations

import argparse
import time

from moetrain.config.model import GQAConfig, MLAConfig, ModelConfig
from moetrain.costs.params import count_params
from moetrain.errors import UserError
from moetrain.planner.cli_support import build_workload
from moetrain.planner.costmodel import Workload
from moetrain.planner.search import SearchSpace, search

COARSE = SearchSpace(tp=(1, 2, 4, 8), cp=(1, 2), vpp=(1, 2, 4), etp=(1,), zero=(1,), micro_batch=(1, 2),
                     recompute=(0, 1, 2), a2a=(0, 1), overlap=(1,), sp=(0, 1))


def _reshape(base: ModelConfig, experts: int, hidden: int, layers: int) -> ModelConfig | None:
    scale = hidden / base.hidden_size
    attn = base.attention
    heads = max(1, round(attn.num_heads * scale))
    if isinstance(attn, MLAConfig):
        attention = attn.model_copy(update={"num_heads": heads})
    else:
        assert isinstance(attn, GQAConfig)
        kv = attn.num_kv_heads
        heads = max(kv, heads // kv * kv)
        attention = attn.model_copy(update={"num_heads": heads})
    update: dict = {"hidden_size": hidden, "num_layers": layers, "attention": attention,
                    "dense_ffn_hidden": round(base.dense_ffn_hidden * scale / 128) * 128 or base.dense_ffn_hidden,
                    "num_dense_layers": min(base.num_dense_layers, layers),
                    "name": f"{base.name}-e{experts}-h{hidden}-l{layers}"}
    if base.moe is not None:
        moe = base.moe
        width = max(128, round(moe.expert_ffn_hidden * moe.num_experts / experts * scale / 128) * 128)
        # Fine-grained segmentation (DeepSeekMoE): m× the experts at 1/m the width and m× the top-k keeps
        # the activated compute per token.
        top_k = min(experts, max(1, round(moe.router.top_k * experts / moe.num_experts)))
        router = moe.router.model_copy(update={"top_k": min(top_k, experts), "num_device_groups": 1})
        update["moe"] = moe.model_copy(update={"num_experts": experts, "expert_ffn_hidden": width, "router": router})
    try:
        return ModelConfig.model_validate({**base.model_dump(), **{k: (v.model_dump() if hasattr(v, "model_dump")
                                                                          else v) for k, v in update.items()}})
    except ValueError:
        return None


def search_model_shapes(args: argparse.Namespace, tolerance: float = 0.15) -> dict:
    workload, calibration = build_workload(args)
    eff = calibration.for_device(workload.cluster.device)
    base = workload.model
    budget = (args.param_budget * 1e9) if args.param_budget else float(count_params(base).total)
    start = time.perf_counter()
    expert_options = [base.moe.num_experts // 2, base.moe.num_experts, base.moe.num_experts * 2] if base.moe else [0]
    hidden_options = sorted({round(base.hidden_size * f / 256) * 256 for f in (0.75, 0.875, 1.0, 1.125, 1.25)})
    shapes = []
    evaluated = 0
    for experts in expert_options:
        for hidden in hidden_options:
            # Depth that meets the budget for this width, then its neighbours.
            probe = _reshape(base, experts or 1, hidden, base.num_layers)
            if probe is None:
                continue
            per_layer = count_params(probe).total / base.num_layers
            ideal = max(4, round(budget / per_layer))
            for layers in sorted({ideal - 2, ideal, ideal + 2}):
                model = _reshape(base, experts or 1, hidden, layers)
                if model is None:
                    continue
                counts = count_params(model)
                if abs(counts.total - budget) > tolerance * budget:
                    continue
                w = Workload(model, workload.cluster, workload.seq_len, workload.global_batch, workload.precision,
                             workload.imbalance, grad_bytes=workload.grad_bytes)
                # Shapes are compared at the hardware's best layout, runnable today or not.
                result = search(w, args.devices, eff, COARSE, top_k=1, timeline_top=3, time_every_choice=False,
                                runnable_only=False)
                evaluated += result.candidates_evaluated
                if len(result.top) == 0:
                    continue
                step = float(result.timeline_step_s[0])
                shapes.append({
                    "experts": experts, "hidden": hidden, "layers": layers,
                    "total_params_b": counts.total / 1e9, "active_params_b": counts.active / 1e9,
                    "tokens_per_s": workload.global_batch * workload.seq_len / step,
                    "mfu": float(result.top_costs["mfu"][0] * result.top_costs["step_time_s"][0] / step),
                    "parallel": result.top.to_parallel(0).model_dump(),
                })
    if not shapes:
        raise UserError("no model shape near the budget fits the devices; raise --devices or --param-budget")
    shapes.sort(key=lambda s: -s["tokens_per_s"])
    return {"budget_params_b": budget / 1e9, "tolerance": tolerance, "shapes": shapes,
            "candidates_evaluated": evaluated, "seconds": time.perf_counter() - start}
