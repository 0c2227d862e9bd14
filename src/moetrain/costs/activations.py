"""Activation bytes one decoder layer keeps for backward, per micro-batch and device, by layer part.

Per-tensor accounting in the spirit of Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models", §4): every tensor that autograd keeps for backward is listed with its
shape, dtype and the part that allocates it, then split by the parallel layout. It follows
``moetrain.models`` operator by operator (which operator saves what: see ``docs/memory.md``) and
is checked against the exact count of ``moetrain.memory.measure`` (tests/memory).

Facts of the implementation the formulas encode:

- RMSNorm computes in fp32: it keeps its input in fp32 (the input itself when the compute dtype is
  fp32, else an fp32 copy), ``rsqrt`` per row and the normalised ``y`` in the compute dtype; a
  pre-norm's output is kept again by the projections that read it, a post-norm's is not (it only
  enters the residual add).
- The router keeps fp32 copies of its input and weight (bf16 runs), scores, top-k ids, gathered
  weights and what the balance and z losses need; the dispatch keeps the sort order, its inverse and
  the permuted tokens; the combine keeps the expert output and the gating weights.
- Core attention: fused kernels (``flash``) keep q, k, v, the output and one fp32 log-sum-exp per
  row; torch's math fallback (used on CPU when the QK and V head dims differ) keeps scaled q and k,
  the fp32 probabilities (S² per head) and a contiguous v, all fp32.

Layout rules (``Sharding``): tokens per device ``t = seq_len·micro_batch/cp``; with sequence
parallelism, tensors of width ``hidden`` (norm inputs and outputs, residuals) are split over ``tp``
too; head and FFN widths are split over ``tp``, expert FFN width over ``etp``; MoE layers see ``t/tp``
tokens per device (Megatron requires SP with MoE and TP) and receive ``top_k·imbalance`` rows per
token on average; what a device keeps for its own ``t·top_k`` assignments (sort order, inverse, the
combine's rows) does not scale with the imbalance. Expert tensor parallelism all-gathers the rows of
its ``etp`` group before the experts (``moetrain.distributed.etp``), so the experts keep their
tensors for ``etp`` times the device's rows at ``1/etp`` of the width: the FFN intermediates are
those of ``etp = 1``, the expert input rows ``etp`` times as many. The hierarchical dispatcher keeps
tensors of its own, per (token, destination node) and per expanded row (``_hierarchical``).

Memory options (``moetrain.memory``): ``norm``, ``mla_up``, ``activation``, ``permute``, ``router``
recompute one layer part each; ``attention`` and ``layer`` recompute a whole block; ``swap_attention``
and ``swap_moe`` move what attention / the MoE block saves to host memory, ``swap_layer`` what the
whole layer saves (reported apart as ``swapped``; a layer recomputed whole keeps its input on the
device). The planner's recompute levels map onto them: ``selective`` = the five fine-grained recompute
options, ``full`` = ``layer``.

A layer is described once, by ``ActivationShape`` (model, tokens, element size, attention kernel,
``Sharding``, routed load); its sizes, degrees and load may be numpy arrays.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

import numpy as np

from moetrain.config.model import MLAConfig, ModelConfig

RECOMPUTE_CODES: dict[str, int] = {"none": 0, "selective": 1, "full": 2}

FP32_BYTES = 4.0
INDEX_BYTES = 8.0
INT32_BYTES = 4.0
BOOL_BYTES = 1.0

RECOMPUTE_OPTIONS: tuple[str, ...] = ("norm", "mla_up", "activation", "permute", "router", "attention", "layer")
SWAP_OPTIONS: tuple[str, ...] = ("swap_attention", "swap_moe", "swap_layer")
ALL_OPTIONS: tuple[str, ...] = RECOMPUTE_OPTIONS + SWAP_OPTIONS
SELECTIVE_OPTIONS: frozenset[str] = frozenset({"norm", "mla_up", "activation", "permute", "router"})

LAYER_PARTS: tuple[str, ...] = (
    "residual", "attn_norm", "attention", "attn_post_norm", "ffn_norm", "router", "dispatch", "experts",
    "shared_expert", "ffn", "ffn_post_norm",
)


def recompute_code(recompute):
    """0/1/2 from a level name or an array of codes."""
    if isinstance(recompute, str):
        if recompute not in RECOMPUTE_CODES:
            raise ValueError(f"recompute={recompute!r}; choose one of {sorted(RECOMPUTE_CODES)}")
        return RECOMPUTE_CODES[recompute]
    return np.asarray(recompute)


def options_of(recompute) -> frozenset[str]:
    """The option set a recompute argument names: a level (none/selective/full), a comma-separated
    list of options, or an iterable of options."""
    if isinstance(recompute, str):
        if recompute in RECOMPUTE_CODES:
            return {"none": frozenset(), "selective": SELECTIVE_OPTIONS, "full": frozenset({"layer"})}[recompute]
        names = [name.strip() for name in recompute.split(",") if name.strip()]
    else:
        names = list(recompute)
    unknown = sorted(set(names) - set(ALL_OPTIONS))
    if unknown:
        raise ValueError(f"unknown memory option(s) {unknown}; choose from {list(ALL_OPTIONS)}")
    return frozenset(names)


@dataclass(frozen=True)
class Sharding:
    """How a layer's tensors are split over devices: the parallel degrees the activation formulas read.

    Each degree may be a numpy array (one entry per layout the planner scores)."""

    tp: object = 1
    """Tensor-parallel size: splits head and FFN widths, and the vocabulary of the head."""
    sp: object = False
    """Sequence parallelism: tensors of width hidden are split over ``tp`` too."""
    cp: object = 1
    """Context-parallel size: splits the sequence."""
    ep: object = 1
    """Expert-parallel size: changes which routed tokens arrive, not how many on average."""
    etp: object = 1
    """Expert tensor-parallel size: splits the expert FFN width."""
    hierarchical: object = False
    """The two-hop dispatcher (``moetrain.distributed.ep.HierarchicalDispatcher``) with ep > 1: other
    tensors than the flat all-to-all's, see ``_hierarchical``."""
    ep_nodes: object = 1
    """Nodes one EP group spans (the hierarchical dispatcher's first hop crosses them)."""

    def tokens(self, seq_len, micro_batch):
        """(t, t_split, tp): tokens per device of one micro-batch, the rows of width-hidden tensors
        (``t/tp`` with sequence parallelism) and tp as floats."""
        tp = np.asarray(self.tp, dtype=float)
        t = np.asarray(seq_len, dtype=float) * np.asarray(micro_batch, dtype=float) / np.asarray(self.cp, dtype=float)
        return t, np.where(np.asarray(self.sp, dtype=bool), t / tp, t), tp


UNSHARDED = Sharding()


@dataclass(frozen=True)
class ActivationShape:
    """What one micro-batch's activations are: the model, the tokens, how they are stored, how the
    layout splits them and how evenly the routed rows reach the devices. Sizes, the degrees of
    ``sharding`` and ``imbalance`` may be numpy arrays (one entry per layout the planner scores)."""

    model: ModelConfig
    seq_len: object
    micro_batch: object
    dtype_bytes: float = 2.0
    """Element size of the activations (fp32 runs: 4)."""
    flash: bool = True
    """Fused attention keeps no S×S probabilities (``moetrain.memory.options.uses_flash_attention``)."""
    sharding: Sharding = UNSHARDED
    imbalance: object = 1.0
    """Routed rows the most loaded device receives over the mean (``t·top_k``). It scales what a device
    keeps for the rows it receives, not what it keeps for its own tokens."""
    nodes_per_token: object = None
    """Hierarchical dispatch: distinct nodes a token's experts sit on, on average; None: the expectation
    under uniform routing, ``N·(1 − (1 − 1/N)^k)`` for N nodes (the traffic model's, ``planner.comm``)."""

    def tokens(self):
        """(t, t_split, tp) of ``Sharding.tokens``."""
        return self.sharding.tokens(self.seq_len, self.micro_batch)

    @property
    def batch_rows(self):
        """Sequences of the micro-batch (rows of the attention's per-row statistics)."""
        return np.asarray(self.micro_batch, dtype=float)

    @property
    def seq_local(self):
        """Sequence positions on this device (``seq_len/cp``)."""
        return np.asarray(self.seq_len, dtype=float) / np.asarray(self.sharding.cp, dtype=float)


@dataclass(frozen=True)
class LayerActivations:
    """Bytes saved for backward by one decoder layer, per micro-batch and device."""

    norms: object = 0.0
    attention_proj: object = 0.0
    core_attention: object = 0.0
    dense_ffn: object = 0.0
    router: object = 0.0
    dispatch: object = 0.0
    experts: object = 0.0
    shared_experts: object = 0.0

    @property
    def total(self):
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Parts:
    """Accumulates bytes per part, on device or swapped to host."""

    def __init__(self, swap_all: bool = False) -> None:
        self.swap_all = swap_all
        """Every byte goes to host (``swap_layer``), whatever the part's own option says."""
        self.device: dict[str, object] = {p: 0.0 for p in LAYER_PARTS}
        self.swapped: dict[str, object] = {p: 0.0 for p in LAYER_PARTS}
        self.core_attention: object = 0.0
        """Of ``device["attention"]``: the core attention's share (the coarse planner view splits it)."""

    def add(self, part: str, nbytes, swap: bool = False) -> None:
        target = self.swapped if swap or self.swap_all else self.device
        target[part] = target[part] + nbytes

    def add_core_attention(self, nbytes, swap: bool) -> None:
        if not (swap or self.swap_all):
            self.core_attention = self.core_attention + nbytes


@dataclass(frozen=True)
class _NormSite:
    """One RMSNorm of a layer: its rows and width, and what else holds its tensors."""

    part: str
    rows: object
    width: object
    pre: bool
    """A pre-norm: its output is kept again by the projections that read it."""
    input_kept_elsewhere: bool
    """The input storage is counted by another part."""
    storage_width: object = None
    """Width of the storage the input is a view of, where it differs from ``width`` (the MLA kv latent
    is a view of latent ⊕ rotary key); None: ``width``."""
    swap: bool = False
    out_swap: bool = False
    """The output is saved inside a swapped region (its consumers are)."""


def _norm(parts: _Parts, site: _NormSite, d, recompute: bool) -> None:
    """One RMSNorm: fp32 input, rsqrt, y, and (pre-norm) the output kept by its consumers."""
    rows, width, swap = site.rows, site.width, site.swap
    storage_width = width if site.storage_width is None else site.storage_width
    if recompute:
        # checkpoint keeps the input as it is (compute dtype); output and internals are rebuilt
        if not site.input_kept_elsewhere and (d < FP32_BYTES or storage_width != width):
            parts.add(site.part, rows * storage_width * d, swap)
        elif not site.input_kept_elsewhere:
            parts.add(site.part, rows * width * d, swap)
        return
    if d < FP32_BYTES or not site.input_kept_elsewhere:
        parts.add(site.part, rows * (width if d < FP32_BYTES else storage_width) * FP32_BYTES, swap)
    parts.add(site.part, rows * FP32_BYTES + rows * width * d, swap)
    if site.pre:
        parts.add(site.part, rows * width * d, swap or site.out_swap)


def _mlp_bytes(rows, width, d, gated: bool, act_recompute: bool):
    """Gated (SwiGLU): gate and up outputs; silu(gate) and the product unless the activation is
    recomputed. Two-matrix MLPs (GELU, squared ReLU): the first matrix's output, which the activation
    reads, and the activation's output, which the second matrix reads, unless recomputed."""
    kept = (2 if act_recompute else 4) if gated else (1 if act_recompute else 2)
    return rows * width * kept * d


def activation_bytes_per_layer(shape: ActivationShape, moe_layer: bool = True, recompute="none",
                               include_swapped: bool = False) -> dict[str, object]:
    """Bytes one decoder layer keeps on the device for backward, per part (``LAYER_PARTS``), for one
    micro-batch. ``recompute``: a level, option names (see ``options_of``). With ``include_swapped``
    the result also has ``swapped``: the bytes moved to host by the swap options."""
    opts = options_of(recompute)
    model = shape.model
    d = float(shape.dtype_bytes)
    h = model.hidden_size
    t, t_split, tp = shape.tokens()
    sandwich = model.norm_style == "sandwich"
    parts = _Parts(swap_all="swap_layer" in opts and "layer" not in opts)
    is_moe = moe_layer and model.moe is not None

    if "layer" in opts:
        # Only the layer input survives (the previous layer's output in fp32 runs, counted there as
        # its residual; in lower precision the input tensor itself, as norms keep only fp32 copies).
        parts.add("residual", t_split * h * d)
        return _result(parts, include_swapped)

    fp32 = d >= FP32_BYTES
    norm = "norm" in opts
    # The two residual-stream tensors: the ffn_norm input and the layer output; kept as themselves
    # only in fp32 runs (the norms keep fp32 copies otherwise).
    if fp32 or norm:
        parts.add("residual", 2 * t_split * h * d)

    # --- attention block ---
    whole_attention = "attention" in opts
    swap_attn = "swap_attention" in opts and not whole_attention
    _norm(parts, _NormSite("attn_norm", t_split, h, pre=True, input_kept_elsewhere=True, out_swap=swap_attn), d,
          norm)
    attn_out_kept = sandwich and fp32 and not norm  # o_proj output is the post-norm's fp32 input
    if whole_attention:
        if attn_out_kept:
            parts.add("attention", t_split * h * d)  # o_proj output = the post-norm's fp32 input
    else:
        _attention(parts, shape, opts, swap_attn, attn_out_kept)
    if sandwich:
        _norm(parts, _NormSite("attn_post_norm", t_split, h, pre=False, input_kept_elsewhere=attn_out_kept), d,
              norm)

    # --- feed-forward block ---
    _norm(parts, _NormSite("ffn_norm", t_split, h, pre=True, input_kept_elsewhere=True), d, norm)
    act = "activation" in opts
    ffn_out_kept = sandwich and fp32 and not norm
    if not is_moe:
        parts.add("ffn", _mlp_bytes(t, model.dense_ffn_hidden / tp, d, model.gated_ffn, act))
        if ffn_out_kept:
            parts.add("ffn", t_split * h * d)
    else:
        _moe(parts, shape, t_split, opts, ffn_out_kept)
        # the grouped GEMMs' block offsets (int32, one per local expert), shared by the layer's three GEMMs
        parts.add("experts", model.moe.num_experts / np.asarray(shape.sharding.ep, dtype=float) * INT32_BYTES)
    if sandwich:
        _norm(parts, _NormSite("ffn_post_norm", t_split, h, pre=False, input_kept_elsewhere=ffn_out_kept), d,
              norm)

    return _result(parts, include_swapped)


def _result(parts: _Parts, include_swapped: bool) -> dict[str, object]:
    result = dict(parts.device)
    if include_swapped:
        result["swapped"] = sum(parts.swapped.values())
        result["core_attention"] = parts.core_attention
    return result


def _attention(parts: _Parts, shape: ActivationShape, opts: frozenset[str], swap: bool, out_kept: bool) -> None:
    model = shape.model
    attn = model.attention
    h = model.hidden_size
    d = float(shape.dtype_bytes)
    t, t_split, tp = shape.tokens()
    batch_rows, seq_local = shape.batch_rows, shape.seq_local
    norm = "norm" in opts
    heads = attn.num_heads / tp
    add = lambda nbytes: parts.add("attention", nbytes, swap)  # noqa: E731
    if isinstance(attn, MLAConfig):
        rope, nope, v_dim = attn.qk_rope_head_dim, attn.qk_nope_head_dim, attn.v_head_dim
        q_src = attn.q_lora_rank or heads * attn.qk_head_dim
        kv_width = attn.kv_lora_rank + rope
        if "mla_up" in opts:
            add(t * (q_src + kv_width) * d)  # the latents, inputs of the recomputed up-projections
        else:
            if attn.q_lora_rank:
                _norm(parts, _NormSite("attention", t, attn.q_lora_rank, pre=True, input_kept_elsewhere=False,
                                       swap=swap), d, norm)
            else:
                add(t * q_src * d)  # the q projection's output, read by nothing that keeps it but rotary
            # kv latent norm: its input is a view of the latent ⊕ rotary-key storage
            _norm(parts, _NormSite("attention", t, attn.kv_lora_rank, pre=True, input_kept_elsewhere=False,
                                   storage_width=kv_width, swap=swap), d, norm)
            add(2 * t * rope * FP32_BYTES)  # rotary cos and sin tables, shared by q and k
        qk = heads * attn.qk_head_dim
        if shape.flash:
            if "mla_up" not in opts:
                add(t * (2 * qk + heads * (nope + v_dim)) * d)  # q, k and the kv_up storage v views
            core = t * heads * v_dim * d + batch_rows * heads * seq_local * FP32_BYTES  # output (o_proj input), lse
        else:
            core = FP32_BYTES * (2 * t * qk + batch_rows * heads * seq_local * seq_local + t * heads * v_dim)
            core = core + t * heads * v_dim * d  # contiguous o_proj input
        add(core)
        parts.add_core_attention(core, swap)
    else:
        groups = attn.num_kv_heads / tp
        q_w, kv_w = heads * attn.head_dim, groups * attn.head_dim
        if attn.qk_norm:
            # fp32 inputs (the projections themselves in fp32 runs), rsqrt per head, y; the output is
            # read by rotary embedding, which keeps only the cos/sin tables
            for width, rows_per_token in ((q_w, heads), (kv_w, groups)):
                if norm:
                    add(t * width * d)
                else:
                    add(t * width * FP32_BYTES + t * rows_per_token * FP32_BYTES + t * width * d)
        add(2 * t * attn.head_dim * FP32_BYTES)  # cos, sin
        add(t * (q_w + kv_w) * d)  # q and k after rotary, kept by the core attention
        add(t * kv_w * d)  # v (the v projection's output)
        core = t * q_w * d + batch_rows * heads * seq_local * FP32_BYTES  # output (o_proj input), lse
        if not shape.flash:
            core = core + t * q_w * d
        add(core)
        parts.add_core_attention(core, swap)
    if out_kept:
        parts.add("attention", t_split * h * d)  # o_proj output = the post-norm's fp32 input


@dataclass(frozen=True)
class _RoutedRows:
    """The rows one device's MoE layer handles in one micro-batch. The device's own tokens make the
    source-side counts (never scaled by the load imbalance); what the device receives makes the others."""

    assignments: object
    """t·k: its (token, expert) pairs, sorted for the dispatch and summed back by the combine."""
    received: object
    """t·k·imbalance: the rows the all-to-all delivers to this device's experts."""
    hop1_sent: object = 0.0
    """Hierarchical: t·n̄ rows, one per (token, destination node)."""
    hop1_received: object = 0.0
    """Hierarchical: t·n̄·imbalance rows this device receives in hop 1, as the peer of its position."""

    @classmethod
    def of(cls, shape: ActivationShape, t_moe) -> _RoutedRows:
        k = shape.model.moe.router.top_k
        imbalance = np.asarray(shape.imbalance, dtype=float)
        nodes_per_token = _nodes_per_token(shape)
        return cls(t_moe * k, t_moe * k * imbalance, t_moe * nodes_per_token, t_moe * nodes_per_token * imbalance)


def _nodes_per_token(shape: ActivationShape):
    """Distinct destination nodes per token: given, or under uniform routing each of N nodes is missed
    by all k choices with probability (1 − 1/N)^k."""
    if shape.nodes_per_token is not None:
        return np.asarray(shape.nodes_per_token, dtype=float)
    nodes = np.maximum(np.asarray(shape.sharding.ep_nodes, dtype=float), 1.0)
    return nodes * (1.0 - (1.0 - 1.0 / nodes) ** shape.model.moe.router.top_k)


def _dispatch(parts: _Parts, shape: ActivationShape, rows: _RoutedRows, opts: frozenset[str], swap: bool) -> None:
    """What the token dispatch keeps (``moetrain.models.dispatch``, ``moetrain.distributed.ep``,
    ``moetrain.distributed.etp``). For the device's own assignments: the sort order and its inverse
    (int64), or the hierarchical dispatcher's own tensors (``_hierarchical``). For the rows it receives:
    under expert parallelism their reorder into (slot, source) order and its inverse (int64, the
    all-to-all's backward and the combine index by them); under expert tensor parallelism the ETP
    group's gathered rows (``etp·received``: the tokens the experts read, kept by their first GEMMs) and
    the gather's reorder index and its inverse over those rows (int64)."""
    d = float(shape.dtype_bytes)
    ep = np.asarray(shape.sharding.ep, dtype=float)
    etp = np.asarray(shape.sharding.etp, dtype=float)
    hierarchical = np.asarray(shape.sharding.hierarchical, dtype=bool) & (ep > 1)
    gathered = etp * rows.received
    parts.add("dispatch", np.where(hierarchical, _hierarchical(shape, rows), rows.assignments * 2 * INDEX_BYTES),
              swap)
    parts.add("dispatch", np.where(ep > 1, rows.received * 2 * INDEX_BYTES, 0.0), swap)
    parts.add("dispatch", np.where(etp > 1, gathered * 2 * INDEX_BYTES, 0.0), swap)
    if "permute" not in opts:
        parts.add("dispatch", gathered * shape.model.hidden_size * d, swap)


def _hierarchical(shape: ActivationShape, rows: _RoutedRows):
    """What the two-hop dispatcher keeps in place of the flat one's sort order and inverse and the
    combine's gating weights (``HierarchicalDispatcher``; measured in
    tests/distributed/test_hierarchical_memory.py). Its own tokens' side: the hop-1 source index
    (int64, one per (token, node) row: the row gather, the weights' gather and the final sum over
    nodes keep it) and the mask of the assignments each row carries (bool, k per row); the final sum's
    backward is a gather, so it keeps no rows. The peer's side, for the ``hop1_received`` rows it
    expands to the ``received`` rows of its node: the expand order (int64, k per hop-1 row: a view of
    the whole argsort), the row each expanded row came from (int64), its gating weight (fp32), and the
    rows the combine's first hop returns, once in the activation dtype (the weights' gradient reads
    them), in place of the flat combine's returned rows. The peer expands as many rows as its node's
    devices receive, on average."""
    h, d, k = shape.model.hidden_size, float(shape.dtype_bytes), shape.model.moe.router.top_k
    expanded = rows.received
    own = rows.hop1_sent * (INDEX_BYTES + k * BOOL_BYTES)
    peer = rows.hop1_received * k * INDEX_BYTES + expanded * (INDEX_BYTES + FP32_BYTES + h * d)
    return own + peer


def _router_bytes(model: ModelConfig, t_moe, fp32: bool):
    """What the router keeps for its backward (no recompute): top-k ids, gathered weights, scores, the
    fp32 copies of input and weight (bf16 runs) and what the normalisation and the losses need."""
    moe = model.moe
    assert moe is not None
    h, k, experts, r = model.hidden_size, moe.router.top_k, moe.num_experts, moe.router
    router = t_moe * k * INDEX_BYTES + t_moe * k * FP32_BYTES + t_moe * experts * FP32_BYTES
    if not fp32:
        router = router + t_moe * h * FP32_BYTES + experts * h * FP32_BYTES  # fp32 copies of x and W
    if r.z_loss_coef:
        router = router + t_moe * experts * FP32_BYTES + t_moe * FP32_BYTES  # logits, logsumexp
    if r.normalize_top_k:
        router = router + t_moe * FP32_BYTES
    if r.expert_balance_coef or r.device_balance_coef:
        router = router + t_moe * FP32_BYTES
    if r.expert_balance_coef:
        router = router + experts * FP32_BYTES
    if r.device_balance_coef:
        router = router + r.num_device_groups * FP32_BYTES
    return router


def _moe(parts: _Parts, shape: ActivationShape, t_moe, opts: frozenset[str], out_kept: bool) -> None:
    model = shape.model
    moe = model.moe
    assert moe is not None
    d = float(shape.dtype_bytes)
    tp = np.asarray(shape.sharding.tp, dtype=float)
    h, k = model.hidden_size, moe.router.top_k
    fp32 = d >= FP32_BYTES
    rows = _RoutedRows.of(shape, t_moe)
    # the hierarchical combine keeps its own tensors (``_hierarchical``): not the flat combine's weights or rows
    flat_combine = ~(np.asarray(shape.sharding.hierarchical, dtype=bool) & (np.asarray(shape.sharding.ep) > 1))
    swap = "swap_moe" in opts
    act = "activation" in opts
    if "router" in opts:
        parts.add("router", t_moe * k * INDEX_BYTES)  # the top-k ids, saved so recompute routes alike
    else:
        parts.add("router", _router_bytes(model, t_moe, fp32))
    # the flat combine keeps the gating weights (fp32, token order; made by the router)
    parts.add("router", np.where(flat_combine, t_moe * k * FP32_BYTES, 0.0))
    _dispatch(parts, shape, rows, opts, swap)
    if not fp32 and moe.num_shared_experts == 0 and "norm" not in opts and (
            "permute" in opts or "router" in opts):
        parts.add("dispatch", t_moe * h * d)  # the MoE input, otherwise kept only as fp32 copies
    etp = np.asarray(shape.sharding.etp, dtype=float)
    # The experts run on the rows the ETP group gathered (etp·received), each on its 1/etp of the FFN width.
    parts.add("experts", _mlp_bytes(etp * rows.received, moe.expert_ffn_hidden / etp, d, model.gated_ffn, act),
              swap)
    # expert output, kept by the flat combine (the weights' gradient): the rows of the device's own
    # assignments, as the all-to-all returns them (after the ETP reduce-scatter has summed the partial
    # outputs of the gathered ones)
    parts.add("experts", np.where(flat_combine, rows.assignments * h * d, 0.0), swap)
    if moe.num_shared_experts:
        parts.add("shared_expert", _mlp_bytes(t_moe, moe.shared_ffn_hidden / tp, d, model.gated_ffn, act), swap)
    if out_kept:
        parts.add("dispatch", t_moe * h * d)  # MoE output = the post-norm's fp32 input


def layer_activation_bytes(shape: ActivationShape, moe_layer: bool, recompute="none") -> LayerActivations:
    """Activation bytes of one decoder layer for one micro-batch on one device, by coarse part.

    ``recompute``: level codes 0/1/2 (numpy-broadcastable), a level name or memory options."""
    def coarse(options) -> LayerActivations:
        p = activation_bytes_per_layer(shape, moe_layer, options, include_swapped=True)
        return LayerActivations(
            norms=p["residual"] + p["attn_norm"] + p["attn_post_norm"] + p["ffn_norm"] + p["ffn_post_norm"],
            attention_proj=p["attention"] - p["core_attention"],
            core_attention=p["core_attention"],
            dense_ffn=p["ffn"],
            router=p["router"],
            dispatch=p["dispatch"],
            experts=p["experts"],
            shared_experts=p["shared_expert"],
        )

    if isinstance(recompute, str) and recompute not in RECOMPUTE_CODES:
        return coarse(recompute)
    if not isinstance(recompute, str) and not isinstance(recompute, np.ndarray | int | float | np.integer):
        return coarse(recompute)
    level = recompute_code(recompute)
    by_level = [coarse(name) for name in ("none", "selective", "full")]
    return LayerActivations(**{
        f.name: np.select([level == 2, level == 1], [getattr(by_level[2], f.name), getattr(by_level[1], f.name)],
                          getattr(by_level[0], f.name))
        for f in fields(LayerActivations)
    })


def embedding_activation_bytes(model: ModelConfig, seq_len, micro_batch, sharding: Sharding = UNSHARDED,
                               dtype_bytes: float = 2.0):
    """Output-side tensors of the last stage: the final norm (fp32 input, rsqrt, y, output kept by the
    head) and the fp32 log-probabilities kept by the loss (split over tp by the vocabulary-parallel
    head); plus the embedding output the first layer reads."""
    t, t_split, tp = sharding.tokens(seq_len, micro_batch)
    h = model.hidden_size
    final_norm = t_split * (h * FP32_BYTES + FP32_BYTES + 2 * h * dtype_bytes)
    if dtype_bytes >= FP32_BYTES:
        final_norm = final_norm - t_split * h * FP32_BYTES  # the fp32 input is the last layer's output
    embedding = t_split * h * dtype_bytes if dtype_bytes >= FP32_BYTES else 0.0
    return embedding + final_norm + t * model.vocab_size / tp * FP32_BYTES


def mtp_extra_activation_bytes(model: ModelConfig, seq_len, micro_batch, sharding: Sharding = UNSHARDED,
                               dtype_bytes: float = 2.0):
    """Per MTP module, what it keeps besides its decoder layer: two input norms, the concatenation
    read by the projection, the projection output, the next-token embedding and another head + loss."""
    t, t_split, _ = sharding.tokens(seq_len, micro_batch)
    h, d = model.hidden_size, dtype_bytes
    fp32 = d >= FP32_BYTES
    norms = 2 * t_split * (FP32_BYTES + h * d) + (0.0 if fp32 else 2 * t_split * h * FP32_BYTES)
    embed = t_split * h * d if fp32 else 0.0
    concat_and_proj = t_split * 2 * h * d + (t_split * h * d if fp32 else 0.0)
    ids = 2 * t * INDEX_BYTES
    return norms + embed + concat_and_proj + ids + embedding_activation_bytes(model, seq_len, micro_batch, sharding,
                                                                               d) - (t_split * h * d if fp32 else 0.0)


def model_activation_bytes(shape: ActivationShape, layer_options: Iterable | None = None,
                           include_mtp: bool = True) -> dict[str, object]:
    """Whole model on one device (no pipeline split): ``layers`` (summed), ``head`` (embedding, final
    norm, loss, MTP extras), ``total`` and ``swapped``. ``layer_options``: one option set per layer
    (decoder layers, then MTP layers); None = no option anywhere."""
    model = shape.model
    num_blocks = model.num_layers + (model.num_mtp_layers if include_mtp else 0)
    per_layer = list(layer_options) if layer_options is not None else [frozenset()] * num_blocks
    layers = 0.0
    swapped = 0.0
    for index in range(num_blocks):
        moe_layer = model.is_moe_layer(index) if index < model.num_layers else model.moe is not None
        options = per_layer[index] if index < len(per_layer) else frozenset()
        parts = activation_bytes_per_layer(shape, moe_layer, options, include_swapped=True)
        swapped = swapped + parts.pop("swapped")
        parts.pop("core_attention")
        layers = layers + sum(parts.values())
    head = embedding_activation_bytes(model, shape.seq_len, shape.micro_batch, shape.sharding, shape.dtype_bytes)
    if include_mtp:
        head = head + model.num_mtp_layers * mtp_extra_activation_bytes(model, shape.seq_len, shape.micro_batch,
                                                                        shape.sharding, shape.dtype_bytes)
    return {"layers": layers, "head": head, "total": layers + head, "swapped": swapped}
