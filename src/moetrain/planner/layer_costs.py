"""One decoder layer's times for one micro-batch on one device, as arrays over strategies.

The layer is priced part by part (attention, then the dense or MoE feed-forward) and then its
communication: tensor-parallel collectives, the context-parallel exchange, and the expert all-to-all with
what the paired schedule hides of it. ``moetrain.planner.costmodel`` assembles these into stages and
steps.

Conventions: FLOPs from ``moetrain.costs.flops`` (2·m·k·n per matmul, backward 2× forward); the
attention *time* uses the causal half (fused kernels skip masked blocks). Recompute is coded 0 none,
1 selective, 2 full; a value between 1 and 2 is selective recompute with that share (code − 1) of the
layers recomputed whole (Megatron's --recompute-num-layers); a value between 0 and 1 is selective
recompute on that share of the layers only (``selective_recompute_share``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from moetrain.config.model import MLAConfig
from moetrain.costs.flops import (
    attention_core_flops,
    attention_linear_widths,
    attention_projection_flops,
    mla_up_projection_flops,
    mlp_linear_widths,
)
from moetrain.costs.params import mlp_params
from moetrain.planner.calibration import Efficiency
from moetrain.planner.comm import (
    RankGroup,
    allgather_time,
    allreduce_time,
    alltoall_time,
    alltoall_volume,
    p2p_time,
    ranks_per_node,
)
from moetrain.planner.compute import (
    ExpertShard,
    attention_time,
    expert_compute_time,
    gemm_time,
    memory_time,
    mlp_matrix_count,
)
from moetrain.planner.documents import core_time_factor
from moetrain.planner.strategy import Strategies
from moetrain.planner.workload import Workload

# Fused attention backward time over forward time. Five matmuls against two (FlashAttention-2 §3.2)
# would give 2.5; on an H100 with torch 2.11 every fused kernel measured 3.0-3.4 at head dim 128 and
# sequence 4096 (cuDNN 2.97-3.03, FlashAttention-2 3.03, memory-efficient 3.39, and 3.35 for MLA's 192/128
# heads: benchmarks/gpu_attention_probe.py, benchmarks/results/gpu_attention_probe.json).
ATTENTION_BACKWARD_OVER_FORWARD = 3.0

FP8_CAST_BYTES_PER_ELEMENT = 4.0
"""HBM bytes per element an FP8 stack moves to quantise a linear layer's input (forward) or output gradient
(backward): one BF16 read and two FP8 writes, the row-wise copy for the forward or data-gradient GEMM and the
column-wise (transposed) one for the weight-gradient GEMM. Transformer Engine's cast-transpose (Hopper FP8)
and MXFP8 quantise kernels (Blackwell) write both in one pass; the per-block scales add 1/32 of a byte
(MXFP8), and the amax read of current scaling, which would add 2 bytes, is not counted."""

FILL_WARMUP_EXPOSED = 0.7
"""Share of the pipeline-fill warm-up forwards (2·(pp − r − 1) on rank r with interleaving, pp − r − 1
without) whose unpaired all-to-all lengthens the step; the rest runs while later ranks still wait for
their first input. Not a fitted efficiency: it makes the screen agree with the event-driven timeline it
stands in for (timeline/screen step 0.995-1.007, medians 0.999-1.002, over the 300 best paired layouts of
six searches: ``benchmarks/planner_screen_vs_timeline.py``; ``tests/planner/test_search.py`` checks the
agreement on one)."""


UNPAIRED_A2A_HIDDEN_WITH_SPLIT_DW = 0.5
"""Share of an unpaired (warm-up or cool-down) pass's all-to-all hidden inside its own layer by a stack that
computes weight gradients apart from input gradients: the shared expert's forward under the dispatch, its
backward under the combine, the routed experts' weight gradients under the backward dispatch. Published,
not fitted: MindSpeed's ``--moe-fb-overlap`` hides 100 % of the all-to-all in the 1F1B phase and 50 % in
warm-up and cool-down (``docs/zh/features/megatron_moe/megatron-moe-fb-overlap.md``, in
``../shared/research/pangu-system.md`` §4 and ``runtime-anchors.md`` [MS-fb])."""


@dataclass(frozen=True)
class LayerParts:
    """One layer pass's compute part by part, forward, backward and recompute together: the parts add up to
    ``LayerCosts.compute``, so a step's time can be told by what spends it (``costmodel.ComputeTimes``)."""

    attention_projections: object = 0.0
    """The projections' GEMMs (MLA's up-projections again under selective recompute)."""
    attention_core: object = 0.0
    """The fused core (QKᵀ, softmax, PV): its forward and its own backward (``ATTENTION_BACKWARD_OVER_FORWARD``)."""
    router: object = 0.0
    experts: object = 0.0
    shared_experts: object = 0.0
    dense_ffn: object = 0.0
    elementwise: object = 0.0
    """Norms, residuals, rotary, activation, permutes: the memory-bound kernels and every kernel's launch."""
    moe_fixed: object = 0.0
    """The MoE layer's fixed cost per pass (``moe_pass_seconds``)."""
    fp8_casts: object = 0.0

    @property
    def total(self):
        return sum(getattr(self, f.name) for f in fields(self))

    def __add__(self, other: LayerParts) -> LayerParts:
        return LayerParts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: LayerParts) -> LayerParts:
        return LayerParts(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})


@dataclass(frozen=True)
class LayerCosts:
    """One layer pass of one micro-batch on one device; each field an array over strategies (or 0.0)."""

    fwd: object
    bwd: object
    tp_comm: object
    """Tensor-parallel collectives of forward, backward and recompute."""
    tp_async_hidden: object
    """Of ``tp_comm``: the backward's input-gradient collectives of the column-parallel layers, which a stack
    with ``Workload.async_tp_input_grad`` runs under those layers' weight-gradient GEMMs."""
    cp_exposed: object
    """Context-parallel exchange that the attention kernels do not hide."""
    a2a: object = 0.0
    """Expert all-to-all of forward, backward and recompute (dispatch and combine)."""
    a2a_exposed: object = 0.0
    """Of ``a2a``: what neither the paired schedule nor the shared expert hides."""
    a2a_alone_hidden: object = 0.0
    """Of ``a2a``: what the shared expert alone hides (a forward or backward that is not paired)."""
    a2a_paired_hidden: object = 0.0
    """Of ``a2a``: what a paired pass hides, under the compute of the layer it is paired with (the window
    below); the event-driven timeline caps a paired step's hidden all-to-all at this per layer too."""
    attention: object = 0.0
    """Forward time of the projections and the core attention (the parts below are forward times too)."""
    router: object = 0.0
    experts: object = 0.0
    shared_experts: object = 0.0
    dense_ffn: object = 0.0
    elementwise: object = 0.0
    attention_core: object = 0.0
    """Of ``attention``: the fused core (QKᵀ, softmax, PV), forward."""
    moe_pass: object = 0.0
    """Of the MoE block's forward: the fixed cost per MoE layer pass (``Efficiency.moe_overhead_us``)."""
    fp8_casts: object = 0.0
    """Quantising the FP8 GEMMs' operands, forward and backward of the pass (``FP8_CAST_BYTES_PER_ELEMENT``)."""
    trained_parts: LayerParts = LayerParts()
    """Forward and backward (``fwd + bwd``) part by part."""
    recompute_parts: LayerParts = LayerParts()
    """Forward work run again in the backward, part by part (selective: MLA up-projections and half the
    element-wise kernels; full: the whole forward)."""

    @property
    def recompute(self):
        """Forward work run again in the backward (``recompute_parts`` summed)."""
        return self.recompute_parts.total

    @property
    def parts(self) -> LayerParts:
        """``compute`` part by part."""
        return self.trained_parts + self.recompute_parts

    @property
    def compute(self):
        """Forward, backward and recompute together."""
        return self.fwd + self.bwd + self.recompute


@dataclass(frozen=True)
class _Tokens:
    """Tokens of one micro-batch on one device."""

    att: np.ndarray
    """Rows of the attention and dense GEMMs (their columns are split over tp)."""
    split: np.ndarray
    """Rows of width-hidden tensors (norms, residuals): ``att/tp`` with sequence parallelism."""
    tp: np.ndarray


@dataclass(frozen=True)
class _AttentionTimes:
    proj: np.ndarray
    core: np.ndarray
    core_bwd: np.ndarray
    mla_up: object
    """MLA's up-projections (what selective recompute runs again), 0 for GQA."""
    elementwise_bytes: np.ndarray
    """Bytes the norms, residual adds and rotary embedding read and write."""


@dataclass(frozen=True)
class _FeedForward:
    time: np.ndarray
    """Forward time of the block's GEMMs (router, experts, shared experts, or the dense MLP)."""
    elementwise_bytes: tuple
    """Bytes of the block's element-wise kernels, term by term (added in this order to attention's)."""
    num_kernels: int
    """Non-GEMM kernels the block adds to a layer pass (router top-k, permutes)."""
    num_tp_collectives: float
    router_tp_comm: object = 0.0
    """Forward collectives of the routers' balance losses over the tensor-parallel group (this project's
    runtime: ``Workload.project_tensor_parallel``)."""
    one_a2a: object = 0.0
    """Dispatch or combine, forward, with the expert-tensor-parallel gathers."""
    count_exchange: object = 0.0
    """The forward's gather of the per-expert token counts before its dispatch (``Workload.expert_count_exchange``)."""
    shared_time: object = 0.0
    router: object = 0.0
    experts: object = 0.0
    dense_ffn: object = 0.0


def recompute_code(level: str, share: float = 1.0) -> float:
    """The recompute code (module docstring) of ``level`` applied to ``share`` of the layers: ``selective``
    on a share is the code ``share`` (the selective set there, nothing elsewhere: Pangu's Selective R/S);
    ``full`` on a share is ``1 + share`` (whole layers there, the selective set on the others: Megatron's
    --recompute-num-layers as the published rows run it); ``none`` is 0 whatever the share."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"recompute share {share} is not in (0, 1]")
    return {"none": 0.0, "selective": share, "full": 1.0 + share}[level]


def full_recompute_share(recompute) -> np.ndarray:
    """Share of the layers recomputed whole: 1 for code 2 (full), code − 1 between selective and full."""
    return np.clip(np.asarray(recompute, dtype=float) - 1.0, 0.0, 1.0)


def selective_recompute_share(recompute) -> np.ndarray:
    """Share of the layers that recompute the selective set (norms, MLA up-projections, activation, permute
    and router: ``costs.activations.SELECTIVE_OPTIONS``): 0 for code 0, 1 from code 1 on (a layer recomputed
    whole recomputes that set too); a code between 0 and 1 recomputes it on that share of the layers only, as
    a stack that recomputes just what device memory needs does (Pangu's Selective R/S,
    ``../shared/research/pangu-system.md`` §8)."""
    return np.clip(np.asarray(recompute, dtype=float), 0.0, 1.0)


def attention_time_share(seq_len: int, window: int, window_layer_share: float) -> float:
    """Mean causal attention work per layer relative to full causal attention, when ``window_layer_share``
    of the layers attend to the last ``window`` tokens only (sliding window: query i sees min(i, W) keys,
    a mean of W − W(W−1)/(2s) over s positions, against (s+1)/2 for full causal attention; fused kernels
    skip the blocks outside the window)."""
    if window <= 0 or window >= seq_len or window_layer_share <= 0:
        return 1.0
    windowed = window - window * (window - 1) / (2.0 * seq_len)
    full = (seq_len + 1) / 2.0
    return 1.0 - window_layer_share + window_layer_share * windowed / full


def paired_share(pp, vpp, chunks, bidirectional: bool = False) -> np.ndarray:
    """Share of a rank's forward units that the paired schedule fuses with a backward and whose all-to-all
    it therefore hides, averaged over the pipeline ranks. The others are the warm-up forwards of
    ``moetrain.schedules.overlapped`` (those of (interleaved) 1F1B plus one), which only the
    shared expert can hide: (vpp − 1)·pp + 1 on every rank, plus the fill's (``FILL_WARMUP_EXPOSED``). With
    interleaving and few micro-batches most of a rank's forward units are warm-up. ``bidirectional``:
    DualPipe's schedule instead, which pairs after about pp − 1 units (``Workload.bidirectional_pairing``)."""
    pp = np.asarray(pp, dtype=float)
    vpp = np.asarray(vpp, dtype=float)
    chunks = np.asarray(chunks, dtype=float)
    if bidirectional:
        warmup = np.maximum(pp, 2.0) - 1.0
    else:
        mean_fill = np.where(vpp > 1, pp - 1.0, (pp - 1.0) / 2.0)
        warmup = FILL_WARMUP_EXPOSED * mean_fill + (vpp - 1.0) * pp + 1.0
    return np.clip((chunks - np.minimum(warmup, chunks)) / chunks, 0.0, 1.0)


def unpaired_a2a_hidden(total_a2a, shared_time, split_weight_grad: bool):
    """All-to-all time of one layer pass (forward, backward, recompute) hidden when the pass is not paired
    with another micro-batch's: the shared expert's three passes cover what they can; a stack that splits the
    weight gradients off (``Workload.split_weight_grad``) also schedules the routed experts' weight gradients
    under the backward's exchange, and hides at least ``UNPAIRED_A2A_HIDDEN_WITH_SPLIT_DW`` of it."""
    total_a2a = np.asarray(total_a2a, dtype=float)
    by_shared = np.minimum(total_a2a, 3.0 * np.asarray(shared_time, dtype=float))
    if not split_weight_grad:
        return by_shared
    return np.maximum(by_shared, UNPAIRED_A2A_HIDDEN_WITH_SPLIT_DW * total_a2a)


def exposed_tp(w: Workload, eff: Efficiency, layer: LayerCosts):
    """The layer pass's tensor-parallel collectives (``LayerCosts.tp_comm``) that its compute does not hide;
    ``LayerCosts.tp_async_hidden`` of them run under the weight-gradient GEMMs."""
    if "TP" in w.comm_overlap_stated:
        # Stated TP overlap (Transformer Engine userbuffers, AsyncTP): the collectives run under the
        # layer's GEMMs; only what exceeds the layer's compute shows.
        return np.maximum(layer.tp_comm - layer.compute, 0.0)
    return (1.0 - (eff.tp_overlap if w.overlap_tp_comm else 0.0)) * (layer.tp_comm - layer.tp_async_hidden)


def _tokens(w: Workload, s: Strategies) -> _Tokens:
    tp = s.tp.astype(float)
    att = s.micro_batch * w.seq_len / s.cp.astype(float)
    return _Tokens(att, np.where(s.sp, att / tp, att), tp)


def _attention(w: Workload, s: Strategies, eff: Efficiency, tok: _Tokens) -> _AttentionTimes:
    model, cluster, act = w.model, w.cluster, w.activation_bytes
    attn = model.attention
    is_mla = isinstance(attn, MLAConfig)
    t_att, tp = tok.att, tok.tp
    proj = gemm_time(attention_projection_flops(model) * t_att / tp, 5 if is_mla else 2, cluster, eff, w.precision)
    window_share = attention_time_share(w.seq_len, w.attention_window, w.window_layer_share)
    if w.flash_attention:
        head_dim = (attn.qk_head_dim + attn.v_head_dim) / 2 if is_mla else attn.head_dim
        # packed documents: the rows holding a boundary run the masked kernel too (``documents``)
        masked = core_time_factor(w.seq_len, w.documents, eff.attention_block_slowdown, eff.attention_dense_slowdown)
        core = attention_time(attention_core_flops(model, w.seq_len, causal=True) * t_att / tp, cluster, eff,
                              head_dim) * window_share * masked
        core_bwd = ATTENTION_BACKWARD_OVER_FORWARD * core
    else:
        # Materialised scores (pre-FlashAttention stacks): two batched GEMMs over the full square, and
        # the score tensor written and read ~6 times (QKᵀ out, scale/mask/softmax in/out, dropout, PV in)
        # at 2 bytes, twice that in backward (Korthikanti et al. 2022, §4.1, count the same tensors).
        scores = attn.num_heads / tp * t_att * w.seq_len
        core = (gemm_time(attention_core_flops(model, w.seq_len) * t_att / tp, 2, cluster, eff, "bf16")
                + memory_time(6 * act * scores, cluster, eff)) * window_share
        core_bwd = 2.0 * core
    num_norms = 4 if model.norm_style == "sandwich" else 2
    norm_bytes = (num_norms * 2 + 2 * 3) * model.hidden_size * tok.split * act  # norm read+write, two residual adds
    if w.rotary_embeddings:
        # Read and write the rotary part of q and k (Su et al. 2021); wider than the residual stream
        # when heads·head_dim exceeds the hidden size (GPT-OSS: 64·64 against 2,880).
        rotary_width = (attn.num_heads * attn.qk_rope_head_dim / tp + attn.qk_rope_head_dim if is_mla
                        else (attn.num_heads + attn.num_kv_heads) * attn.head_dim / tp)
        norm_bytes = norm_bytes + 2.0 * rotary_width * t_att * act
    mla_up = 0.0
    if is_mla:
        mla_up = gemm_time(mla_up_projection_flops(model) * t_att / tp, 2, cluster, eff, w.precision)
    return _AttentionTimes(proj, core, core_bwd, mla_up, norm_bytes)


def moe_pass_seconds(w: Workload, eff: Efficiency, overlap=False, paired=0.0) -> float | np.ndarray:
    """The fixed cost of one MoE layer's forward pass: the device idles while the host issues the pass's
    kernels after the dispatch synchronised on the token counts; a dispatch padded to capacity never
    synchronises (``Workload.moe_padded_to_capacity``), so its host runs ahead and the device does not idle.

    Under the overlapped schedule (``Strategies.overlap``) a paired pass does not idle the device either:
    the host issued the other micro-batch's half of the pair before it waits on this one's counts, and the
    device runs that half while the host waits and issues (DualPipe interleaves the two halves' kernels for
    exactly this, DeepSeek-V3 §3.2.1). So only the unpaired share (``paired_share``) pays. Not in a stack
    whose count read waits for the other half's kernels too (``Workload.paired_count_sync_hidden``: this
    project's runtime), nor where the host is the device (a CPU): there the cost is the host's own work,
    which no pairing hides. ``overlap``, ``paired``: the layouts' ``Strategies.overlap`` and ``paired_share``
    (by default: not paired, the whole cost)."""
    full = 0.0 if w.moe_padded_to_capacity else eff.moe_overhead_us * 1e-6
    hides = w.paired_count_sync_hidden and not w.cluster.host_is_device
    if not hides or not np.any(overlap):
        return full
    return full * np.where(overlap, 1.0 - np.asarray(paired, dtype=float), 1.0)


def _moe_block(w: Workload, s: Strategies, eff: Efficiency, tok: _Tokens, moe_pass) -> _FeedForward:
    """Router, routed experts (on the hottest rank: ``imbalance`` × the mean load), shared experts and the
    all-to-all of one direction. MoE layers see ``t/tp`` tokens per device (Megatron requires sequence
    parallelism with MoE and TP)."""
    model, cluster, act = w.model, w.cluster, w.activation_bytes
    moe = model.moe
    assert moe is not None
    h, k = model.hidden_size, moe.router.top_k
    t_moe = tok.att / tok.tp
    routed_mean = t_moe * k
    router = gemm_time(2.0 * h * moe.num_experts * t_moe, 1, cluster, eff)
    # router scores and top-k in fp32; permuting the routed tokens and their gating weights
    elementwise = (t_moe * moe.num_experts * 4.0 * 3, 4.0 * routed_mean * h * act)
    # Under expert tensor parallelism a device holds 1/etp of each of its experts' width and computes it for
    # the tokens its etp group gathered (below): etp times its own routed tokens, the same work as etp 1.
    experts = expert_compute_time(routed_mean * s.etp * w.imbalance, model, cluster, eff,
                                  ExpertShard(num_local_experts=moe.num_experts / s.ep, etp=s.etp), w.precision)
    shared = 0.0
    if moe.num_shared_experts:
        shared = gemm_time(2.0 * mlp_params(model, moe.shared_ffn_hidden) * t_moe, mlp_matrix_count(model), cluster,
                           eff, w.precision)
    send = alltoall_volume(t_moe, h, k, act) * w.imbalance
    ep_group = RankGroup(s.ep, cluster.fabric_devices, stride=s.etp)
    one_a2a = alltoall_time(send, ep_group, cluster, hierarchical=s.a2a == 1, top_k=k, efficiency=eff)
    counts = 0.0
    if w.expert_count_exchange:
        # every EP rank's int64 count per expert, gathered before the forward's dispatch
        counts = np.where(s.ep > 1, allgather_time(s.ep * moe.num_experts * 8.0, s.ep, ep_group.in_node, cluster, eff),
                          0.0)
    # Expert tensor parallelism gathers the routed tokens inside the etp group before the experts and
    # scatters them after.
    etp_in_node = ranks_per_node(s.etp, 1, cluster.fabric_devices)
    one_a2a = one_a2a + 2.0 * allgather_time(routed_mean * h * act * s.etp, s.etp, etp_in_node, cluster, eff)
    router_tp = 0.0
    if w.project_tensor_parallel:
        # the balance losses see the whole group's tokens: the fp32 logits and scores all-gathered, the
        # per-expert counts (int64) all-reduced
        tp_in_node = ranks_per_node(s.tp, 1, cluster.fabric_devices)
        router_tp = (2.0 * allgather_time(tok.att * moe.num_experts * 4.0, s.tp, tp_in_node, cluster, eff)
                     + allreduce_time(moe.num_experts * 8.0, s.tp, tp_in_node, cluster, eff))
    return _FeedForward(
        time=router + experts + shared + moe_pass, elementwise_bytes=elementwise, num_kernels=12,
        # attention's gather and scatter, and the shared expert's when there is one and it is split over tp
        # (the routed experts exchange their tokens through the all-to-all instead)
        num_tp_collectives=2.0 + (2.0 if moe.num_shared_experts and not w.project_tensor_parallel else 0.0),
        router_tp_comm=router_tp, one_a2a=one_a2a, count_exchange=counts, shared_time=shared, router=router,
        experts=experts)


def _dense_block(w: Workload, eff: Efficiency, tok: _Tokens) -> _FeedForward:
    model = w.model
    width = model.dense_ffn_hidden
    ffn = gemm_time(2.0 * mlp_params(model, width) * tok.att / tok.tp, mlp_matrix_count(model), w.cluster, eff,
                    w.precision)
    elementwise = ((3 if model.gated_ffn else 2) * width * tok.att / tok.tp * w.activation_bytes,)
    return _FeedForward(time=ffn, elementwise_bytes=elementwise, num_kernels=0, num_tp_collectives=4.0,
                        dense_ffn=ffn)


@dataclass(frozen=True)
class _Fp8Casts:
    forward: object
    """Quantising the layer's linear inputs, forward (a recompute does it again)."""
    backward: object
    """Quantising the gradients of the layer's linear outputs."""


def _fp8_casts(w: Workload, s: Strategies, eff: Efficiency, tok: _Tokens, is_moe: bool) -> _Fp8Casts:
    """What an FP8 layer pass spends quantising its GEMM operands (``FP8_CAST_BYTES_PER_ELEMENT``): memory-bound,
    so it does not shrink with the FP8 peak, and against a narrow GEMM (fine-grained experts, whose inputs
    are as wide as their FLOPs are few) it is a large share. Weights are quantised once per step (Transformer
    Engine keeps them across micro-batches) and not counted; the output head runs in BF16. Nothing without
    an FP8 peak or an FP8 precision."""
    model = w.model
    if w.precision != "fp8" or not w.cluster.peak_tflops_fp8:
        return _Fp8Casts(0.0, 0.0)
    h = model.hidden_size
    inner_tokens = tok.att / tok.tp
    attn = attention_linear_widths(model)
    fwd = tok.split * h + inner_tokens * attn.inner_inputs
    bwd = tok.split * h + inner_tokens * attn.inner_outputs
    if is_moe:
        # MoE layers see t/tp tokens per device (``_moe_block``); the routed ones on the hottest rank, each
        # expert 1/etp wide for etp times the tokens
        moe = model.moe
        routed = inner_tokens * moe.router.top_k * s.etp * w.imbalance
        expert = mlp_linear_widths(model, moe.expert_ffn_hidden / s.etp)
        fwd = fwd + routed * (h + expert.inner_inputs)
        bwd = bwd + routed * (h + expert.inner_outputs)
        if moe.num_shared_experts:
            shared = mlp_linear_widths(model, moe.shared_ffn_hidden)
            fwd = fwd + inner_tokens * (h + shared.inner_inputs)
            bwd = bwd + inner_tokens * (h + shared.inner_outputs)
    else:
        dense = mlp_linear_widths(model, model.dense_ffn_hidden)
        fwd = fwd + tok.split * h + inner_tokens * dense.inner_inputs
        bwd = bwd + tok.split * h + inner_tokens * dense.inner_outputs
    return _Fp8Casts(memory_time(FP8_CAST_BYTES_PER_ELEMENT * fwd, w.cluster, eff),
                     memory_time(FP8_CAST_BYTES_PER_ELEMENT * bwd, w.cluster, eff))


def _cp_exposed(w: Workload, s: Strategies, eff: Efficiency, tok: _Tokens, attn: _AttentionTimes):
    """Context parallelism: ring exchange of K and V (and their gradients) under the attention kernels;
    MLA's latent gathered up front when the stack does so (nothing hides it)."""
    model, cluster, act = w.model, w.cluster, w.activation_bytes
    a = model.attention
    is_mla = isinstance(a, MLAConfig)
    cp = s.cp.astype(float)
    cross_node = s.tp * s.cp > cluster.fabric_devices
    kv_dim = a.num_heads * (a.qk_head_dim + a.v_head_dim) if is_mla else 2 * a.num_kv_heads * a.head_dim
    cp_comm = p2p_time((cp - 1) * tok.att * kv_dim / tok.tp * act, cross_node, cluster, eff)
    exposed = np.maximum(cp_comm - attn.core, 0) + np.maximum(2 * cp_comm - attn.core_bwd, 0)
    if is_mla and w.cp_gathers_mla_latent:
        # The latent is the same on every TP rank (no /tp); it is gathered before the attention that
        # needs it and its gradient reduce-scattered after, so nothing hides it: forward + backward.
        latent_bytes = (cp - 1) * tok.att * (a.kv_lora_rank + a.qk_rope_head_dim) * act
        exposed = 2.0 * p2p_time(latent_bytes, cross_node, cluster, eff)
    return np.where(s.cp > 1, exposed, 0.0)


def layer_costs(w: Workload, s: Strategies, eff: Efficiency, moe_layer: bool, num_micro) -> LayerCosts:
    """A dense (``moe_layer`` False, or a model without experts) or MoE layer pass; ``num_micro``:
    micro-batches per pipeline, which set how much of the all-to-all the paired schedule hides."""
    model, cluster = w.model, w.cluster
    tok = _tokens(w, s)
    attn = _attention(w, s, eff, tok)
    is_moe = moe_layer and model.moe is not None
    # the share of a rank's passes the paired schedule fuses with another micro-batch's: it sets how much of
    # the pass's fixed cost and of its all-to-all (below) the schedule hides
    paired = paired_share(s.pp, s.vpp, num_micro * s.vpp, w.bidirectional_pairing)
    moe_pass = moe_pass_seconds(w, eff, s.overlap, paired) if is_moe else 0.0
    ffn = _moe_block(w, s, eff, tok, moe_pass) if is_moe else _dense_block(w, eff, tok)
    # Non-GEMM kernels per layer pass (norms, residual adds, rope, activation, softmax; router top-k and
    # permutes in MoE layers): each pays the launch cost too, which dominates small models.
    num_norms = 4 if model.norm_style == "sandwich" else 2
    kernels = num_norms + 8 + ffn.num_kernels
    elementwise_bytes = attn.elementwise_bytes
    for term in ffn.elementwise_bytes:
        elementwise_bytes = elementwise_bytes + term
    elem = memory_time(elementwise_bytes, cluster, eff) + kernels * eff.gemm_overhead_us * 1e-6
    casts = _fp8_casts(w, s, eff, tok, is_moe)
    fwd = attn.proj + attn.core + ffn.time + elem + casts.forward
    # Backward: input and weight gradients (2× the GEMMs), attention as above, element-wise twice.
    bwd = 2.0 * (attn.proj + ffn.time + elem) + attn.core_bwd + casts.backward
    full_share = full_recompute_share(s.recompute)
    # Selective recompute runs again what its memory set frees (``costs.activations.SELECTIVE_OPTIONS``:
    # norms, MLA up-projections, activation, permute, router): not the core attention, whose kept tensors
    # it leaves in place. Norms, activation, permute and router are about half the element-wise bytes.
    selective_share = (1.0 - full_share) * selective_recompute_share(s.recompute)
    # forward and backward (twice the forward, the core attention its own ratio), part by part
    trained = LayerParts(
        attention_projections=3.0 * attn.proj, attention_core=attn.core + attn.core_bwd, router=3.0 * ffn.router,
        experts=3.0 * ffn.experts, shared_experts=3.0 * ffn.shared_time, dense_ffn=3.0 * ffn.dense_ffn,
        elementwise=3.0 * elem, moe_fixed=3.0 * moe_pass, fp8_casts=casts.forward + casts.backward)
    # what recompute runs again: the whole forward on the fully recomputed share, the selective set elsewhere
    recomputed = LayerParts(
        attention_projections=full_share * attn.proj + selective_share * attn.mla_up,
        attention_core=full_share * attn.core, router=full_share * ffn.router, experts=full_share * ffn.experts,
        shared_experts=full_share * ffn.shared_time, dense_ffn=full_share * ffn.dense_ffn,
        elementwise=(full_share + 0.5 * selective_share) * elem, moe_fixed=full_share * moe_pass,
        fp8_casts=full_share * casts.forward)
    # Tensor-parallel collectives: per layer forward, an all-gather and a reduce-scatter (or one
    # all-reduce) around attention and around the FFN, each of the full t_att × h activation.
    tp_in_node = ranks_per_node(s.tp, 1, cluster.fabric_devices)
    one_tp = allgather_time(tok.att * model.hidden_size * w.activation_bytes, s.tp, tp_in_node, cluster, eff)
    if w.reduce_scatter_by_all_reduce:
        # sequence parallel: of each all-gather + reduce-scatter pair, the reduce-scatter runs as an
        # all-reduce (two ring passes): 3 passes for the pair instead of 2
        one_tp = one_tp * np.where(s.sp, 1.5, 1.0)
    parts = dict(attention=attn.proj + attn.core, router=ffn.router, experts=ffn.experts,
                 shared_experts=np.broadcast_to(ffn.shared_time, tok.att.shape) if is_moe else 0.0,
                 dense_ffn=ffn.dense_ffn, elementwise=elem, attention_core=attn.core,
                 moe_pass=moe_pass, fp8_casts=casts.forward + casts.backward)
    tp_comm = ffn.num_tp_collectives * one_tp * (2.0 + full_share) + ffn.router_tp_comm * (1.0 + full_share)
    # Of the backward's collectives, half are the column-parallel layers' input gradients (q/k/v and the
    # first FFN matrix), which Megatron's asynchronous TP all-reduce and Transformer Engine's Linear start
    # before those layers' weight-gradient GEMMs and wait for after: hidden up to the GEMMs' time (the
    # backward's weight gradients cost the forward GEMMs once more; the column-parallel ones about half).
    column_wgrad = 0.5 * (attn.proj + ffn.dense_ffn + ffn.shared_time)
    async_hidden = (np.minimum(0.5 * ffn.num_tp_collectives * one_tp, column_wgrad)
                    if w.async_tp_input_grad else 0.0)
    costs = LayerCosts(fwd, bwd, tp_comm, async_hidden, _cp_exposed(w, s, eff, tok, attn), **parts,
                       trained_parts=trained, recompute_parts=recomputed)
    if not is_moe:
        return costs
    # dispatch + combine in the forward, and again in the backward and in a full recompute; the counts'
    # gather before each forward dispatch (the recompute's too)
    total_a2a = 2.0 * ffn.one_a2a * (2.0 + full_share) + ffn.count_exchange * (1.0 + full_share)
    # Overlapped F&B pairing (SPEC §2): in the steady state each all-to-all runs under the other
    # micro-batch's compute; in warm-up/cool-down the shared expert (and split-off weight gradients) hide
    # part of it.
    # A paired step's all-to-all runs on its own stream for as long as the compute stream is busy with the
    # layer it is paired with: the passes, and the TP and CP traffic the compute stream waits on. Only that
    # layer's: the dispatch must land before the experts run and the combine before the next layer, so
    # the excess of an exchange that outlasts the layer stalls the pair (the timeline's paired step, which
    # the screen stands in for, caps its hidden all-to-all at the same per-layer window).
    window = costs.compute + exposed_tp(w, eff, costs) + costs.cp_exposed
    hidden_paired = np.minimum(total_a2a, window)
    hidden_alone = unpaired_a2a_hidden(total_a2a, ffn.shared_time, w.split_weight_grad)
    hidden = np.where(s.overlap, paired * hidden_paired + (1 - paired) * hidden_alone, 0.0)
    return replace(costs, a2a=total_a2a, a2a_exposed=total_a2a - hidden, a2a_alone_hidden=hidden_alone,
                   a2a_paired_hidden=hidden_paired)
