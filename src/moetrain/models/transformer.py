"""The decoder: one implementation for every preset (Pangu, DeepSeek-V3, Qwen3-MoE, Mixtral).

Layer i is dense (SwiGLU) for i < num_dense_layers and MoE after. Norm style "pre" is
``x + f(norm(x))``; "sandwich" (Pangu's depth-scaled sandwich norm) is ``x + norm_post(f(norm_pre(x)))``
with the post-norm gains started at ``post_norm_gain / sqrt(num_layers)``. Optional multi-token
prediction (DeepSeek-V3 §2.2): module k combines the hidden state at position i with the embedding
of token i+k and predicts token i+k+1, sharing the embedding and output head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config.model import ModelConfig
from moetrain.models.attention import (
    AttentionBackend,
    AttentionContext,
    build_attention,
    build_attention_context,
)
from moetrain.models.experts import SwiGLU
from moetrain.models.moe import MoE
from moetrain.models.norm import RMSNorm

IGNORE_INDEX = -100


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_layer: bool, backend: AttentionBackend,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.norm_eps
        self.sandwich = cfg.norm_style == "sandwich"
        self.attn_norm = RMSNorm(h, eps, device=device)
        self.attention = build_attention(cfg, backend, device)
        self.ffn_norm = RMSNorm(h, eps, device=device)
        if moe_layer:
            assert cfg.moe is not None
            self.moe = MoE(h, cfg.moe, device=device)
        else:
            self.ffn = SwiGLU(h, cfg.dense_ffn_hidden, device=device)
        if self.sandwich:
            self.attn_post_norm = RMSNorm(h, eps, device=device)
            self.ffn_post_norm = RMSNorm(h, eps, device=device)

    @property
    def is_moe(self) -> bool:
        return hasattr(self, "moe")

    def forward(self, x: torch.Tensor, ctx: AttentionContext, replay_TK: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Returns (hidden, aux loss or None, tokens per expert or None). ``replay_TK``: the experts an MoE
        layer must use for each of x's tokens (router replay; ignored by a dense layer)."""
        attn = self.attention(self.attn_norm(x), ctx)
        x = x + (self.attn_post_norm(attn) if self.sandwich else attn)
        aux = counts = None
        if self.is_moe:
            moe_out = self.moe(self.ffn_norm(x), replay_TK)
            ffn, aux, counts = moe_out.out_TD, moe_out.aux_loss, moe_out.tokens_per_expert_E
        else:
            ffn = self.ffn(self.ffn_norm(x))
        x = x + (self.ffn_post_norm(ffn) if self.sandwich else ffn)
        return x, aux, counts


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str | None = None) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.hidden_norm = RMSNorm(h, cfg.norm_eps, device=device)
        self.embed_norm = RMSNorm(h, cfg.norm_eps, device=device)
        self.proj = nn.Linear(2 * h, h, bias=False, device=device)
        self.layer = DecoderLayer(cfg, moe_layer=cfg.moe is not None, backend=backend, device=device)
        self.final_norm = RMSNorm(h, cfg.norm_eps, device=device)

    def forward(self, hidden: torch.Tensor, next_embed: torch.Tensor, ctx: AttentionContext):
        x = self.proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(next_embed)], dim=-1))
        return self.layer(x, ctx)


@dataclass
class ModelOutput:
    logits: torch.Tensor
    """[batch, seq, vocab] in the compute dtype."""
    loss: torch.Tensor | None = None
    """What to backpropagate: lm + mtp_loss_weight·mtp + aux_loss_scale·aux."""
    lm_loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    num_label_tokens: torch.Tensor | None = None
    """Label tokens (≠ -100) in this batch, on device."""
    tokens_per_expert: torch.Tensor | None = None
    """int64 [num MoE layers (MTP's included last), num experts], on device."""


def decoder_moe_layers(cfg: ModelConfig) -> list[int]:
    """Indices of the decoder's MoE layers: the columns of a router-replay record [B, S, M, K] (MTP
    modules are not replayed: generation never runs them)."""
    return [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)] if cfg.moe is not None else []


def layer_replay(expert_ids_BSMK: torch.Tensor | None, column: int | None) -> torch.Tensor | None:
    """One MoE layer's column of a replay record, flattened to the router's tokens [B·S, K]."""
    if expert_ids_BSMK is None or column is None:
        return None
    return expert_ids_BSMK[:, :, column].reshape(-1, expert_ids_BSMK.shape[-1])


def shift_left(t_BS: torch.Tensor, fill: int) -> torch.Tensor:
    return torch.cat([t_BS[:, 1:], t_BS.new_full((t_BS.shape[0], 1), fill)], dim=1)


def token_loss_sum(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy (fp32) over labels ≠ -100."""
    return F.cross_entropy(
        logits_BSV.float().reshape(-1, logits_BSV.shape[-1]), labels_BS.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend = "sdpa",
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, cfg.is_moe_layer(i), backend, device) for i in range(cfg.num_layers)
        )
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, device=device)
        if not cfg.tie_embeddings:
            self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device)
        self.mtp = nn.ModuleList(MTPModule(cfg, backend, device) for _ in range(cfg.num_mtp_layers))

    def output_head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.embed.weight) if self.cfg.tie_embeddings else self.head(x)

    def logits_at(self, hidden_BSD: torch.Tensor, index_T: torch.Tensor) -> torch.Tensor:
        """[T, V] logits of the last layer's output at flat (row-major) positions ``index_T`` only: the
        final norm and the head are per token, so the other positions need neither (RL scores its
        completion tokens only)."""
        hidden_TD = hidden_BSD.reshape(-1, hidden_BSD.shape[-1]).index_select(0, index_T)
        return self.output_head(self.final_norm(hidden_TD))

    @torch.no_grad()
    def init_weights(self) -> None:
        """TinyInit or normal init; norm gains 1, sandwich post-norm gains c/sqrt(L). Uses torch's RNG."""
        cfg = self.cfg
        std = math.sqrt(1.0 / (2 * cfg.hidden_size * cfg.num_layers)) if cfg.init == "tinyinit" else cfg.init_std
        # Pangu Ultra §2.2: TinyInit keeps the embedding at std 0.5.
        embed_std = 0.5 if cfg.init == "tinyinit" else cfg.init_std
        post_gain = cfg.post_norm_gain / math.sqrt(cfg.num_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(post_gain if "post_norm" in name else 1.0)
            elif name == "embed.weight":
                param.normal_(0.0, embed_std)
            else:
                param.normal_(0.0, std)
        for module in self.modules():
            if hasattr(module, "score_bias"):
                module.score_bias.zero_()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, loss_normalizer: torch.Tensor | float | None = None,
                aux_loss_scale: float = 1.0, expert_ids: torch.Tensor | None = None) -> ModelOutput:
        """Logits, and with ``labels`` the losses. Label tokens are averaged over ``loss_normalizer``
        when given (the global batch's label count, so gradient accumulation and any parallel layout
        give the same gradient), else over this batch's label tokens. ``expert_ids``: a router-replay
        record [B, S, M, K] for the M decoder MoE layers (``decoder_moe_layers``)."""
        ctx = build_attention_context(input_ids, document_ids)
        x = self.embed(input_ids)
        aux_terms, counts = [], []
        column = {layer: col for col, layer in enumerate(decoder_moe_layers(self.cfg))}
        for index, layer in enumerate(self.layers):
            x, aux, layer_counts = layer(x, ctx, layer_replay(expert_ids, column.get(index)))
            if aux is not None:
                aux_terms.append(aux)
                counts.append(layer_counts)
        logits = self.output_head(self.final_norm(x))
        out = ModelOutput(logits=logits)
        if labels is None:
            return out

        num_label_tokens = (labels != IGNORE_INDEX).sum()
        normalizer = num_label_tokens.clamp(min=1) if loss_normalizer is None else loss_normalizer
        lm_loss = token_loss_sum(logits, labels) / normalizer
        mtp_loss = logits.new_zeros((), dtype=torch.float32)
        hidden, next_ids, next_labels = x, input_ids, labels
        for module in self.mtp:
            next_ids = shift_left(next_ids, 0)
            next_labels = shift_left(next_labels, IGNORE_INDEX)
            hidden, aux, layer_counts = module(hidden, self.embed(next_ids), ctx)
            if aux is not None:
                aux_terms.append(aux)
                counts.append(layer_counts)
            mtp_logits = self.output_head(module.final_norm(hidden))
            mtp_loss = mtp_loss + token_loss_sum(mtp_logits, next_labels) / normalizer
        if self.mtp:
            mtp_loss = mtp_loss / len(self.mtp)
        aux_loss = torch.stack(aux_terms).sum() if aux_terms else lm_loss.new_zeros(())
        out.loss = lm_loss + self.cfg.mtp_loss_weight * mtp_loss + aux_loss_scale * aux_loss
        out.lm_loss, out.mtp_loss, out.aux_loss = lm_loss, mtp_loss, aux_loss
        out.num_label_tokens = num_label_tokens
        out.tokens_per_expert = torch.stack(counts) if counts else None
        return out

    def moe_blocks(self) -> list[nn.Module]:
        """MoE blocks in the order of ``ModelOutput.tokens_per_expert`` rows."""
        blocks = [layer.moe for layer in self.layers if layer.is_moe]
        return blocks + [m.layer.moe for m in self.mtp if m.layer.is_moe]

    @torch.no_grad()
    def update_router_biases(self, tokens_per_expert: torch.Tensor) -> None:
        """Aux-loss-free bias step for every MoE block, from the step's [layers, experts] counts."""
        for block, counts in zip(self.moe_blocks(), tokens_per_expert):
            block.router.update_bias(counts)


ROUTED_EXPERTS = ".moe.experts."
"""What the names of the routed experts' parameters contain (``layers.5.moe.experts.w_up_EDF``)."""


def is_routed_expert(name: str) -> bool:
    """Whether parameter ``name`` (its name in the full model) belongs to the routed experts, the tensors
    that EP splits by expert index."""
    return ROUTED_EXPERTS in f".{name}"


_PART_RULES: list[tuple[str, str]] = [
    # (substring of the parameter name, part of moetrain.costs.params.ParamCounts); first match wins
    ("mtp.", "mtp"),
    ("embed.", "embedding"),
    ("head.", "head"),
    (".moe.router.", "router"),
    (ROUTED_EXPERTS, "experts"),
    (".moe.shared_expert.", "shared_experts"),
    (".attention.", "attention"),
    (".ffn.", "dense_ffn"),
    ("norm.", "norms"),
]


def param_counts_by_part(model: nn.Module) -> dict[str, int]:
    """numel per part, with the same part names as ``moetrain.costs.params.ParamCounts``."""
    counts: dict[str, int] = {}
    for name, param in model.named_parameters():
        part = next((p for key, p in _PART_RULES if key in f".{name}" or name.startswith(key)), None)
        if part is None:
            raise AssertionError(f"parameter {name} belongs to no known part")
        counts[part] = counts.get(part, 0) + param.numel()
    return counts


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", backend: AttentionBackend | None = None,
                seed: int | None = None) -> MoETransformer:
    """Build (and unless on ``meta`` initialise) the model. ``seed`` makes the weights reproducible
    independently of what ran before."""
    device = torch.device(device)
    backend = backend or "sdpa"
    model = MoETransformer(cfg, backend=backend, device=device)
    if device.type != "meta":
        if seed is not None:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                model.init_weights()
        else:
            model.init_weights()
    return model
