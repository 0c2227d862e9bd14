"""One layout's prediction (``moetrain simulate``): the cost model's step with the pipeline replayed by
the event-driven timeline, its breakdown, memory per device, and how far the step moves under each fit
of the calibration's cross-validation."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moetrain.config.parallel import ParallelConfig
from moetrain.errors import UserError
from moetrain.planner.calibration import Calibration
from moetrain.planner.costmodel import StepCosts, evaluate
from moetrain.planner.device_memory import GIB
from moetrain.planner.layer_costs import recompute_code
from moetrain.planner.search import step_after_pipeline, timeline_step
from moetrain.planner.strategy import Strategies
from moetrain.planner.timeline import TimelineResult, simulate_timeline, stage_costs_from_model
from moetrain.planner.workload import Workload


@dataclass(frozen=True)
class Traffic:
    """One kind of communication over a step on the busiest stage."""

    exposed_s: float
    total_s: float | None = None
    """None where the model prices only what shows (context parallelism's exchange)."""


@dataclass(frozen=True)
class LayoutPrediction:
    parallel: ParallelConfig
    devices: int
    micro_batches_per_pipeline: int
    step_time_s: float
    """The cost model's step with the pipeline part replayed by the timeline."""
    tokens_per_s: float
    tokens_per_s_per_device: float
    mfu: float
    bubble_s: float
    """Idle time of the busiest pipeline rank."""
    bubble_fraction: float
    optimizer_s: float
    optimizer_device_s: float
    """Of ``optimizer_s``: the device's part; the rest is in ``host_wait_s``."""
    host_wait_s: float
    compute_s: dict[str, float]
    """Per step on the busiest stage, by part (``_compute_parts``): they add up to its compute."""
    attention_core_s: float
    """Of ``compute_s["attention"]``: the fused core."""
    communication_s: dict[str, Traffic]
    memory_gib: dict[str, float]
    """weights, grads, optimizer, activations, buffers and their total, per device."""
    hbm_gib: float
    fits_memory: bool
    step_time_s_held_out_fits: dict[str, float] = field(default_factory=dict)
    """The same layout under each fit of the calibration's cross-validation (one source of published
    runs left out): how far the prediction moves with the sources it was fitted on."""
    timeline: TimelineResult | None = None


def _compute_parts(workload: Workload, costs: StepCosts) -> dict[str, float]:
    """The busiest stage's compute per step by part (``ComputeTimes``, which add up to it): the layer parts
    the model has, the head, and the rest where they cost anything."""
    c = costs.compute
    model = workload.model
    always = {"attention": c.attention_s}
    if model.moe is not None:
        always |= {"router": c.router_s, "experts": c.experts_s, "shared_experts": c.shared_experts_s}
    if model.moe is None or model.num_dense_layers:
        always["dense_ffn"] = c.dense_ffn_s
    always |= {"elementwise": c.elementwise_s, "head": c.head_s}
    if_any = {"moe_fixed": c.moe_fixed_s, "fp8_casts": c.fp8_casts_s, "embed": c.embed_s, "mtp": c.mtp_s}
    parts = {name: float(value[0]) for name, value in always.items()}
    return parts | {name: float(value[0]) for name, value in if_any.items() if float(value[0]) > 0.0}


def _memory_gib(costs: StepCosts) -> dict[str, float]:
    m = costs.memory
    return {"weights": float(m.weights[0]) / GIB, "grads": float(m.grads[0]) / GIB,
            "optimizer": float(m.optimizer[0]) / GIB, "activations": float(m.activations[0]) / GIB,
            "buffers": float(m.buffers[0]) / GIB, "total": float(m.total[0]) / GIB}


def simulate_layout(workload: Workload, parallel: ParallelConfig, devices: int, calibration: Calibration,
                    record_spans: bool = False, recompute_share: float = 1.0) -> LayoutPrediction:
    """``parallel`` on ``devices`` devices of ``workload.cluster``; ``record_spans`` keeps the timeline's
    spans for a Gantt chart; ``recompute_share``: the share of the layers that run ``parallel.recompute``
    (``layer_costs.recompute_code``), as a stack that recomputes only what memory needs does."""
    eff = calibration.for_device(workload.cluster.device)
    strategies = Strategies.from_parallel([parallel])
    strategies.recompute = np.array([recompute_code(parallel.recompute, recompute_share)])
    costs = evaluate(workload, strategies, eff)
    num_micro = int(round(float(costs.num_micro_batches[0])))
    if parallel.vpp > 1 and num_micro % parallel.pp:
        raise UserError(f"the interleaved schedule needs micro-batches per pipeline ({num_micro}) divisible by "
                        f"pp ({parallel.pp}); change --global-batch or --micro-batch")
    stage = stage_costs_from_model(costs.stages, 0, parallel.pp, parallel.vpp)
    timeline = simulate_timeline(parallel.pp, parallel.vpp, num_micro, stage, parallel.overlap,
                                 record_spans=record_spans)
    step = step_after_pipeline(timeline.step_time_s, costs, 0, eff)
    tokens = workload.global_batch * workload.seq_len
    busiest = int(np.argmax(timeline.busy_s))
    pipe = costs.pipeline
    first = lambda column: float(column[0])  # noqa: E731
    communication = {
        "tensor_parallel": Traffic(first(pipe.tp_exposed_s), first(pipe.tp_comm_s)),
        "all_to_all": Traffic(timeline.a2a_exposed_s, timeline.a2a_total_s),
        "data_parallel": Traffic(first(costs.dp.exposed_s), first(costs.dp.comm_s)),
        "context_parallel": Traffic(first(pipe.cp_exposed_s)),
        "pipeline_p2p": Traffic(first(pipe.p2p_s), first(pipe.p2p_s)),
    }
    memory = _memory_gib(costs)
    return LayoutPrediction(
        parallel=parallel, devices=devices, micro_batches_per_pipeline=num_micro, step_time_s=step,
        tokens_per_s=tokens / step, tokens_per_s_per_device=tokens / step / devices,
        mfu=float(costs.mfu_at(step)[0]), bubble_s=timeline.step_time_s - timeline.busy_s[busiest],
        bubble_fraction=timeline.bubble_fraction[busiest], optimizer_s=first(costs.optimizer_s),
        optimizer_device_s=first(costs.optimizer_device_s), host_wait_s=first(costs.host_wait_s),
        compute_s=_compute_parts(workload, costs), attention_core_s=first(costs.compute.attention_core_s),
        communication_s=communication, memory_gib=memory, hbm_gib=workload.cluster.hbm_bytes / GIB,
        fits_memory=memory["total"] * GIB <= workload.cluster.hbm_bytes,
        step_time_s_held_out_fits={
            family: timeline_step(evaluate(workload, strategies, fit_eff), strategies, 0, fit_eff)
            for family, fit_eff in calibration.held_out_for_device(workload.cluster.device).items()},
        timeline=timeline)
