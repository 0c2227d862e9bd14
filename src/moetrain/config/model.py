"""Model architecture config: one schema for every preset (Pangu, DeepSeek-V3, Qwen3-MoE, Mixtral).

Torch-free on purpose: the planner and the cost formulas read it without importing torch.
Errors raised here are ``ValueError`` with the numbers that disagree and how to mend them; the CLI
turns them into one-line messages.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from moetrain.config import limits


def _at_most(bound: int, why: str) -> AfterValidator:
    """Refuse a size past ``bound`` (``moetrain.config.limits``), which no real model reaches, in one line:
    torch would otherwise try to build a module that large. ``why`` names the published size it exceeds."""
    def check(value: int) -> int:
        if value > bound:
            raise ValueError(f"Input should be at most {bound:,} ({why})")
        return value

    return AfterValidator(check)


_HIDDEN = _at_most(limits.MAX_HIDDEN, "ten times the widest published model's 25,600")
_FFN = _at_most(limits.MAX_FFN_HIDDEN, "ten times the widest published feed-forward's 102,400")
_LAYERS = _at_most(limits.MAX_LAYERS, "four times the deepest Transformer trained, DeepNet's 1,000 layers")
_VOCAB = _at_most(limits.MAX_VOCAB, "sixteen times the largest published vocabulary, 262,144")
_CONTEXT = _at_most(limits.MAX_CONTEXT, "thirteen times the longest published context, 10M tokens")
_EXPERTS = _at_most(limits.MAX_EXPERTS, "thirty-two times the most experts published, Switch-C's 2,048")
_HEADS = _at_most(limits.MAX_HEADS, "twenty-five times the most attention heads published, 160")
_HEAD_DIM = _at_most(limits.MAX_HEAD_DIM, "ten times the widest head or latent dimension published, 1,536")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class MLAConfig(_Strict):
    """Multi-head latent attention (DeepSeek-V2/V3, Pangu Ultra MoE).

    Queries go through an optional low-rank latent (``q_lora_rank``, 0 = plain projection); keys and
    values share one latent of ``kv_lora_rank``; the rotary part of the key (``qk_rope_head_dim``) is
    one vector shared by all heads. QK head dim = nope + rope; V head dim may differ.
    """

    kind: Literal["mla"] = "mla"
    num_heads: Annotated[int, _HEADS] = Field(gt=0)
    q_lora_rank: Annotated[int, _HEAD_DIM] = Field(ge=0)
    kv_lora_rank: Annotated[int, _HEAD_DIM] = Field(gt=0)
    qk_nope_head_dim: Annotated[int, _HEAD_DIM] = Field(gt=0)
    qk_rope_head_dim: Annotated[int, _HEAD_DIM] = Field(gt=0)
    v_head_dim: Annotated[int, _HEAD_DIM] = Field(gt=0)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @model_validator(mode="after")
    def _rope_even(self) -> MLAConfig:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"attention.qk_rope_head_dim={self.qk_rope_head_dim} must be even for rotary pairs")
        return self


class GQAConfig(_Strict):
    """Grouped-query attention (Qwen3-MoE, Mixtral); MHA when num_kv_heads == num_heads."""

    kind: Literal["gqa"] = "gqa"
    num_heads: Annotated[int, _HEADS] = Field(gt=0)
    num_kv_heads: Annotated[int, _HEADS] = Field(gt=0)
    head_dim: Annotated[int, _HEAD_DIM] = Field(gt=0)
    qk_norm: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.head_dim

    @model_validator(mode="after")
    def _groups_divide(self) -> GQAConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"attention.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "pick num_kv_heads that divides num_heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"attention.head_dim={self.head_dim} must be even for rotary pairs")
        return self


AttentionConfig = Annotated[MLAConfig | GQAConfig, Field(discriminator="kind")]


class RouterConfig(_Strict):
    """Top-k router. Scores in fp32; see ``moetrain.models.router`` for the exact math."""

    score_function: Literal["softmax", "sigmoid"] = "softmax"
    top_k: int = Field(gt=0)
    normalize_top_k: bool = True
    """Renormalise the chosen k scores to sum to 1 (before the scaling factor)."""
    scaling_factor: float = Field(default=1.0, gt=0)
    """Routed output multiplier (DeepSeek-V3 and Pangu: 2.5)."""
    num_groups: int = Field(default=1, gt=0)
    """Group-limited routing (DeepSeek-V3): experts split into groups, tokens use the best groups only."""
    num_top_groups: int = Field(default=1, gt=0)
    score_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added for selection only."""
    bias_update_rate: float = Field(default=1e-3, ge=0)
    expert_balance_coef: float = Field(default=0.0, ge=0)
    """Switch-style balance loss over experts."""
    device_balance_coef: float = Field(default=0.0, ge=0)
    """Balance loss over EP groups (devices): Pangu balances device load, not expert load."""
    num_device_groups: int = Field(default=1, gt=0)
    """Expert groups the device-level loss balances: set it to the EP size you train with. A model
    property (not read from the layout) so that every layout computes the same loss."""
    z_loss_coef: float = Field(default=0.0, ge=0)


class MoEConfig(_Strict):
    num_experts: Annotated[int, _EXPERTS] = Field(gt=0)
    expert_ffn_hidden: Annotated[int, _FFN] = Field(gt=0)
    num_shared_experts: Annotated[int, _EXPERTS] = Field(default=0, ge=0)
    router: RouterConfig

    @property
    def shared_ffn_hidden(self) -> int:
        """All shared experts fused into one SwiGLU of this width (as the reference models do)."""
        return self.expert_ffn_hidden * self.num_shared_experts

    @model_validator(mode="after")
    def _routing_fits(self) -> MoEConfig:
        r = self.router
        if r.top_k > self.num_experts:
            raise ValueError(f"moe.router.top_k={r.top_k} exceeds moe.num_experts={self.num_experts}")
        if self.num_experts % r.num_groups:
            raise ValueError(
                f"moe.num_experts={self.num_experts} is not divisible by router.num_groups={r.num_groups}"
            )
        if self.num_experts % r.num_device_groups:
            raise ValueError(
                f"moe.num_experts={self.num_experts} is not divisible by router.num_device_groups="
                f"{r.num_device_groups}"
            )
        if r.num_top_groups > r.num_groups:
            raise ValueError(
                f"router.num_top_groups={r.num_top_groups} exceeds router.num_groups={r.num_groups}"
            )
        if r.num_groups > 1 and r.top_k > r.num_top_groups * (self.num_experts // r.num_groups):
            raise ValueError(
                f"router.top_k={r.top_k} cannot be met from {r.num_top_groups} groups of "
                f"{self.num_experts // r.num_groups} experts; raise router.num_top_groups"
            )
        return self


class YarnRopeConfig(_Strict):
    """YaRN context extension of the rotary embedding (Peng et al. 2023; DeepSeek-V3's long context).

    Frequencies blend interpolation (divided by ``factor``) and extrapolation with a linear ramp
    between the dims that rotate ``beta_fast`` and ``beta_slow`` times over ``original_max_seq_len``;
    cos/sin are scaled by mscale(factor, mscale)/mscale(factor, mscale_all_dim), and with
    ``mscale_all_dim`` the softmax scale by mscale(factor, mscale_all_dim)².
    """

    kind: Literal["yarn"] = "yarn"
    factor: float = Field(gt=0)
    original_max_seq_len: Annotated[int, _CONTEXT] = Field(gt=0)
    beta_fast: float = Field(default=32.0, gt=0)
    beta_slow: float = Field(default=1.0, gt=0)
    mscale: float = Field(default=1.0, ge=0)
    mscale_all_dim: float = Field(default=0.0, ge=0)


class ModelConfig(_Strict):
    name: str
    vocab_size: Annotated[int, _VOCAB] = Field(gt=0)
    hidden_size: Annotated[int, _HIDDEN] = Field(gt=0)
    num_layers: Annotated[int, _LAYERS] = Field(gt=0)
    num_dense_layers: int = Field(default=0, ge=0)
    """Leading layers with a dense SwiGLU FFN instead of MoE (all layers when ``moe`` is None)."""
    dense_ffn_hidden: Annotated[int, _FFN] = Field(default=0, ge=0)
    ffn_act: Literal["swiglu", "gelu", "relu2"] = "swiglu"
    """MLP structure of dense FFNs and experts: swiglu is gated (3 matrices); gelu and relu2 (squared
    ReLU) have 2 matrices. Non-swiglu shapes describe published runs for the planner's validation."""
    attention: AttentionConfig
    moe: MoEConfig | None = None
    norm_style: Literal["pre", "sandwich"] = "pre"
    """pre: x + f(norm(x)); sandwich: x + norm_post(f(norm_pre(x))) (Pangu's depth-scaled sandwich norm)."""
    norm_eps: float = Field(default=1e-6, gt=0)
    post_norm_gain: float = Field(default=1.0, gt=0)
    """Depth-scaled sandwich norm: post-norm gains start at post_norm_gain / sqrt(num_layers)."""
    init: Literal["normal", "tinyinit"] = "normal"
    """tinyinit: weight std sqrt(1/(2·hidden·layers)) (Pangu Ultra); normal: std ``init_std``."""
    init_std: float = Field(default=0.02, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: YarnRopeConfig | None = None
    max_seq_len: Annotated[int, _CONTEXT] = Field(default=4096, gt=0)
    num_mtp_layers: Annotated[int, _LAYERS] = Field(default=0, ge=0)
    """Multi-token-prediction depth (DeepSeek-V3 style sequential MTP modules)."""
    mtp_loss_weight: float = Field(default=0.3, ge=0)
    tie_embeddings: bool = False

    @property
    def gated_ffn(self) -> bool:
        """A gate matrix beside up and down (swiglu); gelu and relu2 have up and down only."""
        return self.ffn_act == "swiglu"

    @property
    def num_moe_layers(self) -> int:
        return 0 if self.moe is None else self.num_layers - self.num_dense_layers

    def is_moe_layer(self, layer_index: int) -> bool:
        return self.moe is not None and layer_index >= self.num_dense_layers

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.num_dense_layers > self.num_layers:
            raise ValueError(
                f"num_dense_layers={self.num_dense_layers} exceeds num_layers={self.num_layers}"
            )
        needs_dense = self.moe is None or self.num_dense_layers > 0
        if needs_dense and self.dense_ffn_hidden <= 0:
            raise ValueError(
                "dense layers need dense_ffn_hidden > 0 "
                f"(num_dense_layers={self.num_dense_layers}, moe={'on' if self.moe else 'off'})"
            )
        if self.moe is None and self.num_dense_layers not in (0, self.num_layers):
            raise ValueError("a dense model (no moe section) must leave num_dense_layers at 0 or num_layers")
        return self


def moe_layer_indices(cfg: ModelConfig) -> list[int]:
    """Layer index of each MoE block, in the order of the runtime's per-expert count rows: decoder
    layers by their position, then the multi-token-prediction modules' blocks as ``num_layers + j``."""
    if cfg.moe is None:
        return []
    decoder = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    return decoder + [cfg.num_layers + j for j in range(cfg.num_mtp_layers)]
