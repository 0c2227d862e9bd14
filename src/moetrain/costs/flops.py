"""FLOPs per token, per model part: the one formula behind the runtime's MFU and the planner.

Convention (stated once, used everywhere): a matmul of an [m, k] by [k, n] costs 2·m·k·n FLOPs;
the backward pass costs twice the forward; the embedding lookup costs nothing; norms, activations
and softmax are not counted (they are memory-bound, not FLOPs). Attention scores are counted over
the full ``seq_len`` unless ``causal=True`` halves them: the full count is the Megatron / PaLM MFU
convention (Narayanan et al. 2021, eq. 3; Chowdhery et al. 2022, App. B) that published MFU figures
use. ``seq_len`` may be a numpy array.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from moetrain.config.model import GQAConfig, ModelConfig
from moetrain.costs.params import attention_params, mlp_params, moe_block_params


def attention_projection_flops(model: ModelConfig) -> float:
    """Forward FLOPs per token of the attention projections (q/kv/o and MLA up/down projections)."""
    attn = model.attention
    norms = (2 * attn.head_dim if attn.qk_norm else 0) if isinstance(attn, GQAConfig) else (
        attn.q_lora_rank + attn.kv_lora_rank
    )
    return 2.0 * (attention_params(model) - norms)


def mla_up_projection_flops(model: ModelConfig) -> float:
    """Forward FLOPs per token of MLA's up-projections (q from its latent, k and v from theirs), which
    fine-grained selective recompute runs again; 0 for attention without latents."""
    attn = model.attention
    if isinstance(attn, GQAConfig):
        return 0.0
    return 2.0 * attn.num_heads * (attn.q_lora_rank * attn.qk_head_dim
                                   + attn.kv_lora_rank * (attn.qk_nope_head_dim + attn.v_head_dim))


def attention_core_flops(model: ModelConfig, seq_len, causal: bool = False):
    """Forward FLOPs per token of QKᵀ and PV: 2·heads·context·(qk_dim + v_dim); context is seq_len,
    or (seq_len+1)/2 on average with a causal mask when ``causal``."""
    attn = model.attention
    context = (seq_len + 1) / 2 if causal else seq_len
    return 2.0 * attn.num_heads * context * (attn.qk_head_dim + attn.v_head_dim)


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs per token of one decoder layer, by part."""

    attention_proj: float
    attention_core: float
    dense_ffn: float = 0.0
    router: float = 0.0
    experts: float = 0.0
    shared_experts: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


def layer_forward_flops(model: ModelConfig, seq_len, moe_layer: bool, causal: bool = False) -> LayerFlops:
    proj = attention_projection_flops(model)
    core = attention_core_flops(model, seq_len, causal)
    if not moe_layer:
        return LayerFlops(proj, core, dense_ffn=2.0 * mlp_params(model, model.dense_ffn_hidden))
    assert model.moe is not None
    router, _, shared = moe_block_params(model)
    return LayerFlops(
        proj,
        core,
        router=2.0 * router,
        experts=2.0 * model.moe.router.top_k * mlp_params(model, model.moe.expert_ffn_hidden),
        shared_experts=2.0 * shared,
    )


@dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs per token of the whole model, by part."""

    attention_proj: float
    attention_core: float
    dense_ffn: float
    router: float
    experts: float
    shared_experts: float
    head: float
    mtp: float

    @property
    def forward(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def training(self) -> float:
        """Forward + backward (2×forward) per token: the numerator of MFU."""
        return 3.0 * self.forward

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def model_forward_flops(
    model: ModelConfig, seq_len, causal: bool = False, include_mtp: bool = True
) -> ModelFlops:
    num_moe = model.num_moe_layers
    num_dense = model.num_layers - num_moe
    dense = layer_forward_flops(model, seq_len, moe_layer=False, causal=causal) if num_dense else None
    moe = layer_forward_flops(model, seq_len, moe_layer=True, causal=causal) if num_moe else None
    head = 2.0 * model.hidden_size * model.vocab_size

    def part(name: str) -> float:
        return (num_dense * getattr(dense, name) if dense else 0.0) + (num_moe * getattr(moe, name) if moe else 0.0)

    mtp = 0.0
    if include_mtp and model.num_mtp_layers:
        block = layer_forward_flops(model, seq_len, moe_layer=model.moe is not None, causal=causal)
        projection = 2.0 * 2 * model.hidden_size * model.hidden_size
        mtp = model.num_mtp_layers * (block.total + projection + head)
    return ModelFlops(
        attention_proj=part("attention_proj"),
        attention_core=part("attention_core"),
        dense_ffn=part("dense_ffn"),
        router=part("router"),
        experts=part("experts"),
        shared_experts=part("shared_experts"),
        head=head,
        mtp=mtp,
    )


def training_flops_per_token(model: ModelConfig, seq_len, causal: bool = False, include_mtp: bool = True):
    """Model FLOPs (no recompute) per trained token: 3 × forward."""
    return model_forward_flops(model, seq_len, causal, include_mtp).training


@dataclass(frozen=True)
class LinearWidths:
    """Per token, the widths of a block's linear-layer tensors that an FP8 stack quantises, besides the
    block's hidden-wide input and output: the other inputs (``inner_inputs``, quantised in the forward) and
    the other outputs (``inner_outputs``, whose gradients the backward quantises). The block's input is one
    hidden-wide tensor however many projections read it, and the gradient of its output one more."""

    inner_inputs: float
    inner_outputs: float


def attention_linear_widths(model: ModelConfig) -> LinearWidths:
    """Attention: GQA reads the hidden state into q, k, v (one tensor) and the heads' output into o; MLA
    reads it into the down-projections, their latents into the up-projections (q's latent only with a q
    LoRA rank) and the heads' output into o."""
    attn = model.attention
    if isinstance(attn, GQAConfig):
        heads_out = attn.num_heads * attn.head_dim
        return LinearWidths(heads_out, (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim)
    q_out = attn.num_heads * attn.qk_head_dim
    kv_up_out = attn.num_heads * (attn.qk_nope_head_dim + attn.v_head_dim)
    heads_out = attn.num_heads * attn.v_head_dim
    if attn.q_lora_rank:
        inputs = attn.q_lora_rank + attn.kv_lora_rank + heads_out
        outputs = attn.q_lora_rank + attn.kv_lora_rank + attn.qk_rope_head_dim + q_out + kv_up_out
    else:
        inputs = attn.kv_lora_rank + heads_out
        outputs = q_out + attn.kv_lora_rank + attn.qk_rope_head_dim + kv_up_out
    return LinearWidths(inputs, outputs)


def mlp_linear_widths(model: ModelConfig, ffn_hidden: float) -> LinearWidths:
    """An MLP of width ``ffn_hidden``: the activation is the second matrix's input; the first matrix writes
    gate and up (swiglu) or up alone."""
    return LinearWidths(ffn_hidden, (2 if model.gated_ffn else 1) * ffn_hidden)
