"""The vectorised analytic cost model: step time, its breakdown and memory for N strategies at once.

Every quantity is a numpy array over candidates, and ``evaluate`` returns them as ``StepCosts``: one
array per field, like ``Strategies``. The model prices one micro-batch on the most loaded pipeline
stage (forward, backward, recompute, exposed communication: ``moetrain.planner.layer_costs``), then
the step as

    step = m·t_max + (p − 1)·t_mean / v  +  exposed data-parallel traffic + optimizer + overhead

(Narayanan et al. SC21 §2.2: the 1F1B bubble is (p−1) stage times, the interleaved one (p−1)/v),
where m is the number of micro-batches per pipeline. The event-driven timeline
(``moetrain.planner.timeline``) replays the same per-stage costs (``StageTimes``) action by action for
the top candidates and for ``moetrain simulate``; for uniform stages the two agree exactly.

The parts, each a function with its own result: ``pipeline_times`` (stage times, bubble, the
communication inside the pipeline), ``data_parallel_traffic``, ``optimizer_times``,
``moetrain.planner.device_memory.device_memory`` and ``hardware_flops_factor``. MFU counts the
model's FLOPs with the full attention square, as published MFU figures do, while the attention *time*
uses the causal half (fused kernels skip masked blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from moetrain.config.parallel import ParallelConfig
from moetrain.costs.flops import mla_up_projection_flops, model_forward_flops, training_flops_per_token
from moetrain.planner.calibration import Efficiency
from moetrain.planner.comm import allgather_time, p2p_time, ranks_per_node
from moetrain.planner.compute import gemm_time, memory_time
from moetrain.planner.device_memory import LocalParams, MemoryBytes, device_memory, zero3_every_micro_batch
from moetrain.planner.layer_costs import (
    LayerCosts,
    LayerParts,
    exposed_tp,
    full_recompute_share,
    layer_costs,
    selective_recompute_share,
)
from moetrain.planner.strategy import Columns, Strategies
from moetrain.planner.workload import BF16, Workload

# Adam update traffic per local parameter: read fp32 master, m, v, grad (16 B), write master, m, v
# (12 B) and the bf16 weight (2 B).
OPTIMIZER_BYTES_PER_PARAM = 30.0

# Share of a layer pass's host issue time that the forward takes (what full recompute issues again).
HOST_FORWARD_SHARE = 0.4


@dataclass(frozen=True)
class StageTimes(Columns):
    """Per micro-batch costs of the pipeline stages, which the event-driven timeline replays: compute
    (with exposed TP and CP traffic and the host floor, without the all-to-all, which the timeline
    hides or exposes itself) and the all-to-all."""

    first_compute_s: np.ndarray
    """First stage: its layers and the embedding (with one stage also the head and MTP modules)."""
    middle_compute_s: np.ndarray
    last_compute_s: np.ndarray
    """Last stage: its layers, the head and the MTP modules."""
    first_a2a_s: np.ndarray
    """All-to-all of the first stage's MoE layers (it may hold dense layers)."""
    other_a2a_s: np.ndarray
    first_a2a_alone_hidden_s: np.ndarray
    """Of ``first_a2a_s``: what the shared expert hides when the pass is not paired."""
    other_a2a_alone_hidden_s: np.ndarray
    first_a2a_paired_hidden_s: np.ndarray
    """Of ``first_a2a_s``: the most a paired step hides, each layer's under the compute of the layer it is
    paired with (``LayerCosts.a2a_paired_hidden``)."""
    other_a2a_paired_hidden_s: np.ndarray
    forward_fraction: np.ndarray
    """Share of a layer's compute that the forward takes."""


@dataclass(frozen=True)
class PipelineTimes(Columns):
    """The pipeline part of a step on the busiest stage; every ``_s`` but ``stage_time_s`` is summed
    over the step's micro-batches."""

    stage_time_s: np.ndarray
    """The slowest stage's time per micro-batch, its exposed all-to-all and point-to-point included."""
    bubble_s: np.ndarray
    pipeline_s: np.ndarray
    """m·stage time + bubble: from the first forward to the last backward."""
    tp_comm_s: np.ndarray
    tp_exposed_s: np.ndarray
    a2a_s: np.ndarray
    a2a_exposed_s: np.ndarray
    cp_exposed_s: np.ndarray
    p2p_s: np.ndarray
    host_wait_s: np.ndarray
    """What the device waits for the host (eager issue of small kernels) on the first stage (with one
    stage the MTP modules' blocks too)."""


@dataclass(frozen=True)
class DataParallelTimes(Columns):
    """Gradient reduction and weight gathering over the data-parallel groups, per step."""

    comm_s: np.ndarray
    exposed_s: np.ndarray
    """What the passes that produce or consume the traffic do not hide."""


@dataclass(frozen=True)
class ComputeTimes(Columns):
    """Compute per step on the busiest stage, forward, backward and recompute, part by part
    (``layer_costs.LayerParts``) over the stage's own layers: the dense ones of a dense-first MoE model
    where the stage holds them, and its ends. Parts the stage does not have are 0 (``router_s`` etc. of a
    dense model). Apart from ``attention_core_s`` (of ``attention_s``) the fields add up to the stage's
    compute: with the host's wait and the exposed communication, to the pipeline's time."""

    attention_s: np.ndarray
    """Projections and the fused core."""
    attention_core_s: np.ndarray
    """Of ``attention_s``: the fused core (QKᵀ, softmax, PV)."""
    router_s: np.ndarray
    experts_s: np.ndarray
    shared_experts_s: np.ndarray
    dense_ffn_s: np.ndarray
    elementwise_s: np.ndarray
    moe_fixed_s: np.ndarray
    """The MoE layers' fixed cost per pass (``Efficiency.moe_overhead_us``)."""
    fp8_casts_s: np.ndarray
    embed_s: np.ndarray
    """Embedding (first stage)."""
    head_s: np.ndarray
    """Output head and loss (last stage)."""
    mtp_s: np.ndarray
    """Multi-token prediction modules (last stage), on the device."""

    def total_s(self) -> np.ndarray:
        """The stage's compute: every part (``attention_core_s`` is in ``attention_s``)."""
        return sum((getattr(self, f.name) for f in fields(self) if f.name != "attention_core_s"),
                   start=np.zeros(len(self)))


@dataclass(frozen=True)
class StepCosts(Columns):
    """What ``evaluate`` predicts for each strategy (entry i of every array is strategy i)."""

    step_time_s: np.ndarray
    tokens_per_s: np.ndarray
    mfu: np.ndarray
    """Model FLOPs per second over the devices' bf16 peak."""
    hardware_flops_factor: np.ndarray
    """Hardware FLOPs (what recompute runs again counted too) over model FLOPs."""
    num_micro_batches: np.ndarray
    """Per pipeline (per data-parallel replica)."""
    optimizer_s: np.ndarray
    """The optimizer step, no faster than the host issues it."""
    optimizer_device_s: np.ndarray
    """Of ``optimizer_s``: the device's part (the rest is in ``host_wait_s``)."""
    host_wait_s: np.ndarray
    """The pipeline's ``host_wait_s`` plus the optimizer step's wait for the host."""
    stages: StageTimes
    pipeline: PipelineTimes
    dp: DataParallelTimes
    compute: ComputeTimes
    recompute: ComputeTimes
    """Of ``compute``: what recompute runs again, part by part (the embedding and the head are never
    recomputed)."""
    memory: MemoryBytes

    def mfu_at(self, step_time_s) -> np.ndarray:
        """MFU if the step took ``step_time_s`` (the timeline's replay) instead of ``step_time_s``."""
        return self.mfu * self.step_time_s / step_time_s


@dataclass(frozen=True)
class _PassTimes:
    """A layer pass of one micro-batch: on the device alone (``device``), with the host floor
    (``time``), and with the floor but without the all-to-all, which the timeline places itself
    (``timeline``)."""

    device: object
    time: object
    timeline: object


def _pass_times(w: Workload, s: Strategies, eff: Efficiency, layer: LayerCosts | None,
                moe_layer: bool) -> _PassTimes:
    """Host floor: an eager stack issues every kernel of a layer pass from Python; when the kernels are
    small the device waits for the host, so a layer pass takes max(device, host). Full recompute issues
    the forward a second time. Where the host is the device (a CPU) the two add instead: the pass costs
    its device time plus what the measured host time has beyond the device work priced at the
    measurement's tokens (``_host_excess``)."""
    if layer is None:
        return _PassTimes(0.0, 0.0, 0.0)
    host_share = 1.0 + HOST_FORWARD_SHARE * full_recompute_share(s.recompute)
    without_a2a = layer.compute + exposed_tp(w, eff, layer) + layer.cp_exposed
    device = without_a2a + layer.a2a_exposed
    if w.cluster.host_is_device:
        excess = _host_excess(w, s, eff, moe_layer) * host_share
        return _PassTimes(device, device + excess, without_a2a + excess)
    host_pass = eff.host_layer_us * 1e-6 * host_share
    return _PassTimes(device, np.maximum(device, host_pass), np.maximum(without_a2a, host_pass))


def _host_excess(w: Workload, s: Strategies, eff: Efficiency, moe_layer: bool):
    """Seconds the measured time of a layer pass (``host_layer_us``, at ``host_probe_tokens`` tokens on one
    device) has beyond the device work the model prices for that same pass: the per-operator cost that the
    device terms do not hold (Python, dispatcher, autograd), which on a CPU adds to every pass. With a
    second measurement on a wide micro-batch (``host_wide_layer_us``) the excess is the line through the
    two, taken at the tokens a rank's pass computes (``micro_batch · seq_len / (cp · tp)``), never below
    zero. Where ranks share the host's cores (``ClusterConfig.core_share``), the probes ran with a core of
    their own: the excess is priced on the unshared host and stretched by the share, as the ranks' host
    work takes turns on the cores like their compute."""
    if eff.host_layer_us <= 0.0:
        return 0.0
    narrow_tokens = max(int(round(eff.host_probe_tokens)), 1)
    narrow = _probe_excess(w, eff, moe_layer, eff.host_layer_us, batch=1, seq=narrow_tokens)
    if eff.host_wide_layer_us <= 0.0:
        return narrow / w.cluster.core_share
    batch, seq = max(int(round(eff.host_wide_batch)), 1), max(int(round(eff.host_wide_seq)), 1)
    wide = _probe_excess(w, eff, moe_layer, eff.host_wide_layer_us, batch=batch, seq=seq)
    per_token = (wide - narrow) / (batch * seq - narrow_tokens)
    tokens = s.micro_batch * w.seq_len / (s.cp * s.tp)
    return np.maximum(narrow + per_token * (tokens - narrow_tokens), 0.0) / w.cluster.core_share


def _probe_excess(w: Workload, eff: Efficiency, moe_layer: bool, measured_us: float, batch: int, seq: int) -> float:
    """A probe's measured seconds per layer pass less the device work priced for the same pass: one rank
    with the host's cores, ``batch`` sequences of ``seq`` tokens in one micro-batch."""
    probe = replace(w, cluster=w.cluster.unshared(), seq_len=seq, global_batch=batch)
    one_device = Strategies.from_parallel([ParallelConfig(micro_batch=batch)])  # the same for every candidate
    priced = layer_costs(probe, one_device, eff, moe_layer=moe_layer, num_micro=1).compute
    return float(np.maximum(measured_us * 1e-6 - priced[0], 0.0))


@dataclass(frozen=True)
class _Ends:
    """Per micro-batch: the embedding (first stage), the head and loss and the MTP modules (last)."""

    embed: object
    head: object
    mtp: object


def _end_times(w: Workload, s: Strategies, eff: Efficiency, body_time) -> _Ends:
    """Output head and loss, vocabulary split over tp (this project's runtime: whole on every TP rank, over the
    gathered sequence); MTP adds a layer, a projection and the head again."""
    model, cluster = w.model, w.cluster
    h = model.hidden_size
    tp = s.tp.astype(float)
    t_att = s.micro_batch * w.seq_len / s.cp
    t_split = np.where(s.sp, t_att / tp, t_att)
    head_split = 1.0 if w.project_tensor_parallel else tp  # this project's TP runs the head whole

    # The output head stays in BF16 in FP8 runs: DeepSeek-V3 §3.3.1 keeps "the embedding module, the output
    # head, MoE gating modules, normalization operators, and attention operators" in their original
    # precision; Megatron-Core's output layer is its own ColumnParallelLinear, which Transformer Engine's FP8
    # autocast does not reach; torchtitan's Float8 converter filters the ``output`` linear by default.
    def head_time(tokens):  # forward and backward: 3 GEMMs, 3 passes over the fp32 logits
        return (3.0 * gemm_time(2.0 * h * model.vocab_size * tokens / head_split, 1, cluster, eff, "bf16")
                + 3.0 * memory_time(3 * 4.0 * model.vocab_size * tokens / head_split, cluster, eff))

    head = head_time(t_att * w.head_share)  # the loss's head (the scored positions)
    # an MTP module's head predicts at every position
    mtp = model.num_mtp_layers * (body_time + head_time(t_att) + 3.0 * gemm_time(4.0 * h * h * t_att / tp, 1,
                                                                                   cluster, eff))
    return _Ends(memory_time(3 * t_split * h * w.activation_bytes, cluster, eff), head, mtp)


@dataclass(frozen=True)
class _Stages:
    """Per micro-batch times of the stages (``p2p`` included in ``slowest`` and ``mean``)."""

    first: object
    middle: object
    last: object
    slowest: object
    mean: object
    uneven: object
    """pp·vpp does not divide the layers: the split is balanced layer by layer."""
    balanced: object
    mean_balanced: object
    embed_extra: object
    head_extra: object
    p2p: object
    layers_per_stage: object
    dense_first: object
    """Dense layers on the first stage (those of a dense-first MoE model)."""


@dataclass(frozen=True)
class _MicroBatchPasses:
    """What one micro-batch costs a stage, part by part: a dense and a body (most layers') layer pass, and
    the embedding, head and MTP ends; the stages are sums of these."""

    dense: _PassTimes
    body: _PassTimes
    ends: _Ends


def _stages(w: Workload, s: Strategies, eff: Efficiency, passes: _MicroBatchPasses) -> _Stages:
    model, cluster = w.model, w.cluster
    dense, body, ends = passes.dense, passes.body, passes.ends
    pp, vpp = s.pp.astype(float), s.vpp.astype(float)
    layers_per_stage = model.num_layers / pp
    num_dense = float(model.num_layers - model.num_moe_layers) if model.moe is not None else 0.0
    dense_first = np.minimum(num_dense, layers_per_stage)
    first = dense_first * dense.time + (layers_per_stage - dense_first) * body.time + ends.embed
    last = layers_per_stage * body.time + ends.head + ends.mtp
    middle = layers_per_stage * body.time
    single = np.where(pp == 1, first + ends.head + ends.mtp, 0.0)
    t_max = np.where(pp == 1, single, np.maximum(np.maximum(first, last), np.where(pp > 2, middle, 0.0)))
    t_mean = np.where(pp == 1, single, (first + last + (pp - 2) * middle) / pp)
    # Layer counts that pp·vpp does not divide need an uneven split, which the user states layer by
    # layer (Megatron-Core pipeline layouts, DeepSeek's DualPipe placement): take the split that evens
    # out the ranks' work at whole-layer granularity, the embedding and the dense layers on the first
    # rank, head and MTP on the last. Even counts keep the uniform split (Megatron's default).
    embed_extra = ends.embed + num_dense * (dense.time - body.time)
    head_extra = ends.head + ends.mtp
    balanced = balanced_stage_time(model.num_layers, pp, body.time, embed_extra, head_extra)
    uneven = (pp > 1) & (model.num_layers % (s.pp * s.vpp) != 0)
    mean_balanced = (model.num_layers * body.time + embed_extra + head_extra) / pp
    t_max = np.where(uneven, balanced, t_max)
    t_mean = np.where(uneven, mean_balanced, t_mean)
    # Pipeline send/recv of the boundary activation, forward and backward, per chunk boundary. Each TP
    # rank sends its 1/tp slice (Megatron's scatter/gather of pipeline tensors; sequence parallelism
    # splits it anyway) over its own link, and the next stage re-gathers it inside the TP group.
    boundary = s.micro_batch * w.seq_len / s.cp / s.tp.astype(float) * model.hidden_size * w.activation_bytes
    p2p = 2.0 * vpp * p2p_time(boundary, s.tp * s.cp * s.dp >= cluster.fabric_devices, cluster, eff)
    p2p = np.where(pp > 1, p2p, 0.0)
    return _Stages(first, middle, last, t_max + p2p, t_mean + p2p, uneven, balanced, mean_balanced, embed_extra,
                   head_extra, p2p, layers_per_stage, dense_first)


def _stage_times(w: Workload, s: Strategies, st: _Stages, passes: _MicroBatchPasses,
                 body_layer: LayerCosts) -> StageTimes:
    """The timeline's inputs: per-stage compute without the all-to-all, and the all-to-all apart."""
    model = w.model
    dense, body, ends = passes.dense, passes.body, passes.ends
    pp = s.pp.astype(float)
    lps, dense_first = st.layers_per_stage, st.dense_first
    first_layers = dense_first * dense.timeline + (lps - dense_first) * body.timeline
    first = np.where(pp == 1, first_layers + ends.embed + ends.head + ends.mtp, first_layers + ends.embed) + st.p2p
    middle = lps * body.timeline + st.p2p
    last = lps * body.timeline + ends.head + ends.mtp + st.p2p
    # Balanced uneven splits: every rank carries the balanced stage time (the timeline sees uniform stages).
    balanced = st.balanced * (model.num_layers * body.timeline + st.embed_extra + st.head_extra) / (
        pp * np.maximum(st.mean_balanced, 1e-30)) + st.p2p
    moe_first = lps - dense_first if model.moe is not None else 0.0
    moe_other = lps if model.moe is not None else 0.0
    return StageTimes.broadcast(
        len(s),
        first_compute_s=np.where(st.uneven, balanced, first),
        middle_compute_s=np.where(st.uneven, balanced, middle),
        last_compute_s=np.where(st.uneven, balanced, last),
        first_a2a_s=moe_first * body_layer.a2a,
        other_a2a_s=moe_other * body_layer.a2a,
        first_a2a_alone_hidden_s=moe_first * body_layer.a2a_alone_hidden,
        other_a2a_alone_hidden_s=moe_other * body_layer.a2a_alone_hidden,
        first_a2a_paired_hidden_s=moe_first * body_layer.a2a_paired_hidden,
        other_a2a_paired_hidden_s=moe_other * body_layer.a2a_paired_hidden,
        forward_fraction=body_layer.fwd / body_layer.compute)


def _bubble(w: Workload, s: Strategies, st: _Stages, num_micro):
    """(p − 1)·t_mean/v; and the paired schedule without interleaving serialises the pipeline: a fused
    step receives both inputs before it starts and its forward output leaves close to its end (the
    halves take turns), so step k of rank r waits for step k of rank r+1 (its backward's gradient), which
    waits for step k−1 of rank r (its forward's input). The steady period becomes the slowest pair of
    neighbouring ranks' step times instead of the slowest rank's, and every step past the first two
    waits for the difference (the timeline replays it; ``tests/planner/test_search.py`` checks the two
    agree). Interleaving breaks the cycle through the other chunks: with vpp > 1 pairing costs no idle."""
    pp, vpp = s.pp.astype(float), s.vpp.astype(float)
    bubble = (pp - 1) * st.mean / vpp
    neighbours = np.where(pp == 2, st.first + st.last, np.maximum(
        np.maximum(st.first, st.last) + st.middle, np.where(pp > 3, 2.0 * st.middle, 0.0))) + 2.0 * st.p2p
    neighbours = np.where(st.uneven, 2.0 * st.slowest, neighbours)
    serialised = (s.overlap & (s.vpp == 1) & (s.pp > 1) & (not w.bidirectional_pairing)).astype(float)
    return bubble + serialised * np.maximum(num_micro - 2.0, 0.0) * (neighbours - st.slowest)


def pipeline_times(w: Workload, s: Strategies, eff: Efficiency, dense: LayerCosts | None, body: LayerCosts,
                   num_micro) -> tuple[StageTimes, PipelineTimes, ComputeTimes, ComputeTimes]:
    """Stage times, bubble and the communication inside the pipeline. ``dense``: the dense layers'
    costs (None when every layer is an MoE layer); ``body``: the costs of most layers (MoE layers in an
    MoE model)."""
    model = w.model
    dense_pass = _pass_times(w, s, eff, dense, moe_layer=False)
    body_pass = _pass_times(w, s, eff, body, moe_layer=w.model.moe is not None)
    ends = _end_times(w, s, eff, body_pass.time)
    passes = _MicroBatchPasses(dense_pass, body_pass, ends)
    st = _stages(w, s, eff, passes)
    bubble = _bubble(w, s, st, num_micro)
    per_step = num_micro * st.layers_per_stage
    mtp_on_first = np.where(s.pp == 1, model.num_mtp_layers, 0)
    host_wait = num_micro * (st.dense_first * (dense_pass.time - dense_pass.device) + (
        st.layers_per_stage - st.dense_first + mtp_on_first) * (body_pass.time - body_pass.device))
    pipeline = PipelineTimes.broadcast(
        len(s), stage_time_s=st.slowest, bubble_s=bubble, pipeline_s=num_micro * st.slowest + bubble,
        tp_comm_s=per_step * body.tp_comm, tp_exposed_s=per_step * exposed_tp(w, eff, body),
        a2a_s=per_step * body.a2a, a2a_exposed_s=per_step * body.a2a_exposed, cp_exposed_s=per_step * body.cp_exposed,
        p2p_s=num_micro * st.p2p, host_wait_s=host_wait)
    compute, recompute = _busiest_stage_compute(w, s, st, passes, dense, body, num_micro)
    return _stage_times(w, s, st, passes, body), pipeline, compute, recompute


def _busiest_stage_compute(w: Workload, s: Strategies, st: _Stages, passes: _MicroBatchPasses,
                           dense: LayerCosts | None, body: LayerCosts,
                           num_micro) -> tuple[ComputeTimes, ComputeTimes]:
    """The busiest stage's compute per step, part by part: its dense and body layers' ``LayerParts`` and its
    ends. A single stage holds everything; of several, the slowest one's own (the first holds the dense
    layers and the embedding, the last the head and MTP); an uneven split, balanced layer by layer, is
    told by its mean rank (every part over pp). Second: of that, what recompute runs again, part by part
    (the layers' ``recompute_parts`` and the MTP modules' layer's recompute)."""
    model = w.model
    pp = s.pp.astype(float)
    ends = passes.ends
    num_dense = float(model.num_layers - model.num_moe_layers) if model.moe is not None else 0.0
    first_busiest = (pp == 1) | ((st.first >= st.last) & ((pp <= 2) | (st.first >= st.middle)))
    last_busiest = (pp == 1) | (~first_busiest & ((pp <= 2) | (st.last >= st.middle)))
    n_dense = np.where(st.uneven, num_dense / pp, np.where(first_busiest, st.dense_first, 0.0))
    n_body = np.where(st.uneven, (model.num_layers - num_dense) / pp, st.layers_per_stage - n_dense)
    holds_first = np.where(st.uneven, 1.0 / pp, first_busiest)
    holds_last = np.where(st.uneven, 1.0 / pp, last_busiest)
    # the MTP modules' layer pass carries the host floor; the pipeline's host wait counts it on one stage
    mtp_gap = np.where(pp == 1, model.num_mtp_layers * (passes.body.time - passes.body.device), 0.0)

    def stage_times(dense_parts: LayerParts, body_parts: LayerParts, embed, head, mtp) -> ComputeTimes:
        def total(name: str):
            return num_micro * (n_dense * getattr(dense_parts, name) + n_body * getattr(body_parts, name))

        return ComputeTimes.broadcast(
            len(s), attention_s=total("attention_projections") + total("attention_core"),
            attention_core_s=total("attention_core"),
            **{f"{name}_s": total(name) for name in (
                "router", "experts", "shared_experts", "dense_ffn", "elementwise", "moe_fixed", "fp8_casts")},
            embed_s=num_micro * holds_first * embed, head_s=num_micro * holds_last * head,
            mtp_s=num_micro * holds_last * mtp)

    compute = stage_times(dense.parts if dense is not None else LayerParts(), body.parts, ends.embed, ends.head,
                          ends.mtp - mtp_gap)
    recompute = stage_times(dense.recompute_parts if dense is not None else LayerParts(), body.recompute_parts,
                            0.0, 0.0, model.num_mtp_layers * body.recompute)
    return compute, recompute


@dataclass(frozen=True)
class _DataParallelCollectives:
    """One pass of each data-parallel collective of a rank, the dense and the expert parameters' together."""

    grad_sync: object
    """Reducing the gradients: a reduce-scatter (ZeRO ≥ 1; ZeRO 0's all-reduce is two of it)."""
    param_gather: object
    """All-gathering the updated bf16 weights (ZeRO ≥ 1)."""


def _dp_collectives(w: Workload, s: Strategies, eff: Efficiency, params: LocalParams) -> _DataParallelCollectives:
    """Ring collectives of the local dense and expert parameters over their data-parallel groups."""
    devices_per_node = w.cluster.fabric_devices
    dense_in_node = ranks_per_node(params.dense_dp, s.tp, devices_per_node)
    exp_in_node = ranks_per_node(params.expert_dp, s.ep * s.etp, devices_per_node)

    def shard_traffic(local, group, in_node):
        return (allgather_time(local * w.grad_bytes, group, in_node, w.cluster, eff),
                allgather_time(local * BF16, group, in_node, w.cluster, eff))

    g_d, a_d = shard_traffic(params.dense, params.dense_dp, dense_in_node)
    g_e, a_e = shard_traffic(params.experts, params.expert_dp, exp_in_node)
    # ZeRO's reduce-scatter run as an all-reduce (``reduce_scatter_by_all_reduce``) costs two ring passes
    grad_sync = (g_d + g_e) * np.where((s.zero >= 1) & w.reduce_scatter_by_all_reduce, 2.0, 1.0)
    return _DataParallelCollectives(grad_sync, a_d + a_e)


def num_micro_batches(w: Workload, s: Strategies):
    """Micro-batches per pipeline (per data-parallel replica) in a step."""
    return w.global_batch / (s.dp * s.micro_batch)


def data_parallel_traffic(w: Workload, s: Strategies, eff: Efficiency, params: LocalParams, forward_fraction,
                          stage_time_s) -> DataParallelTimes:
    """Gradient reduction and weight gathering of the dense and the expert parameters over their
    data-parallel groups, and what of it the passes that produce or consume it hide.

    ZeRO 0: all-reduce (= reduce-scatter + all-gather of the gradient); 1-2: reduce-scatter gradients,
    all-gather the updated bf16 weights; 3 without a pipeline: weights gathered for forward and backward
    of every micro-batch and gradients reduce-scattered every micro-batch (FSDP with accumulation);
    3 under a pipeline: once per step (``zero3_every_micro_batch``).
    What hides it, and under which compute (each collective can only run under the pass that produces or
    consumes its buckets):
    - ZeRO 0-2 with bucketed overlap (Megatron-Core overlap_grad_reduce / overlap_param_gather,
      DeepSpeed): the gradient reduction runs under the backward of the step's last micro-batch, the
      weight all-gather under the forward of the next step's first micro-batch.
    - ZeRO-3 / FSDP: every micro-batch prefetches the next layer's weights during the forward, and
      during the backward gathers them again and reduce-scatters the previous layer's gradients, so
      forward gathers hide under the forward, backward gathers + reduce-scatters under the backward
      (Zhao et al. 2023, PyTorch FSDP, §3.3-3.4).
    ``grad_overlap`` is the share of that window the collectives can use (the first and last buckets,
    and compute slowed by the concurrent traffic, keep it below 1). A source that states the overlap gets
    the whole window, less the chunk issued last (``dp_overlap_chunks``). ``forward_fraction`` and
    ``stage_time_s``: the busiest stage's share of forward compute and its time per micro-batch (the window)."""
    num_micro = num_micro_batches(w, s)
    collectives = _dp_collectives(w, s, eff, params)
    grad_sync, param_gather = collectives.grad_sync, collectives.param_gather
    per_step_comm = np.where(s.zero == 0, 2.0 * grad_sync, grad_sync + param_gather)
    z3_every_micro = zero3_every_micro_batch(s)
    stated = "DP" in w.comm_overlap_stated
    hide = (1.0 if stated else eff.grad_overlap) if w.overlap_grad_comm else 0.0
    window_fwd = hide * forward_fraction * stage_time_s
    window_bwd = hide * (1.0 - forward_fraction) * stage_time_s
    # A stack that states its overlap still waits for the chunk issued last (``dp_overlap_chunks``).
    last_chunk = 1.0 / dp_overlap_chunks(s.pp, s.vpp, w.model.num_layers) if stated and w.overlap_grad_comm else 0.0

    def exposed(traffic, window):
        return np.maximum(traffic - window, last_chunk * traffic)

    grad_reduce = np.where(s.zero == 0, 2.0 * grad_sync, grad_sync)
    exposed_step = (exposed(grad_reduce, window_bwd)
                    + np.where(s.zero >= 1, exposed(param_gather, window_fwd), 0.0))
    exposed_z3 = num_micro * (exposed(param_gather, window_fwd) + exposed(param_gather + grad_sync, window_bwd))
    total = np.where(z3_every_micro, num_micro * (grad_sync + 2.0 * param_gather), per_step_comm)
    exposed = np.where(z3_every_micro, exposed_z3, exposed_step)
    exposed = np.where((params.dense_dp > 1) | (params.expert_dp > 1), exposed, 0.0)
    return DataParallelTimes.broadcast(len(s), comm_s=total, exposed_s=exposed)


def dp_overlap_chunks(pp, vpp, num_layers: int) -> np.ndarray:
    """Chunks in which an overlapping stack issues a rank's data-parallel traffic, of which the last has no
    compute left to hide under: one per transformer layer, and under a pipeline one per virtual stage
    (Megatron Bridge, "Communication Overlap": the DP communication "is chunked by the granularity of a
    Transformer layer" and "exposes only one DP communication chunk"; "with pipeline parallelism, the
    granularity ... becomes the Transformer layers per virtual pipeline stage"). So at most 1 − 1/chunks of
    the traffic is hidden, however long the window."""
    pp = np.asarray(pp, dtype=float)
    layers_per_rank = np.maximum(np.floor(num_layers / pp), 1.0)
    return np.where(pp > 1, np.asarray(vpp, dtype=float), layers_per_rank)


def optimizer_times(w: Workload, s: Strategies, eff: Efficiency, params: LocalParams):
    """(device time, step time) of the Adam update of the local (ZeRO-sharded from stage 1) parameters:
    memory-bound on the device, and no faster than the host issues it."""
    dense_shard = np.where(s.zero >= 1, params.dense_dp, 1)
    expert_shard = np.where(s.zero >= 1, params.expert_dp, 1)
    device = memory_time(OPTIMIZER_BYTES_PER_PARAM * (params.dense / dense_shard + params.experts / expert_shard),
                         w.cluster, eff)
    return device, np.maximum(device, eff.host_optimizer_ms * 1e-3)


def hardware_flops_factor(w: Workload, s: Strategies) -> np.ndarray:
    """Hardware over model FLOPs (HFU-style sources count what recomputation runs again): full recompute
    repeats every layer's forward but not the output head (Narayanan et al. SC21 eq. 3:
    96·B·s·l·h²·(1 + s/6h + V/16lh), the logits counted three times, not four); selective recompute
    repeats the one matmul of its set, MLA's up-projections, in every layer (the MTP modules' too), and
    not the core attention of Korthikanti et al. 2022 §5, whose tensors that set keeps."""
    forward = model_forward_flops(w.model, w.seq_len)
    full_extra = (forward.forward - forward.head) / forward.training
    layers = w.model.num_layers + w.model.num_mtp_layers
    selective_extra = layers * mla_up_projection_flops(w.model) / forward.training
    full_share = full_recompute_share(s.recompute)
    selective_share = selective_recompute_share(s.recompute)
    return 1.0 + (full_share * full_extra + (1.0 - full_share) * selective_share * selective_extra)


def balanced_stage_time(num_layers: int, pp, layer_time, first_extra, last_extra):
    """Slowest rank's time per micro-batch when ``num_layers`` layers of ``layer_time`` each are split
    over ``pp`` ranks in whole layers, the first rank also doing ``first_extra`` and the last
    ``last_extra``, and the split minimises the slowest rank. A target T is feasible when the ranks can
    hold all layers: ⌊(T−e)/c⌋ + ⌊(T−h)/c⌋ + (p−2)⌊T/c⌋ ≥ L; the optimum lies in [T0, T0 + c] with
    T0 = max(total/p, e, h), on a breakpoint x + k·c (x ∈ {0, e, h}), so four candidates suffice."""
    pp = np.asarray(pp, dtype=float)
    c = np.maximum(np.asarray(layer_time, dtype=float), 1e-30)
    e = np.asarray(first_extra, dtype=float)
    h = np.asarray(last_extra, dtype=float)
    lower = np.maximum(np.maximum((num_layers * c + e + h) / np.maximum(pp, 1.0), e), h)
    tol = 1e-9

    def feasible(t):
        held = (np.floor((t - e) / c + tol) + np.floor((t - h) / c + tol)
                + np.maximum(pp - 2, 0) * np.floor(t / c + tol))
        return held >= num_layers

    best = lower + c
    for offset in (0.0, e, h):
        t = offset + c * np.ceil((lower - offset) / c - tol)
        best = np.where(feasible(t) & (t < best), t, best)
    return best


def evaluate(w: Workload, s: Strategies, eff: Efficiency) -> StepCosts:
    """Step time, breakdown, MFU and memory for every strategy in ``s`` (arrays of len(s))."""
    model = w.model
    num_micro = num_micro_batches(w, s)
    dense = layer_costs(w, s, eff, moe_layer=False, num_micro=num_micro) if (
        model.moe is None or model.num_dense_layers) else None
    moe = layer_costs(w, s, eff, moe_layer=True, num_micro=num_micro) if model.moe is not None else None
    body = moe if moe is not None else dense
    assert body is not None
    stages, pipeline, compute, recompute = pipeline_times(w, s, eff, dense, body, num_micro)
    params = LocalParams.of(w, s)
    dp = data_parallel_traffic(w, s, eff, params, stages.forward_fraction, pipeline.stage_time_s)
    optimizer_device, optimizer = optimizer_times(w, s, eff, params)
    step = pipeline.pipeline_s + dp.exposed_s + optimizer + eff.step_overhead_ms * 1e-3
    tokens = w.global_batch * w.seq_len
    model_flops = training_flops_per_token(model, w.seq_len) * tokens
    mfu = model_flops / (step * (s.tp * s.cp * s.pp * s.dp) * w.cluster.peak_flops("bf16"))
    column = lambda v: np.broadcast_to(np.asarray(v, dtype=float), (len(s),))  # noqa: E731
    return StepCosts(
        step_time_s=column(step), tokens_per_s=column(tokens / step), mfu=column(mfu),
        hardware_flops_factor=column(hardware_flops_factor(w, s)), num_micro_batches=column(num_micro),
        optimizer_s=column(optimizer), optimizer_device_s=column(optimizer_device),
        host_wait_s=column(pipeline.host_wait_s + (optimizer - optimizer_device)),
        stages=stages, pipeline=pipeline, dp=dp, compute=compute, recompute=recompute,
        memory=device_memory(w, s, params, num_micro))
