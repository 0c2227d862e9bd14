"""Memory per device on the most loaded pipeline stage, as arrays over strategies.

Model state follows Megatron's mixed-precision accounting: bf16 weights (2 B), fp32 gradient
accumulation (4 B), Adam fp32 master + two moments (12 B) (Rajbhandari et al. 2020 with K = 12), each
divided by the data-parallel size from the ZeRO stage on that shards it. Activations come from the
per-tensor accounting of ``moetrain.costs.activations``, times the micro-batches the schedule keeps in
flight; buffers and allocator fragmentation come on top.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetrain.config.model import MLAConfig, ModelConfig
from moetrain.costs.activations import (
    ActivationShape,
    Sharding,
    embedding_activation_bytes,
    layer_activation_bytes,
    mtp_extra_activation_bytes,
)
from moetrain.costs.params import count_params, moe_block_params, mtp_module_params
from moetrain.planner.comm import alltoall_volume, ranks_per_node
from moetrain.planner.layer_costs import full_recompute_share, selective_recompute_share
from moetrain.planner.strategy import Columns, Strategies
from moetrain.planner.workload import BF16, Workload

GIB = 2.0**30
# Workspaces that do not scale with the model: CUDA/HCCL context, GEMM workspaces, allocator slack.
STATIC_WORKSPACE_BYTES = 1.0 * GIB
# The caching allocator's fragmentation on top of what tensors hold (a headroom, not a fitted value).
FRAGMENTATION = 0.08
ADAM_BYTES_PER_PARAM = 12.0
"""fp32 master weight and Adam's two moments."""


@dataclass(frozen=True)
class MemoryBytes(Columns):
    """Peak bytes per device on the most loaded of the first and last pipeline stage."""

    weights: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray
    buffers: np.ndarray
    """Communication buffers and workspaces, plus the allocator's fragmentation of them and of the
    activations."""
    total: np.ndarray


@dataclass(frozen=True)
class ParamSplit:
    """The model's parameters by where the pipeline puts them."""

    embedding: float
    head: float
    body_dense: float
    """Decoder layers without their routed experts (attention, norms, dense FFNs, routers, shared experts)."""
    body_experts: float
    mtp_dense: float
    mtp_experts: float

    @classmethod
    def of(cls, model: ModelConfig) -> ParamSplit:
        counts = count_params(model)
        _, experts_per_layer, _ = moe_block_params(model)
        mtp_total = model.num_mtp_layers * mtp_module_params(model)
        mtp_experts = model.num_mtp_layers * experts_per_layer if model.moe is not None else 0
        return cls(embedding=float(counts.embedding), head=float(counts.head),
                   body_dense=float(counts.total - counts.embedding - counts.head - counts.experts),
                   body_experts=float(counts.experts), mtp_dense=float(mtp_total - mtp_experts),
                   mtp_experts=float(mtp_experts))


@dataclass(frozen=True)
class LocalParams:
    """Parameters one device holds on the most loaded stage (the embedding on the first, head and MTP
    on the last), and the data-parallel groups that replicate them."""

    dense: np.ndarray
    """Split over tp."""
    experts: np.ndarray
    """Split over ep·etp."""
    dense_dp: np.ndarray
    """Ranks holding the same dense shard: dp·cp."""
    expert_dp: np.ndarray
    """Ranks holding the same expert shard: tp·cp·dp/(ep·etp)."""
    split: ParamSplit

    @classmethod
    def of(cls, w: Workload, s: Strategies) -> LocalParams:
        split = ParamSplit.of(w.model)
        pp, tp = s.pp.astype(float), s.tp.astype(float)
        last_extra = split.head + split.mtp_dense
        dense = np.where(pp == 1, split.body_dense + split.embedding + last_extra,
                         split.body_dense / pp + np.maximum(split.embedding, last_extra)) / tp
        experts = (split.body_experts / pp + split.mtp_experts) / (s.ep * s.etp)
        return cls(dense, experts, s.dp * s.cp, (s.tp * s.cp * s.dp) // (s.ep * s.etp), split)


def zero3_every_micro_batch(s: Strategies) -> np.ndarray:
    """ZeRO-3 re-gathers weights for every micro-batch only without a pipeline: under one it keeps each
    stage's weights gathered and its gradients unsharded across the micro-batches (FSDP2 with PP: no
    reshard after forward, gradient sync on the last micro-batch only, as torchtitan composes them), so
    its memory is that of ZeRO-1 and its traffic once per step."""
    return (s.zero >= 3) & (s.pp == 1)


def model_state_bytes(num_params, dp, zero, weight_bytes: float = BF16, grad_bytes: float = BF16,
                      optimizer_bytes: float = ADAM_BYTES_PER_PARAM):
    """Per-device bytes of weights, gradients and optimizer states for ``num_params`` replicated over
    ``dp`` ranks with ZeRO ``zero`` (Rajbhandari et al. 2020, §5: (2+2+K)Ψ, then 2Ψ+2Ψ+KΨ/N_d,
    2Ψ+(2+K)Ψ/N_d, (2+2+K)Ψ/N_d for stages 0-3, K = 12 for mixed-precision Adam)."""
    zero = np.asarray(zero)
    dp = np.asarray(dp, dtype=float)
    weights = weight_bytes * num_params / np.where(zero >= 3, dp, 1.0)
    grads = grad_bytes * num_params / np.where(zero >= 2, dp, 1.0)
    optim = optimizer_bytes * num_params / np.where(zero >= 1, dp, 1.0)
    return weights + grads + optim


def _model_state(w: Workload, s: Strategies, params: LocalParams):
    """(weights, grads, optimizer) bytes on one device: each sharded over its data-parallel group from
    the ZeRO stage on that shards it (ZeRO-2/3 under a pipeline keep gradients whole, see
    ``zero3_every_micro_batch``)."""
    z3 = zero3_every_micro_batch(s)
    z2 = (s.zero >= 2) & ~((s.zero >= 3) & (s.pp > 1))
    weight_bytes = 4.0 if w.precision == "fp32" else BF16 + (1.0 if w.precision == "fp8" else 0.0)
    weights = weight_bytes * (params.dense / np.where(z3, params.dense_dp, 1)
                              + params.experts / np.where(z3, params.expert_dp, 1))
    grads = w.grad_bytes * (params.dense / np.where(z2, params.dense_dp, 1)
                            + params.experts / np.where(z2, params.expert_dp, 1))
    optim = ADAM_BYTES_PER_PARAM * (params.dense / np.where(s.zero >= 1, params.dense_dp, 1)
                                    + params.experts / np.where(s.zero >= 1, params.expert_dp, 1))
    return weights, grads, optim


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
        # the rows the ETP group gathered (etp·routed) at 1/etp of the FFN width (moetrain.distributed.etp)
        gathered = t_split * moe.router.top_k * w.imbalance * s.etp
        none = none + gathered * (model.hidden_size + moe.expert_ffn_hidden / s.etp)
        if moe.num_shared_experts:
            none = none + t_split * moe.shared_ffn_hidden / tp
    else:
        none = none + t * model.dense_ffn_hidden / tp
    selective = o_proj_in + latents
    share_full = full_recompute_share(level)
    level = np.asarray(level, dtype=float)
    selective_share = selective_recompute_share(level)
    return np.where(level < 1, (1.0 - selective_share) * none + selective_share * selective,
                    (1.0 - share_full) * selective)


def _sharding(w: Workload, s: Strategies) -> Sharding:
    """The layouts' degrees as the activation formulas read them; the hierarchical all-to-all's first
    hop crosses the nodes of an EP group (its ranks are etp apart, as the traffic model places them)."""
    ep_nodes = s.ep / ranks_per_node(s.ep, s.etp, w.cluster.fabric_devices)
    return Sharding(tp=s.tp, sp=s.sp, cp=s.cp, ep=s.ep, etp=s.etp, hierarchical=s.a2a == 1, ep_nodes=ep_nodes)


def _layer_activations(w: Workload, s: Strategies, moe_layer: bool, recompute):
    """Bytes one layer keeps per micro-batch at recompute code ``recompute`` (per strategy); a code
    between 1 and 2 recomputes that share of the layers whole (they keep their input only), the others
    selectively; a code between 0 and 1 recomputes that share of the layers selectively, the others not."""
    shape = ActivationShape(w.model, w.seq_len, s.micro_batch, w.activation_bytes, w.flash_attention,
                            _sharding(w, s), w.imbalance)

    def at(level):
        kept = layer_activation_bytes(shape, moe_layer, level).total
        if w.fp8_stored_activations and w.precision == "fp8":
            kept = kept - (w.activation_bytes - 1.0) * fp8_stored_elements(w, s, moe_layer, level)
        return kept

    level = np.asarray(recompute)
    if not np.any(level % 1):
        return at(recompute)
    full_share = full_recompute_share(level)
    selective_share = selective_recompute_share(level)
    whole = at(np.floor(level).astype(np.int64))
    selective = at(np.ones_like(level, dtype=np.int64))
    above = (1.0 - full_share) * selective + full_share * at(np.full_like(level, 2, dtype=np.int64))
    below = (1.0 - selective_share) * at(np.zeros_like(level, dtype=np.int64)) + selective_share * selective
    return np.where(level % 1 > 0, np.where(level > 1, above, below), whole)


def in_flight_micro_batches(s: Strategies, num_micro) -> np.ndarray:
    """Micro-batches whose activations the first stage holds at once: 1F1B holds min(p, m); the
    interleaved schedule holds p·v + p − 1 chunks of L/(p·v) layers (Megatron warm-up), i.e.
    ×(1 + (p−1)/(p·v)) (Korthikanti §4.2.3); the overlapped F&B pairing keeps one more chunk."""
    pp, vpp = s.pp.astype(float), s.vpp.astype(float)
    return np.where(vpp > 1, np.minimum(pp * vpp + pp - 1, num_micro * vpp) / vpp,
                    np.minimum(pp, num_micro)) + np.where(s.overlap, 1.0 / vpp, 0.0)


def _activations(w: Workload, s: Strategies, num_micro):
    """Activation bytes of the most loaded of the first stage (its layers, times the micro-batches in
    flight) and the last (one micro-batch's worth of its layers: it runs each backward right after the
    forward, plus the head and MTP modules)."""
    model = w.model
    pp = s.pp.astype(float)
    layers_per_stage = model.num_layers / pp
    num_dense = float(model.num_layers - model.num_moe_layers) if model.moe is not None else 0.0
    dense_first = np.minimum(num_dense, layers_per_stage)
    act_body = _layer_activations(w, s, model.moe is not None, s.recompute)
    has_dense = model.moe is None or model.num_dense_layers
    act_dense = _layer_activations(w, s, False, s.recompute) if has_dense else act_body
    in_flight = in_flight_micro_batches(s, num_micro)
    # Full recompute rebuilds one layer's activations at a time on top of what is kept.
    full_working = np.where(full_recompute_share(s.recompute) > 0,
                            _layer_activations(w, s, model.moe is not None, 0), 0.0)
    act_first = in_flight * (dense_first * act_dense + (layers_per_stage - dense_first) * act_body) + full_working
    sharding = _sharding(w, s)
    head_act = embedding_activation_bytes(model, w.seq_len, s.micro_batch, sharding, w.activation_bytes)
    # MTP modules (last stage): their decoder layer plus norms, projection, embedding and a second head.
    mtp_act = model.num_mtp_layers * (act_body + mtp_extra_activation_bytes(model, w.seq_len, s.micro_batch,
                                                                            sharding, w.activation_bytes))
    act_last = layers_per_stage * act_body + head_act + mtp_act + full_working
    single_stage = (in_flight * (num_dense * act_dense + (model.num_layers - num_dense) * act_body) + head_act
                    + full_working + mtp_act)
    return np.where(pp == 1, single_stage, np.maximum(act_first, act_last))


def _buffers(w: Workload, s: Strategies, params: LocalParams):
    """Workspaces, the micro-batch's communication buffers (TP gathers, all-to-all send and receive;
    with expert tensor parallelism the ETP gather's, which send and receive etp copies of the routed
    rows) and, with ZeRO-3 per micro-batch, the largest layer's gathered weights (double-buffered)."""
    model = w.model
    tp = s.tp.astype(float)
    t_att = s.micro_batch * w.seq_len / s.cp
    buffers = STATIC_WORKSPACE_BYTES + 2.0 * t_att * model.hidden_size * w.activation_bytes
    if model.moe is not None:
        buffers = buffers + 2.0 * alltoall_volume(t_att / tp, model.hidden_size, model.moe.router.top_k,
                                                  BF16) * w.imbalance * s.etp
    largest_layer = (params.split.body_dense / model.num_layers + params.split.body_experts
                     / max(model.num_moe_layers, 1) / (s.ep * s.etp)) / tp
    return buffers + np.where(zero3_every_micro_batch(s), 2.0 * BF16 * largest_layer, 0.0)


def device_memory(w: Workload, s: Strategies, params: LocalParams, num_micro) -> MemoryBytes:
    """Peak bytes per device of every strategy in ``s``; ``num_micro``: micro-batches per pipeline."""
    weights, grads, optim = _model_state(w, s, params)
    activations = _activations(w, s, num_micro)
    buffers = _buffers(w, s, params)
    fragmentation = FRAGMENTATION * (activations + buffers)
    total = weights + grads + optim + activations + buffers + fragmentation
    return MemoryBytes.broadcast(len(s), weights=weights, grads=grads, optimizer=optim, activations=activations,
                                 buffers=buffers + fragmentation, total=total)
