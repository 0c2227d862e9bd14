"""moetrain's Pangu-style MoE decoder for transformers (``trust_remote_code=True``).

Written for this folder by moetrain (``moetrain.hf.remote_code``) from its own model
(``moetrain.models``): the same arithmetic, so the logits equal moetrain's up to float rounding.

Legend: B batch, S sequence, H heads, D hidden, T tokens (B·S), E experts, K experts per token.

- Attention is multi-head latent attention: queries through an optional low-rank latent, keys and values
  rebuilt from one latent per token, plus one rotary key shared by every head. Rotary embeddings rotate
  halves (x_i with x_{i+R/2}); with YaRN the frequencies are blended and cos/sin and the softmax scale
  adjusted as in the DeepSeek-V3 convention.
- Norms are RMSNorm computed in fp32. Sandwich norm: x + norm_out(f(norm_in(x))); pre-norm: x + f(norm_in(x)).
- The router scores x·Wᵀ in fp32 (sigmoid or softmax), may add a per-expert bias for the choice only and
  limit each token to its best expert groups (a group scored by the sum of its top-2 sigmoid scores, or
  its best softmax score); the gates are the unbiased scores of the chosen experts, renormalised over the K
  when asked, times the scaling factor. Shared experts are one SwiGLU of their summed width.
- The multi-token-prediction modules (``model.mtp_layers``) hold weights for further training; the logits
  do not use them.
- No KV cache: each generation step runs the whole prefix again (fine for small models and tests).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_moetrain_pangu import MoetrainPanguConfig


class MoetrainPanguRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _yarn_mscale(factor, mscale=1.0):
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rotary_frequencies(dim, base, yarn, device):
    """Inverse frequencies [dim/2] and the factor on cos/sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if not yarn:
        return inv_freq, 1.0
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(yarn["beta_slow"])), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 on fast-rotating dims (kept), 0 on slow ones (interpolated)
    inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    if yarn["mscale"] and yarn["mscale_all_dim"]:
        return inv_freq, _yarn_mscale(factor, yarn["mscale"]) / _yarn_mscale(factor, yarn["mscale_all_dim"])
    return inv_freq, _yarn_mscale(factor)


def _rotate(x_BSHR, cos_BS1R, sin_BS1R):
    x32 = x_BSHR.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos_BS1R + rotated * sin_BS1R).to(x_BSHR.dtype)


class MoetrainPanguAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        heads, nope, rope = config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim
        hidden = config.hidden_size
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = MoetrainPanguRMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * (nope + rope), bias=False)
        else:
            self.q_proj = nn.Linear(hidden, heads * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, config.kv_lora_rank + rope, bias=False)
        self.kv_a_layernorm = MoetrainPanguRMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, heads * (nope + config.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * config.v_head_dim, hidden, bias=False)
        yarn = config.rotary_yarn
        sharpen = _yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2 if yarn and yarn["mscale_all_dim"] else 1.0
        self.scale = (nope + rope) ** -0.5 * sharpen

    def forward(self, x_BSD, positions_BS, mask_B1SS):
        c = self.config
        batch, seq, _ = x_BSD.shape
        heads, nope, rope, v_dim = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD))) if c.q_lora_rank else self.q_proj(x_BSD)
        q_nope, q_rope = q.view(batch, seq, heads, nope + rope).split([nope, rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x_BSD).split([c.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, seq, heads, nope + v_dim)
        k_nope, v = kv.split([nope, v_dim], dim=-1)

        inv_freq, factor = _rotary_frequencies(rope, c.rotary_base, c.rotary_yarn, x_BSD.device)
        angles = positions_BS.float().unsqueeze(-1) * inv_freq
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(2)
        cos, sin = angles.cos() * factor, angles.sin() * factor
        q_rope = _rotate(q_rope, cos, sin)
        k_rope = _rotate(k_rope.unsqueeze(2), cos, sin).expand(-1, -1, heads, -1)  # one rotary key, every head

        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_rope], dim=-1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=mask_B1SS, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, heads * v_dim))


class MoetrainPanguMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, hidden, width):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoetrainPanguRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        if config.use_score_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x_TD):
        """(chosen experts [T, K], their gates [T, K] in fp32)."""
        c = self.config
        logits = x_TD.float() @ self.weight.float().t()
        scores = logits.sigmoid() if c.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.e_score_correction_bias if c.use_score_bias else scores
        if c.n_group > 1:
            grouped = choice.view(choice.shape[0], c.n_group, -1)
            if c.scoring_func == "sigmoid":
                group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            else:
                group_score = grouped.max(dim=-1).values
            best = group_score.topk(c.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(choice.shape[0], -1)
        experts_TK = choice.topk(c.num_experts_per_tok, dim=-1).indices
        gates_TK = scores.gather(1, experts_TK)
        if c.norm_topk_prob:
            gates_TK = gates_TK / (gates_TK.sum(-1, keepdim=True) + 1e-20)
        return experts_TK, gates_TK * c.routed_scaling_factor


class MoetrainPanguMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = MoetrainPanguRouter(config)
        self.experts = nn.ModuleList(MoetrainPanguMLP(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.n_routed_experts))
        if config.n_shared_experts:
            self.shared_experts = MoetrainPanguMLP(config.hidden_size,
                                                   config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x_BSD):
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        experts_TK, gates_TK = self.gate(x_TD)
        out_TD = torch.zeros_like(x_TD, dtype=torch.float32)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero(experts_TK == e, as_tuple=True)
            if token.numel():
                out_TD.index_add_(0, token, expert(x_TD[token]).float() * gates_TK[token, slot].unsqueeze(-1))
        out_TD = out_TD.to(x_TD.dtype)
        if hasattr(self, "shared_experts"):
            out_TD = out_TD + self.shared_experts(x_TD)
        return out_TD.view_as(x_BSD)


class MoetrainPanguDecoderLayer(nn.Module):
    def __init__(self, config, moe):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.sandwich = config.sandwich_norm
        self.input_layernorm = MoetrainPanguRMSNorm(hidden, eps)
        self.self_attn = MoetrainPanguAttention(config)
        self.post_attention_layernorm = MoetrainPanguRMSNorm(hidden, eps)
        self.mlp = MoetrainPanguMoE(config) if moe else MoetrainPanguMLP(hidden, config.intermediate_size)
        if self.sandwich:
            self.attention_output_layernorm = MoetrainPanguRMSNorm(hidden, eps)
            self.mlp_output_layernorm = MoetrainPanguRMSNorm(hidden, eps)

    def forward(self, x, positions_BS, mask_B1SS):
        attn = self.self_attn(self.input_layernorm(x), positions_BS, mask_B1SS)
        x = x + (self.attention_output_layernorm(attn) if self.sandwich else attn)
        ffn = self.mlp(self.post_attention_layernorm(x))
        return x + (self.mlp_output_layernorm(ffn) if self.sandwich else ffn)


class MoetrainPanguMTPModule(nn.Module):
    """A multi-token-prediction module (weights only here): combines the hidden state at position i with
    the embedding of token i+1 to predict token i+2, sharing the embedding and the output head."""

    def __init__(self, config):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_norm = MoetrainPanguRMSNorm(hidden, eps)
        self.embed_norm = MoetrainPanguRMSNorm(hidden, eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = MoetrainPanguDecoderLayer(config, moe=config.n_routed_experts > 0)
        self.final_norm = MoetrainPanguRMSNorm(hidden, eps)


class MoetrainPanguPreTrainedModel(PreTrainedModel):
    config_class = MoetrainPanguConfig
    base_model_prefix = "model"
    _no_split_modules = ["MoetrainPanguDecoderLayer"]
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear | nn.Embedding | MoetrainPanguRouter):
            module.weight.data.normal_(0.0, std)
        elif isinstance(module, MoetrainPanguRMSNorm):
            module.weight.data.fill_(1.0)


class MoetrainPanguModel(MoetrainPanguPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        moe = config.n_routed_experts > 0
        self.layers = nn.ModuleList(MoetrainPanguDecoderLayer(config, moe and i >= config.first_k_dense_replace)
                                    for i in range(config.num_hidden_layers))
        self.norm = MoetrainPanguRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mtp_layers = nn.ModuleList(MoetrainPanguMTPModule(config)
                                        for _ in range(config.num_nextn_predict_layers))
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        batch, seq = input_ids.shape
        device = input_ids.device
        mask_B1SS = torch.ones(seq, seq, dtype=torch.bool, device=device).tril().expand(batch, 1, seq, seq)
        if attention_mask is not None:
            keys_B11S = attention_mask.bool()[:, None, None, :]
            # a padded query still sees itself, so that its (ignored) row is no division by zero
            mask_B1SS = (mask_B1SS & keys_B11S) | torch.eye(seq, dtype=torch.bool, device=device)
            if position_ids is None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if position_ids is None:
            position_ids = torch.arange(seq, device=device).expand(batch, seq)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, position_ids, mask_B1SS)
        return self.norm(x)


class MoetrainPanguForCausalLM(MoetrainPanguPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = MoetrainPanguModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
        if self.config.tie_word_embeddings:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        # no KV cache: every step sees the whole sequence so far
        return {"input_ids": input_ids, "attention_mask": attention_mask}
