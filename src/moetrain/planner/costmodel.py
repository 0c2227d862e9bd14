"""The vectorised analytic cost model: step time, its breakdown and memory for N strategies at once.

Every quantity is a numpy array over candidates. The model prices one micro-batch on the most loaded
pipeline stage (forward, backward, recompute, exposed communication), then the step as

    step = m·t_max + (p − 1)·t_mean / v  +  exposed data-parallel traffic + optimizer + overhead

(Narayanan et al. SC21 §2.2: the 1F1B bubble is (p−1) stage times, the interleaved one (p−1)/v),
where m is the number of micro-batches per pipeline. The event-driven timeline
(``moetrain.planner.timeline``) replays the same per-stage costs action by action for the top
candidates and for ``moetrain simulate``; for uniform stages the two agree exactly.

Conventions: FLOPs from ``moetrain.costs.flops`` (2·m·k·n per matmul, backward 2× forward); the
attention *time* uses the causal half (fused kernels skip masked blocks) while MFU counts the full
square, as published MFU figures do. Memory follows Megatron's mixed-precision accounting: bf16
weights (2 B), fp32 gradient accumulation (4 B), Adam fp32 master + two moments (12 B) (Rajbhandari
et al. 2020 with K = 12), each divided by the data-parallel size from the ZeRO stage on that shards it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetrain.config.cluster import ClusterConfig
from moetrain.config.model import MLAConfig, ModelConfig
from moetrain.costs.activations import (
    Sharding,
    embedding_activation_bytes,
    layer_activation_bytes,
    mtp_extra_activation_bytes,
)
from moetrain.costs.flops import (
    attention_core_flops,
    attention_projection_flops,
    model_forward_flops,
    training_flops_per_token,
)
from moetrain.costs.params import count_params, mlp_params, moe_block_params, mtp_module_params
from moetrain.planner.calibration import Efficiency
from moetrain.planner.comm import allgather_time, alltoall_time, alltoall_volume, p2p_time, ranks_per_node
from moetrain.planner.compute import (
    attention_time,
    expert_compute_time,
    gemm_time,
    memory_time,
    mlp_matrix_count,
)
from moetrain.planner.strategy import Strategies

BF16 = 2.0
GIB = 2.0**30
# Workspaces that do not scale with the model: CUDA/HCCL context, GEMM workspaces, allocator slack.
STATIC_WORKSPACE_BYTES = 1.0 * GIB
# The caching allocator's fragmentation on top of what tensors hold (a headroom, not a fitted value).
FRAGMENTATION = 0.08
# Adam update traffic per local parameter: read fp32 master, m, v, grad (16 B), write master, m, v
# (12 B) and the bf16 weight (2 B).
OPTIMIZER_BYTES_PER_PARAM = 30.0

# Fused attention backward time over forward time. Five matmuls against two (FlashAttention-2 §3.2)
# would give 2.5; on an H100 with torch 2.11 every fused kernel measured 3.0-3.4 at head dim 128 and
# sequence 4096 (cuDNN 2.97-3.03, FlashAttention-2 3.03, memory-efficient 3.39, and 3.35 for MLA's 192/128
# heads: benchmarks/gpu_attention_probe.py, benchmarks/results/gpu_attention_probe.json).
ATTENTION_BACKWARD_OVER_FORWARD = 3.0

# Share of a layer pass's host issue time that the forward takes (what full recompute issues again).
HOST_FORWARD_SHARE = 0.4


def model_state_bytes(num_params, dp, zero, weight_bytes: float = BF16, grad_bytes: float = BF16,
                      optimizer_bytes: float = 12.0):
    """Per-device bytes of weights, gradients and optimizer states for ``num_params`` replicated over
    ``dp`` ranks with ZeRO ``zero`` (Rajbhandari et al. 2020, §5: (2+2+K)Ψ, then 2Ψ+2Ψ+KΨ/N_d,
    2Ψ+(2+K)Ψ/N_d, (2+2+K)Ψ/N_d for stages 0-3, K = 12 for mixed-precision Adam)."""
    zero = np.asarray(zero)
    dp = np.asarray(dp, dtype=float)
    weights = weight_bytes * num_params / np.where(zero >= 3, dp, 1.0)
    grads = grad_bytes * num_params / np.where(zero >= 2, dp, 1.0)
    optim = optimizer_bytes * num_params / np.where(zero >= 1, dp, 1.0)
    return weights + grads + optim


@dataclass(frozen=True)
class Workload:
    """What is trained, on what, with which batch: everything but the parallel strategy."""

    model: ModelConfig
    cluster: ClusterConfig
    seq_len: int
    global_batch: int
    """Sequences per optimizer step."""
    precision: str = "bf16"
    """GEMM precision: bf16, fp16, fp8 (linear layers only) or fp32 (CPU runs)."""
    imbalance: float = 1.0
    """Routed-token load of the hottest EP rank over the mean (1.0 = perfectly balanced)."""
    flash_attention: bool = True
    grad_bytes: float = 4.0
    """Gradient element size in the reduction (fp32 accumulation; 2 for fp16 runs)."""
    overlap_grad_comm: bool = True
    """The framework overlaps data-parallel gradient/parameter traffic with compute (bucketed reduction
    during backward, parameter prefetch): Megatron-Core, FSDP, DeepSpeed ZeRO-3. False for stacks that
    reduce after the backward (Megatron-LM 2021)."""
    overlap_tp_comm: bool = True
    """The framework can hide tensor-parallel collectives under GEMMs (Transformer Engine userbuffers,
    torch AsyncTP); ``Efficiency.tp_overlap`` says how much it hides. False for stacks whose TP
    all-reduces are synchronous (Megatron-LM 2021, Megatron-DeepSpeed)."""
    comm_overlap_stated: tuple[str, ...] = ()
    """Traffic the run's source says is overlapped with compute ("DP", "TP", "PP"): such traffic uses its
    whole physical overlap window (DP: the passes that produce or consume it; TP: the layer's compute)
    instead of the fitted shares ``grad_overlap`` / ``tp_overlap``, which price stacks that do not say."""
    attention_window: int = 0
    """Sliding-window length in tokens of the windowed attention layers (0: every layer attends to the
    whole causal context)."""
    window_layer_share: float = 0.0
    """Share of the layers whose attention is windowed (GPT-OSS alternates windowed and full layers: 0.5)."""
    rotary_embeddings: bool = True
    """Rotary position embeddings rotate q and k in every layer (the project's models, Llama, DeepSeek,
    GPT-OSS). False for learned absolute positions (GPT-3-style models) or ALiBi (MPT), which add no
    per-layer pass."""
    cp_gathers_mla_latent: bool = True
    """Context parallelism gathers MLA's compressed latent and shared rotary key (kv_lora_rank +
    qk_rope_head_dim per token) before the up-projection, as this project's runtime does
    (``moetrain.distributed.cp``). False for stacks that exchange the up-projected keys and values
    (Megatron-Core's ring CP), which the published rows ran."""
    bidirectional_pairing: bool = False
    """The paired schedule is DualPipe's (DeepSeek-V3 §3.2.1: micro-batches fed from both ends of the
    pipeline), not this project's paired 1F1B: pairing starts after about pp chunk units on every rank and
    never serialises the pipeline. The published DualPipe run is read this way."""
    fp8_stored_activations: bool = False
    """FP8 runs keep the quantised copy of each linear layer's input for the weight gradient, at 1 byte
    instead of 2 (Transformer Engine; DeepSeek-V3 §3.3.2 caches them in FP8). False for torchao's Float8
    linears, which save the high-precision input and quantise it again in the backward."""

    @property
    def activation_bytes(self) -> float:
        """Element size of activations and of what the collectives move (fp32 runs: 4)."""
        return 4.0 if self.precision == "fp32" else BF16


def _ceil_div(a, b):
    return -(-a // b)


def fp8_stored_elements(w: Workload, s: Strategies, moe_layer: bool, level) -> np.ndarray:
    """Elements, per layer and micro-batch on one device, of the linear-layer inputs that the activation
    accounting (``moetrain.costs.activations``) keeps for backward at recompute ``level`` (0/1/2): with
    FP8 linears these are stored quantised. No recompute: the pre-norm outputs (inputs of the QKV and
    FFN projections; MLA's latent-norm outputs), the output projection's input, the second FFN matrix's
    input, the permuted tokens the experts read. Selective recompute rebuilds norms, activation
    functions and permutes, so the output projection's input remains (and MLA's latents, the inputs of
    its recomputed up-projections); full recompute keeps only the layer input."""
    model = w.model
    attn = model.attention
    tp = s.tp.astype(float)
    t = s.micro_batch * w.seq_len / s.cp
    t_split = np.where(s.sp, t / tp, t)
    is_mla = isinstance(attn, MLAConfig)
    o_proj_in = t * attn.num_heads * (attn.v_head_dim if is_mla else attn.head_dim) / tp
    latents = t * (attn.q_lora_rank + attn.kv_lora_rank) if is_mla else 0.0 * t
    none = 2.0 * t_split * model.hidden_size + o_proj_in + latents
    if moe_layer and model.moe is not None:
        moe = model.moe
        routed = t_split * moe.router.top_k * w.imbalance
        none = none + routed * (model.hidden_size + moe.expert_ffn_hidden / s.etp)
        if moe.num_shared_experts:
            none = none + t_split * moe.shared_ffn_hidden / tp
    else:
        none = none + t * model.dense_ffn_hidden / tp
    selective = o_proj_in + latents
    share_full = _full_recompute_share(level)
    level = np.asarray(level, dtype=float)
    return np.where(level < 1, none, (1.0 - share_full) * selective)


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


class _Layer:
    """Per-layer forward/backward times of one micro-batch on one device (arrays over strategies)."""

    def __init__(self) -> None:
        self.fwd = 0.0
        self.bwd = 0.0
        self.recompute = 0.0
        self.tp_comm = 0.0
        self.cp_exposed = 0.0
        self.a2a = 0.0
        self.a2a_exposed = 0.0
        self.a2a_alone_hidden = 0.0
        self.parts: dict[str, np.ndarray] = {}


def _layer_costs(w: Workload, s: Strategies, eff: Efficiency, moe_layer: bool, num_micro) -> _Layer:
    model, cluster = w.model, w.cluster
    h = model.hidden_size
    tp = s.tp.astype(float)
    cp = s.cp.astype(float)
    t_att = s.micro_batch * w.seq_len / cp  # tokens whose GEMM rows this device computes (cols split by tp)
    t_split = np.where(s.sp, t_att / tp, t_att)
    prec = w.precision
    act = w.activation_bytes
    layer = _Layer()
    is_mla = isinstance(model.attention, MLAConfig)

    proj = gemm_time(attention_projection_flops(model) * t_att / tp, 5 if is_mla else 2, cluster, eff, prec)
    if w.flash_attention:
        attn_cfg = model.attention
        head_dim = (attn_cfg.qk_head_dim + attn_cfg.v_head_dim) / 2 if is_mla else attn_cfg.head_dim
        core = attention_time(attention_core_flops(model, w.seq_len, causal=True) * t_att / tp, cluster, eff,
                              head_dim) * attention_time_share(w.seq_len, w.attention_window, w.window_layer_share)
        core_bwd = ATTENTION_BACKWARD_OVER_FORWARD * core
    else:
        # Materialised scores (pre-FlashAttention stacks): two batched GEMMs over the full square, and
        # the score tensor written and read ~6 times (QKᵀ out, scale/mask/softmax in/out, dropout, PV in)
        # at 2 bytes, twice that in backward (Korthikanti et al. 2022, §4.1, count the same tensors).
        scores = model.attention.num_heads / tp * t_att * w.seq_len
        core = (gemm_time(attention_core_flops(model, w.seq_len) * t_att / tp, 2, cluster, eff, "bf16") + (
            memory_time(6 * act * scores, cluster, eff))) * attention_time_share(w.seq_len, w.attention_window,
                                                                                w.window_layer_share)
        core_bwd = 2.0 * core
    num_norms = 4 if model.norm_style == "sandwich" else 2
    norm_bytes = (num_norms * 2 + 2 * 3) * h * t_split * act  # norm read+write, two residual adds
    # Rotary embedding: read and write the rotary part of q and k (Su et al. 2021); wider than the
    # residual stream when heads·head_dim exceeds the hidden size (GPT-OSS: 64·64 against 2,880).
    attn_cfg = model.attention
    rotary_width = (attn_cfg.num_heads * attn_cfg.qk_rope_head_dim / tp + attn_cfg.qk_rope_head_dim if is_mla
                    else (attn_cfg.num_heads + attn_cfg.num_kv_heads) * attn_cfg.head_dim / tp)
    if w.rotary_embeddings:
        norm_bytes = norm_bytes + 2.0 * rotary_width * t_att * act
    parts: dict[str, np.ndarray] = {"attention": proj + core}
    elementwise = norm_bytes
    mla_up = 0.0
    if is_mla:
        attn = model.attention
        up_flops = 2.0 * (attn.q_lora_rank * attn.num_heads * attn.qk_head_dim + attn.kv_lora_rank
                          * attn.num_heads * (attn.qk_nope_head_dim + attn.v_head_dim))
        mla_up = gemm_time(up_flops * t_att / tp, 2, cluster, eff, prec)

    # Tensor-parallel collectives: per layer forward, an all-gather and a reduce-scatter (or one
    # all-reduce) around attention and around the FFN, each of the full t_att × h activation.
    tp_in_node = ranks_per_node(s.tp, 1, cluster.devices_per_node)
    one_tp = allgather_time(t_att * h * act, s.tp, tp_in_node, cluster, eff)
    num_tp_collectives = 4.0
    shared_time = 0.0
    if moe_layer and model.moe is not None:
        moe = model.moe
        k = moe.router.top_k
        t_moe = t_att / tp
        routed_mean = t_moe * k
        router = gemm_time(2.0 * h * moe.num_experts * t_moe, 1, cluster, eff)
        elementwise = elementwise + t_moe * moe.num_experts * 4.0 * 3 + 4.0 * routed_mean * h * act
        experts = expert_compute_time(routed_mean * w.imbalance, model, cluster, eff,
                                      moe.num_experts / s.ep, s.etp, prec)
        if moe.num_shared_experts:
            shared_time = gemm_time(2.0 * mlp_params(model, moe.shared_ffn_hidden) * t_moe,
                                    mlp_matrix_count(model), cluster, eff, prec)
        ffn = router + experts + shared_time + eff.moe_overhead_us * 1e-6
        parts["router"] = router
        parts["experts"] = experts
        parts["shared_experts"] = np.broadcast_to(shared_time, t_att.shape)
        send = alltoall_volume(t_moe, h, k, act) * w.imbalance
        one_a2a = alltoall_time(send, s.ep, cluster.devices_per_node, cluster, s.a2a == 1, k, s.etp, eff)
        etp_in_node = ranks_per_node(s.etp, 1, cluster.devices_per_node)
        one_a2a = one_a2a + 2.0 * allgather_time(routed_mean * h * act * s.etp, s.etp, etp_in_node, cluster, eff)
        layer.a2a = 2.0 * one_a2a  # dispatch + combine, forward; the backward repeats both
        num_tp_collectives = 2.0 + (2.0 if moe.num_shared_experts else 0.0)
    else:
        ffn_width = model.dense_ffn_hidden
        ffn = gemm_time(2.0 * mlp_params(model, ffn_width) * t_att / tp, mlp_matrix_count(model), cluster, eff, prec)
        elementwise = elementwise + (3 if model.gated_ffn else 2) * ffn_width * t_att / tp * act
        parts["dense_ffn"] = ffn
    # Non-GEMM kernels per layer pass (norms, residual adds, rope, activation, softmax; router top-k and
    # permutes in MoE layers): each pays the launch cost too, which dominates small models.
    kernels = num_norms + 8 + (12 if moe_layer and model.moe is not None else 0)
    elem = memory_time(elementwise, cluster, eff) + kernels * eff.gemm_overhead_us * 1e-6
    parts["elementwise"] = elem

    fwd = proj + core + ffn + elem
    # Backward: input and weight gradients (2× the GEMMs), attention as above, element-wise twice.
    bwd = 2.0 * (proj + ffn + elem) + core_bwd
    # Recompute code: 0 none, 1 selective, 2 full; a value between 1 and 2 is selective recompute with
    # that share (code − 1) of the layers recomputed whole (Megatron's --recompute-num-layers).
    full_share = _full_recompute_share(s.recompute)
    recompute = full_share * fwd + (1.0 - full_share) * np.where(s.recompute >= 1, core + mla_up + 0.5 * elem, 0.0)
    layer.tp_comm = num_tp_collectives * one_tp * (2.0 + full_share)
    # Context parallelism: ring exchange of K and V (and their gradients) under the attention kernels.
    attn = model.attention
    kv_dim = attn.num_heads * (attn.qk_head_dim + attn.v_head_dim) if is_mla else 2 * attn.num_kv_heads * attn.head_dim
    cp_bytes = (cp - 1) * t_att * kv_dim / tp * act
    cp_comm = p2p_time(cp_bytes, s.tp * s.cp > cluster.devices_per_node, cluster, eff)
    cp_exposed = np.maximum(cp_comm - core, 0) + np.maximum(2 * cp_comm - core_bwd, 0)
    if is_mla and w.cp_gathers_mla_latent:
        # The latent is the same on every TP rank (no /tp); it is gathered before the attention that
        # needs it and its gradient reduce-scattered after, so nothing hides it: forward + backward.
        latent_bytes = (cp - 1) * t_att * (attn.kv_lora_rank + attn.qk_rope_head_dim) * act
        cp_exposed = 2.0 * p2p_time(latent_bytes, s.tp * s.cp > cluster.devices_per_node, cluster, eff)
    layer.cp_exposed = np.where(s.cp > 1, cp_exposed, 0.0)

    layer.fwd, layer.bwd, layer.recompute = fwd, bwd, recompute
    if moe_layer and model.moe is not None:
        total_a2a = layer.a2a * (2.0 + full_share)
        compute_pair = fwd + bwd + recompute
        # Overlapped F&B pairing (SPEC §2): in the steady state each all-to-all runs under the other
        # micro-batch's compute; in warm-up/cool-down only the shared expert hides the dispatch.
        chunks = num_micro * s.vpp
        paired = paired_share(s.pp, s.vpp, chunks, w.bidirectional_pairing)
        hidden_paired = np.minimum(total_a2a, compute_pair)
        hidden_alone = np.minimum(total_a2a, 3.0 * shared_time)
        hidden = np.where(s.overlap, paired * hidden_paired + (1 - paired) * hidden_alone, 0.0)
        layer.a2a_exposed = total_a2a - hidden
        layer.a2a = total_a2a
        layer.a2a_alone_hidden = hidden_alone
    layer.parts = parts
    return layer


FILL_WARMUP_EXPOSED = 0.7
"""Share of the pipeline-fill warm-up forwards (2·(pp − r − 1) on rank r with interleaving, pp − r − 1
without) whose unpaired all-to-all lengthens the step; the rest runs while later ranks still wait for
their first input. Not a fitted efficiency: it makes the screen agree with the event-driven timeline it
stands in for (timeline/screen step 0.93-1.01, medians 0.999-1.002, over the 300 best paired layouts of
six searches: ``benchmarks/planner_screen_vs_timeline.py``; ``tests/planner/test_search.py`` checks the
agreement on one)."""


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


def _full_recompute_share(recompute) -> np.ndarray:
    """Share of the layers recomputed whole: 1 for code 2 (full), code − 1 between selective and full."""
    return np.clip(np.asarray(recompute, dtype=float) - 1.0, 0.0, 1.0)


def _balanced_stage_time(num_layers: int, pp, layer_time, first_extra, last_extra):
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


def _param_split(model: ModelConfig) -> dict[str, float]:
    counts = count_params(model)
    _, experts_per_layer, _ = moe_block_params(model)
    mtp_total = model.num_mtp_layers * mtp_module_params(model)
    mtp_experts = model.num_mtp_layers * experts_per_layer if model.moe is not None else 0
    return {
        "embedding": float(counts.embedding),
        "head": float(counts.head),
        "body_dense": float(counts.total - counts.embedding - counts.head - counts.experts),
        "body_experts": float(counts.experts),
        "mtp_dense": float(mtp_total - mtp_experts),
        "mtp_experts": float(mtp_experts),
    }


def evaluate(w: Workload, s: Strategies, eff: Efficiency) -> dict[str, np.ndarray]:
    """Step time, breakdown, MFU and memory for every strategy in ``s`` (arrays of len(s))."""
    model, cluster = w.model, w.cluster
    n = len(s)
    pp = s.pp.astype(float)
    vpp = s.vpp.astype(float)
    num_micro = w.global_batch / (s.dp * s.micro_batch)
    h = model.hidden_size
    tp = s.tp.astype(float)
    t_att = s.micro_batch * w.seq_len / s.cp
    t_split = np.where(s.sp, t_att / tp, t_att)

    dense = _layer_costs(w, s, eff, moe_layer=False, num_micro=num_micro) if (
        model.moe is None or model.num_dense_layers) else None
    moe = _layer_costs(w, s, eff, moe_layer=True, num_micro=num_micro) if model.moe is not None else None
    body = moe if moe is not None else dense
    assert body is not None

    tp_hidden_share = eff.tp_overlap if w.overlap_tp_comm else 0.0

    def exposed_tp_of(layer: _Layer):
        if "TP" in w.comm_overlap_stated:
            # Stated TP overlap (Transformer Engine userbuffers, AsyncTP): the collectives run under the
            # layer's GEMMs; only what exceeds the layer's compute shows.
            return np.maximum(layer.tp_comm - (layer.fwd + layer.bwd + layer.recompute), 0.0)
        return (1.0 - tp_hidden_share) * layer.tp_comm

    # Host floor: an eager stack issues every kernel of a layer pass from Python; when the kernels are
    # small the device waits for the host, so a layer pass takes max(device, host). Full recompute issues
    # the forward a second time.
    host_pass = eff.host_layer_us * 1e-6 * (1.0 + HOST_FORWARD_SHARE * _full_recompute_share(s.recompute))

    def device_time(layer: _Layer, with_a2a: bool = True):
        exposed_tp = exposed_tp_of(layer)
        return (layer.fwd + layer.bwd + layer.recompute + exposed_tp + layer.cp_exposed
                + (layer.a2a_exposed if with_a2a else 0.0))

    def layer_time(layer: _Layer, with_a2a: bool = True):
        return np.maximum(device_time(layer, with_a2a), host_pass)

    d_dense = device_time(dense) if dense is not None else 0.0
    d_body = device_time(body)
    t_dense = np.maximum(d_dense, host_pass) if dense is not None else 0.0
    t_body = np.maximum(d_body, host_pass)
    # The same per-layer costs without the all-to-all, for the event-driven timeline, which decides
    # itself what the schedule hides.
    c_dense = layer_time(dense, with_a2a=False) if dense is not None else 0.0
    c_body = layer_time(body, with_a2a=False)

    # Output head and loss (last stage), vocabulary split over tp; MTP adds a layer, a projection and
    # the head again.
    head_gemm = gemm_time(2.0 * h * model.vocab_size * t_att / tp, 1, cluster, eff, w.precision)
    head_elem = memory_time(3 * 4.0 * model.vocab_size * t_att / tp, cluster, eff)
    t_head = 3.0 * head_gemm + 3.0 * head_elem
    t_mtp = model.num_mtp_layers * (t_body + t_head + 3.0 * gemm_time(4.0 * h * h * t_att / tp, 1, cluster, eff))
    t_embed = memory_time(3 * t_split * h * w.activation_bytes, cluster, eff)

    layers_per_stage = model.num_layers / pp
    num_dense = float(model.num_layers - model.num_moe_layers) if model.moe is not None else 0.0
    dense_first = np.minimum(num_dense, layers_per_stage)
    first = dense_first * t_dense + (layers_per_stage - dense_first) * t_body + t_embed
    last = layers_per_stage * t_body + t_head + t_mtp
    middle = layers_per_stage * t_body
    single = np.where(pp == 1, first + t_head + t_mtp, 0.0)
    t_max = np.where(pp == 1, single, np.maximum(np.maximum(first, last), np.where(pp > 2, middle, 0.0)))
    t_mean = np.where(pp == 1, single, (first + last + (pp - 2) * middle) / pp)
    # Layer counts that pp·vpp does not divide need an uneven split, which the user states layer by
    # layer (Megatron-Core pipeline layouts, DeepSeek's DualPipe placement): take the split that evens
    # out the ranks' work at whole-layer granularity, the embedding and the dense layers on the first
    # rank, head and MTP on the last. Even counts keep the uniform split (Megatron's default).
    embed_extra = t_embed + num_dense * (t_dense - t_body)
    head_extra = t_head + t_mtp
    balanced = _balanced_stage_time(model.num_layers, pp, t_body, embed_extra, head_extra)
    uneven = (pp > 1) & (model.num_layers % (s.pp * s.vpp) != 0)
    mean_balanced = (model.num_layers * t_body + embed_extra + head_extra) / pp
    t_max = np.where(uneven, balanced, t_max)
    t_mean = np.where(uneven, mean_balanced, t_mean)
    # Pipeline send/recv of the boundary activation, forward and backward, per chunk boundary. Each TP
    # rank sends its 1/tp slice (Megatron's scatter/gather of pipeline tensors; sequence parallelism
    # splits it anyway) over its own link, and the next stage re-gathers it inside the TP group.
    pp_stride = s.tp * s.cp * s.dp
    boundary = t_att / tp * h * w.activation_bytes
    p2p = 2.0 * vpp * p2p_time(boundary, pp_stride >= cluster.devices_per_node, cluster, eff)
    p2p = np.where(pp > 1, p2p, 0.0)
    t_max = t_max + p2p
    t_mean = t_mean + p2p
    compute_steady = num_micro * t_max
    moe_first = layers_per_stage - dense_first if model.moe is not None else 0.0
    moe_other = layers_per_stage if model.moe is not None else 0.0
    # Balanced uneven splits: every rank carries the balanced stage time (the timeline sees uniform stages).
    c_balanced = balanced * (model.num_layers * c_body + embed_extra + head_extra) / (pp * np.maximum(
        mean_balanced, 1e-30)) + p2p
    timeline_inputs = {
        "first_compute_s": np.where(pp == 1, dense_first * c_dense + (layers_per_stage - dense_first) * c_body
                                    + t_embed + t_head + t_mtp, dense_first * c_dense
                                    + (layers_per_stage - dense_first) * c_body + t_embed) + p2p,
        "middle_compute_s": layers_per_stage * c_body + p2p,
        "last_compute_s": layers_per_stage * c_body + t_head + t_mtp + p2p,
    }
    for key in ("first_compute_s", "middle_compute_s", "last_compute_s"):
        timeline_inputs[key] = np.where(uneven, c_balanced, timeline_inputs[key])
    timeline_inputs |= {
        "first_a2a_s": moe_first * body.a2a,
        "other_a2a_s": moe_other * body.a2a,
        "first_a2a_alone_hidden_s": moe_first * body.a2a_alone_hidden,
        "other_a2a_alone_hidden_s": moe_other * body.a2a_alone_hidden,
        "forward_fraction": body.fwd / (body.fwd + body.bwd + body.recompute),
    }
    bubble = (pp - 1) * t_mean / vpp
    # The paired schedule without interleaving serialises the pipeline: a fused step receives both inputs
    # before it starts and its forward output leaves close to its end (the halves take turns), so step k
    # of rank r waits for step k of rank r+1 (its backward's gradient), which waits for step k−1 of rank r
    # (its forward's input). The steady period becomes the slowest pair
    # of neighbouring ranks' step times instead of the slowest rank's, and every step past the first two
    # waits for the difference (the timeline replays it; ``tests/planner/test_search.py`` checks the two
    # agree). Interleaving breaks the cycle through the other chunks: with vpp > 1 pairing costs no idle.
    neighbours = np.where(pp == 2, first + last, np.maximum(np.maximum(first, last) + middle,
                                                            np.where(pp > 3, 2.0 * middle, 0.0))) + 2.0 * p2p
    neighbours = np.where(uneven, 2.0 * t_max, neighbours)
    serialised = (s.overlap & (s.vpp == 1) & (s.pp > 1) & (not w.bidirectional_pairing)).astype(float)
    bubble = bubble + serialised * np.maximum(num_micro - 2.0, 0.0) * (neighbours - t_max)
    pipeline = compute_steady + bubble

    # Parameters held per device on the most loaded stage (embedding on the first, head+MTP on the last).
    split = _param_split(model)
    last_extra = split["head"] + split["mtp_dense"]
    dense_local = np.where(
        pp == 1,
        split["body_dense"] + split["embedding"] + last_extra,
        split["body_dense"] / pp + np.maximum(split["embedding"], last_extra),
    ) / tp
    expert_local = (split["body_experts"] / pp + split["mtp_experts"]) / (s.ep * s.etp)
    edp = (s.tp * s.cp * s.dp) // (s.ep * s.etp)
    dp_dense = s.dp * s.cp
    dense_in_node = ranks_per_node(dp_dense, s.tp, cluster.devices_per_node)
    exp_in_node = ranks_per_node(edp, s.ep * s.etp, cluster.devices_per_node)

    def shard_traffic(params, group, in_node):
        grad_rs = allgather_time(params * w.grad_bytes, group, in_node, cluster, eff)
        param_ag = allgather_time(params * BF16, group, in_node, cluster, eff)
        return grad_rs, param_ag

    g_d, a_d = shard_traffic(dense_local, dp_dense, dense_in_node)
    g_e, a_e = shard_traffic(expert_local, edp, exp_in_node)
    grad_sync = g_d + g_e
    param_gather = a_d + a_e
    # ZeRO 0: all-reduce (= reduce-scatter + all-gather of the gradient); 1-2: reduce-scatter gradients,
    # all-gather the updated bf16 weights; 3: weights gathered for forward and backward of every
    # micro-batch and gradients reduce-scattered every micro-batch (FSDP with accumulation).
    per_step_comm = np.where(s.zero == 0, 2.0 * grad_sync, grad_sync + param_gather)
    # ZeRO-3 under a pipeline keeps each stage's weights gathered and its gradients unsharded across the
    # micro-batches (FSDP2 with PP: no reshard after forward, gradient sync on the last micro-batch only,
    # as torchtitan composes them), so its traffic is once per step and its memory that of ZeRO-1.
    z3_every_micro = (s.zero >= 3) & (s.pp == 1)
    # What hides it, and under which compute (each collective can only run under the pass that produces
    # or consumes its buckets):
    # - ZeRO 0-2 with bucketed overlap (Megatron-Core overlap_grad_reduce / overlap_param_gather,
    #   DeepSpeed): the gradient reduction runs under the backward of the step's last micro-batch, the
    #   weight all-gather under the forward of the next step's first micro-batch.
    # - ZeRO-3 / FSDP: every micro-batch prefetches the next layer's weights during the forward, and
    #   during the backward gathers them again and reduce-scatters the previous layer's gradients, so
    #   forward gathers hide under the forward, backward gathers + reduce-scatters under the backward
    #   (Zhao et al. 2023, PyTorch FSDP, §3.3-3.4).
    # ``grad_overlap`` is the share of that window the collectives can use (the first and last buckets,
    # and compute slowed by the concurrent traffic, keep it below 1).
    hide = (1.0 if "DP" in w.comm_overlap_stated else eff.grad_overlap) if w.overlap_grad_comm else 0.0
    forward_share = body.fwd / (body.fwd + body.bwd + body.recompute)
    window_fwd = hide * forward_share * t_max
    window_bwd = hide * (1.0 - forward_share) * t_max
    grad_reduce = np.where(s.zero == 0, 2.0 * grad_sync, grad_sync)
    dp_exposed_step = (np.maximum(grad_reduce - window_bwd, 0.0)
                       + np.where(s.zero >= 1, np.maximum(param_gather - window_fwd, 0.0), 0.0))
    per_micro_z3 = grad_sync + 2.0 * param_gather
    dp_exposed_z3 = num_micro * (np.maximum(param_gather - window_fwd, 0.0)
                                 + np.maximum(param_gather + grad_sync - window_bwd, 0.0))
    dp_total = np.where(z3_every_micro, num_micro * per_micro_z3, per_step_comm)
    dp_exposed = np.where(z3_every_micro, dp_exposed_z3, dp_exposed_step)
    dp_exposed = np.where((dp_dense > 1) | (edp > 1), dp_exposed, 0.0)

    opt_shard_dense = np.where(s.zero >= 1, dp_dense, 1)
    opt_shard_exp = np.where(s.zero >= 1, edp, 1)
    optimizer_device = memory_time(OPTIMIZER_BYTES_PER_PARAM * (dense_local / opt_shard_dense
                                                                + expert_local / opt_shard_exp), cluster, eff)
    optimizer = np.maximum(optimizer_device, eff.host_optimizer_ms * 1e-3)
    step = pipeline + dp_exposed + optimizer + eff.step_overhead_ms * 1e-3

    tokens = w.global_batch * w.seq_len
    world = s.tp * s.cp * s.pp * s.dp
    model_flops = training_flops_per_token(model, w.seq_len) * tokens
    mfu = model_flops / (step * world * cluster.peak_flops("bf16"))

    # --- memory per device (most loaded of first and last stage) ---
    z3_dense = np.where(z3_every_micro, dp_dense, 1)
    z3_exp = np.where(z3_every_micro, edp, 1)
    z2_dense = np.where((s.zero >= 2) & ~((s.zero >= 3) & (s.pp > 1)), dp_dense, 1)
    z2_exp = np.where((s.zero >= 2) & ~((s.zero >= 3) & (s.pp > 1)), edp, 1)
    weight_bytes = 4.0 if w.precision == "fp32" else BF16 + (1.0 if w.precision == "fp8" else 0.0)
    weights = weight_bytes * (dense_local / z3_dense + expert_local / z3_exp)
    grads = w.grad_bytes * (dense_local / z2_dense + expert_local / z2_exp)
    optim = 12.0 * (dense_local / opt_shard_dense + expert_local / opt_shard_exp)

    sharding = Sharding(tp=s.tp, sp=s.sp, cp=s.cp, ep=s.ep, etp=s.etp)

    def act(moe_layer: bool, level):
        kept = layer_activation_bytes(model, w.seq_len, s.micro_batch, moe_layer, sharding, w.activation_bytes, level,
                                      w.flash_attention, w.imbalance).total
        if w.fp8_stored_activations and w.precision == "fp8":
            kept = kept - (w.activation_bytes - 1.0) * fp8_stored_elements(w, s, moe_layer, level)
        return kept

    full_share = _full_recompute_share(s.recompute)
    if np.any(np.asarray(s.recompute) % 1):
        # Partial full recompute: the recomputed layers keep their input only, the others what selective keeps.
        def act_at(moe_layer: bool):
            level = np.asarray(s.recompute)
            whole = act(moe_layer, np.floor(level).astype(np.int64))
            mixed = (1.0 - full_share) * act(moe_layer, np.ones_like(level, dtype=np.int64)) + full_share * act(
                moe_layer, np.full_like(level, 2, dtype=np.int64))
            return np.where(level % 1 > 0, mixed, whole)
    else:
        def act_at(moe_layer: bool):
            return act(moe_layer, s.recompute)
    act_body = act_at(model.moe is not None)
    act_dense = act_at(False) if dense is not None else act_body
    act_first_layers = dense_first * act_dense + (layers_per_stage - dense_first) * act_body
    # Micro-batches in flight on the first stage: 1F1B holds min(p, m); the interleaved schedule holds
    # p·v + p − 1 chunks of L/(p·v) layers (Megatron warm-up), i.e. ×(1 + (p−1)/(p·v)) (Korthikanti §4.2.3);
    # the overlapped F&B pairing keeps one more.
    chunks_in_flight = np.where(
        vpp > 1,
        np.minimum(pp * vpp + pp - 1, num_micro * vpp) / vpp,
        np.minimum(pp, num_micro),
    ) + np.where(s.overlap, 1.0 / vpp, 0.0)
    full_working = np.where(full_share > 0, act(model.moe is not None, 0), 0.0)
    act_first = chunks_in_flight * act_first_layers + full_working
    head_act = embedding_activation_bytes(model, w.seq_len, s.micro_batch, sharding, w.activation_bytes)
    # MTP modules (last stage): their decoder layer plus norms, projection, embedding and a second head.
    mtp_act = model.num_mtp_layers * (act_body + mtp_extra_activation_bytes(
        model, w.seq_len, s.micro_batch, sharding, w.activation_bytes))
    act_last = layers_per_stage * act_body + head_act + mtp_act + full_working
    activations = np.where(pp == 1, chunks_in_flight * (num_dense * act_dense + (model.num_layers - num_dense)
                                                          * act_body) + head_act + full_working + mtp_act,
                           np.maximum(act_first, act_last))
    buffers = STATIC_WORKSPACE_BYTES + 2.0 * t_att * h * w.activation_bytes
    if model.moe is not None:
        buffers = buffers + 2.0 * alltoall_volume(t_att / tp, h, model.moe.router.top_k, BF16) * w.imbalance
    largest_layer = (split["body_dense"] / model.num_layers + split["body_experts"] / max(model.num_moe_layers, 1)
                     / (s.ep * s.etp)) / tp
    buffers = buffers + np.where(z3_every_micro, 2.0 * BF16 * largest_layer, 0.0)
    fragmentation = FRAGMENTATION * (activations + buffers)
    memory = weights + grads + optim + activations + buffers + fragmentation

    # Hardware FLOPs (HFU-style sources) add what recomputation runs again: full recompute repeats every
    # layer's forward but not the output head (Narayanan et al. SC21 eq. 3: 96·B·s·l·h²·(1 + s/6h + V/16lh),
    # the logits counted three times, not four); selective recompute repeats the core attention forward
    # (Korthikanti et al. 2022 §5).
    forward_parts = model_forward_flops(model, w.seq_len)
    full_extra = (forward_parts.forward - forward_parts.head) / forward_parts.training
    selective_extra = forward_parts.attention_core / forward_parts.training
    hardware_extra = full_share * full_extra + (1.0 - full_share) * np.where(s.recompute >= 1, selective_extra, 0.0)
    out = {
        "step_time_s": step,
        "tokens_per_s": tokens / step,
        "mfu": mfu,
        "num_micro_batches": num_micro,
        "pipeline_s": pipeline,
        "bubble_s": bubble,
        "stage_time_s": t_max,
        "dp_comm_s": dp_total,
        "dp_exposed_s": dp_exposed,
        "optimizer_s": optimizer,
        "tp_comm_s": num_micro * layers_per_stage * body.tp_comm,
        "tp_exposed_s": num_micro * layers_per_stage * exposed_tp_of(body),
        "a2a_s": num_micro * layers_per_stage * body.a2a,
        "a2a_exposed_s": num_micro * layers_per_stage * body.a2a_exposed,
        "cp_exposed_s": num_micro * layers_per_stage * body.cp_exposed,
        "p2p_s": num_micro * p2p,
        # What the device waits for the host (eager issue of small kernels), summed over the step
        # (first stage; with one stage the MTP modules' blocks too).
        "host_wait_s": num_micro * (
            dense_first * (t_dense - d_dense)
            + (layers_per_stage - dense_first + np.where(pp == 1, model.num_mtp_layers, 0)) * (t_body - d_body))
        + (optimizer - optimizer_device),
        "memory_weights": weights,
        "memory_grads": grads,
        "memory_optimizer": optim,
        "memory_activations": activations,
        "memory_buffers": buffers + fragmentation,
        "memory_bytes": memory,
        "hardware_flops_factor": 1.0 + hardware_extra,
    }
    out.update(timeline_inputs)
    for name, value in body.parts.items():
        out[f"compute_{name}_s"] = np.broadcast_to(num_micro * layers_per_stage * 3.0 * value, (n,))
    out["compute_head_s"] = num_micro * t_head
    return {k: np.broadcast_to(np.asarray(v, dtype=float), (n,)) for k, v in out.items()}
