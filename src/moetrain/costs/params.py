"""Parameter counts per model part, from the config alone.

These counts are the contract with ``moetrain.models``: a test builds each preset on the meta device
and checks that every part's count here equals the module's ``numel``.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.model import GQAConfig, MLAConfig, ModelConfig


def attention_params(model: ModelConfig) -> int:
    """One attention block: projections and (MLA) latent norms / (GQA) q-k norms. No biases."""
    h, attn = model.hidden_size, model.attention
    if isinstance(attn, MLAConfig):
        heads = attn.num_heads
        if attn.q_lora_rank:
            q = h * attn.q_lora_rank + attn.q_lora_rank + attn.q_lora_rank * heads * attn.qk_head_dim
        else:
            q = h * heads * attn.qk_head_dim
        kv = (
            h * (attn.kv_lora_rank + attn.qk_rope_head_dim)
            + attn.kv_lora_rank
            + attn.kv_lora_rank * heads * (attn.qk_nope_head_dim + attn.v_head_dim)
        )
        out = heads * attn.v_head_dim * h
        return q + kv + out
    assert isinstance(attn, GQAConfig)
    q = h * attn.num_heads * attn.head_dim
    kv = 2 * h * attn.num_kv_heads * attn.head_dim
    out = attn.num_heads * attn.head_dim * h
    norms = 2 * attn.head_dim if attn.qk_norm else 0
    return q + kv + out + norms


def swiglu_params(hidden: int, ffn_hidden: int) -> int:
    """gate, up (hidden→ffn) and down (ffn→hidden) projections."""
    return 3 * hidden * ffn_hidden


def mlp_params(model: ModelConfig, ffn_hidden: int) -> int:
    """One MLP of width ``ffn_hidden`` in the model's structure: 3 matrices for swiglu, 2 for gelu/relu2."""
    if model.gated_ffn:
        return swiglu_params(model.hidden_size, ffn_hidden)
    return 2 * model.hidden_size * ffn_hidden


def layer_norm_params(model: ModelConfig) -> int:
    """RMSNorm gains of one decoder layer: 2 (pre) or 4 (sandwich) of width hidden."""
    return (4 if model.norm_style == "sandwich" else 2) * model.hidden_size


@dataclass(frozen=True)
class ParamCounts:
    """Parameters per part for the whole model (``mtp`` kept apart, as published counts exclude it)."""

    embedding: int
    attention: int
    norms: int
    dense_ffn: int
    router: int
    experts: int
    shared_experts: int
    head: int
    mtp: int
    active_experts: int
    """Routed-expert parameters one token touches (top_k experts in every MoE layer)."""

    @property
    def total(self) -> int:
        """All parameters, MTP excluded."""
        return (
            self.embedding + self.attention + self.norms + self.dense_ffn + self.router
            + self.experts + self.shared_experts + self.head
        )

    @property
    def total_with_mtp(self) -> int:
        return self.total + self.mtp

    @property
    def active(self) -> int:
        """Parameters one token uses, without MTP and without the input embedding (a lookup, not a
        matmul), the convention of the published 39.2B / 37B figures."""
        return self.total - self.embedding - self.experts + self.active_experts

    def as_dict(self) -> dict[str, int]:
        return {
            "embedding": self.embedding,
            "attention": self.attention,
            "norms": self.norms,
            "dense_ffn": self.dense_ffn,
            "router": self.router,
            "experts": self.experts,
            "shared_experts": self.shared_experts,
            "head": self.head,
            "mtp": self.mtp,
        }


def moe_block_params(model: ModelConfig) -> tuple[int, int, int]:
    """(router, routed experts, shared experts) of one MoE layer."""
    moe = model.moe
    if moe is None:
        return 0, 0, 0
    h = model.hidden_size
    router = h * moe.num_experts
    experts = moe.num_experts * mlp_params(model, moe.expert_ffn_hidden)
    shared = mlp_params(model, moe.shared_ffn_hidden) if moe.num_shared_experts else 0
    return router, experts, shared


def decoder_layer_params(model: ModelConfig, moe_layer: bool) -> int:
    ffn = sum(moe_block_params(model)) if moe_layer else mlp_params(model, model.dense_ffn_hidden)
    return attention_params(model) + layer_norm_params(model) + ffn


def mtp_module_params(model: ModelConfig) -> int:
    """One DeepSeek-V3-style MTP module: norms of the hidden state and of the next token's embedding,
    a 2h→h projection, one decoder layer (MoE if the model is), and a final norm. The embedding and
    output head are shared with the main model and not counted again."""
    h = model.hidden_size
    return 2 * h + 2 * h * h + decoder_layer_params(model, moe_layer=model.moe is not None) + h


def count_params(model: ModelConfig) -> ParamCounts:
    h, v = model.hidden_size, model.vocab_size
    num_moe = model.num_moe_layers
    num_dense = model.num_layers - num_moe
    router, experts, shared = moe_block_params(model)
    active_experts = 0
    if model.moe is not None:
        active_experts = num_moe * model.moe.router.top_k * mlp_params(model, model.moe.expert_ffn_hidden)
    return ParamCounts(
        embedding=v * h,
        attention=model.num_layers * attention_params(model),
        norms=model.num_layers * layer_norm_params(model) + h,
        dense_ffn=num_dense * mlp_params(model, model.dense_ffn_hidden),
        router=num_moe * router,
        experts=num_moe * experts,
        shared_experts=num_moe * shared,
        head=0 if model.tie_embeddings else v * h,
        mtp=model.num_mtp_layers * mtp_module_params(model),
        active_experts=active_experts,
    )
