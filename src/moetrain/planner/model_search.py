"""Model-shape search (``moetrain plan --search-model``): compare expert count, hidden size and depth
near a parameter budget by the throughput of each shape's best layout, as the reference team did
when it chose 256 experts, hidden 7680 and 61 layers for Ascend (SPEC §1, §3).

Each shape keeps the base model's attention proportions (heads scale with hidden) and its activated
expert compute (m× the experts at 1/m the width route to m× the top-k). Shapes are ranked by
predicted training tokens/s at their best layout. A coarser layout space keeps the comparison within seconds per shape.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from moetrain.config.model import GQAConfig, MLAConfig, ModelConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.costs.params import count_params
from moetrain.errors import UserError
from moetrain.planner.calibration import Efficiency
from moetrain.planner.search import SearchOptions, SearchSpace, search
from moetrain.planner.workload import Workload

COARSE = SearchSpace(tp=(1, 2, 4, 8), cp=(1, 2), vpp=(1, 2, 4), etp=(1,), zero=(1,), micro_batch=(1, 2),
                     recompute=(0, 1, 2), a2a=(0, 1), overlap=(1,), sp=(0, 1))
SHAPE_SEARCH = SearchOptions(COARSE, top_k=1, timeline_top=3, time_every_choice=False, runnable_only=False)
"""How each shape's best layout is found: the coarse space, its three best timed, runnable today or not."""


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


@dataclass(frozen=True)
class ShapeScore:
    """One model shape at its best layout."""

    experts: int
    hidden: int
    layers: int
    total_params_b: float
    active_params_b: float
    tokens_per_s: float
    """Training throughput at the best layout's timeline step."""
    mfu: float
    parallel: ParallelConfig


@dataclass
class ShapeSearch:
    budget_params_b: float
    tolerance: float
    """Shapes whose parameter count is within this share of the budget are compared."""
    shapes: list[ShapeScore] = field(default_factory=list)
    """Fastest first."""
    candidates_evaluated: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["shapes"] = [{**asdict(s), "parallel": s.parallel.model_dump()} for s in self.shapes]
        return out


def search_model_shapes(workload: Workload, devices: int, eff: Efficiency, budget_params: float | None = None,
                        tolerance: float = 0.15) -> ShapeSearch:
    """Shapes of ``workload.model`` (expert count, hidden size, depth) within ``tolerance`` of
    ``budget_params`` parameters (default: the model's own count), by throughput at their best layout."""
    base = workload.model
    budget = budget_params if budget_params else float(count_params(base).total)
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
                result = search(w, devices, eff, SHAPE_SEARCH)
                evaluated += result.candidates_evaluated
                if len(result.top) == 0:
                    continue
                best = result.ranked[0]
                shapes.append(ShapeScore(experts, hidden, layers, counts.total / 1e9, counts.active / 1e9,
                                         best.tokens_per_s, best.mfu, best.parallel))
    if not shapes:
        raise UserError("no model shape near the budget fits the devices; raise --devices or --param-budget")
    shapes.sort(key=lambda s: -s.tokens_per_s)
    return ShapeSearch(budget / 1e9, tolerance, shapes, evaluated, time.perf_counter() - start)
