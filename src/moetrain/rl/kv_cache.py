"""The KV cache of generation, and attention of new tokens against it, for MLA and GQA.

Legend: B rows, Q new tokens per row (the prompt at prefill, 1 per decode step), L cache slots, H query
heads, G kv heads, D head dim, C kv latent rank, R rotary dims, N non-rotary QK dims, V value head dim.

MLA caches what the model compresses, not per-head keys and values: per token the normalised latent
``kv_norm(c_kv)`` (C numbers) and the one rotary key every head shares, already rotated (R numbers);
tiny-pangu stores 48 numbers per token and layer where expanded K/V would be H·(N+R+V) = 448. Attention
runs in latent space by weight absorption (DeepSeek-V2 §2.1.3): ``q_N·k_N = q_N·(W_UK c) = (W_UKᵀ q_N)·c``
and ``Σ p·v = W_UV (Σ p·c)``, so the cache is never expanded. GQA caches its rotated K and V per kv head.

Each row writes its new tokens at their own positions (rows advance independently), and a query at
position p sees the slots 0..p of its row: slots above p hold a shorter prompt's padding or nothing yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetrain.models.attention import GQA, MLA
from moetrain.models.rope import apply_rope


@dataclass
class LayerCache:
    """One attention layer's cache: named tensors [B, L, ...]."""

    tensors: dict[str, torch.Tensor]

    def write(self, positions_BQ: torch.Tensor, **values: torch.Tensor) -> None:
        rows_BQ = torch.arange(positions_BQ.shape[0], device=positions_BQ.device).unsqueeze(1).expand_as(positions_BQ)
        for name, value in values.items():
            self.tensors[name][rows_BQ, positions_BQ] = value.to(self.tensors[name].dtype)

    def keys(self, name: str, num_slots: int) -> torch.Tensor:
        return self.tensors[name][:, :num_slots]

    def select_rows(self, index_A: torch.Tensor) -> None:
        """Keep the rows still generating (finished rows are dropped, not computed on)."""
        self.tensors = {name: value.index_select(0, index_A) for name, value in self.tensors.items()}

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def new_cache(attention: nn.Module, rows: int, slots: int, device: torch.device, dtype: torch.dtype) -> LayerCache:
    if isinstance(attention, MLA):
        cfg = attention.cfg
        return LayerCache({"latent": torch.zeros(rows, slots, cfg.kv_lora_rank, device=device, dtype=dtype),
                           "k_rope": torch.zeros(rows, slots, cfg.qk_rope_head_dim, device=device, dtype=dtype)})
    if isinstance(attention, GQA):
        cfg = attention.cfg
        shape = (rows, slots, cfg.num_kv_heads, cfg.head_dim)
        return LayerCache({"k": torch.zeros(shape, device=device, dtype=dtype),
                           "v": torch.zeros(shape, device=device, dtype=dtype)})
    raise TypeError(f"no KV cache for {type(attention).__name__}")


def _visible(positions_BQ: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[B, 1, Q, L]: slot j is visible to the query at position p when j ≤ p."""
    slots = torch.arange(num_slots, device=positions_BQ.device)
    return (slots <= positions_BQ.unsqueeze(-1)).unsqueeze(1)


def _softmax(scores_BHQL: torch.Tensor, visible_B1QL: torch.Tensor) -> torch.Tensor:
    return scores_BHQL.float().masked_fill(~visible_B1QL, float("-inf")).softmax(dim=-1)


def mla_attend(attn: MLA, x_BQD: torch.Tensor, positions_BQ: torch.Tensor, cache: LayerCache,
               num_slots: int) -> torch.Tensor:
    """MLA of the new tokens ``x`` (after the layer's input norm) over their row's cache; writes their
    latents first. ``num_slots``: how many leading slots any row can see (max position + 1)."""
    cfg = attn.cfg
    batch, queries = x_BQD.shape[:2]
    heads, nope, rope, v_dim, rank = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                      cfg.kv_lora_rank)
    q_BQHK = attn.project_q(x_BQD).view(batch, queries, heads, nope + rope)
    q_nope_BQHN, q_rope_BQHR = q_BQHK.split([nope, rope], dim=-1)
    latent_BQC, k_rope_BQR = attn.kv_down(x_BQD).split([rank, rope], dim=-1)
    cos, sin = attn.rotary.cos_sin(positions_BQ, rope)
    q_rope_BQHR = apply_rope(q_rope_BQHR, cos, sin)
    cache.write(positions_BQ, latent=attn.kv_norm(latent_BQC),
                k_rope=apply_rope(k_rope_BQR.unsqueeze(2), cos, sin).squeeze(2))
    latent_BLC, k_rope_BLR = cache.keys("latent", num_slots), cache.keys("k_rope", num_slots)

    w_up_HKC = attn.kv_up.weight.view(heads, nope + v_dim, rank)
    w_uk_HNC, w_uv_HVC = w_up_HKC.split([nope, v_dim], dim=1)
    q_latent_BQHC = torch.einsum("bqhn,hnc->bqhc", q_nope_BQHN, w_uk_HNC)
    scores_BHQL = (torch.einsum("bqhc,blc->bhql", q_latent_BQHC, latent_BLC)
                   + torch.einsum("bqhr,blr->bhql", q_rope_BQHR, k_rope_BLR)) * attn.scale
    probs_BHQL = _softmax(scores_BHQL, _visible(positions_BQ, num_slots)).to(latent_BLC.dtype)
    out_latent_BQHC = torch.einsum("bhql,blc->bqhc", probs_BHQL, latent_BLC)
    out_BQHV = torch.einsum("bqhc,hvc->bqhv", out_latent_BQHC, w_uv_HVC)
    return attn.o_proj(out_BQHV.reshape(batch, queries, heads * v_dim))


def gqa_attend(attn: GQA, x_BQD: torch.Tensor, positions_BQ: torch.Tensor, cache: LayerCache,
               num_slots: int) -> torch.Tensor:
    """GQA of the new tokens over their row's cache of rotated keys and values."""
    cfg = attn.cfg
    batch, queries = x_BQD.shape[:2]
    q = attn.q_proj(x_BQD).view(batch, queries, cfg.num_heads, cfg.head_dim)
    k = attn.k_proj(x_BQD).view(batch, queries, cfg.num_kv_heads, cfg.head_dim)
    v = attn.v_proj(x_BQD).view(batch, queries, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = attn.rotary.cos_sin(positions_BQ, cfg.head_dim)
    q_BQHD, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache.write(positions_BQ, k=k, v=v)
    repeat = cfg.num_heads // cfg.num_kv_heads
    k_BLHD = cache.keys("k", num_slots).repeat_interleave(repeat, dim=2)
    v_BLHD = cache.keys("v", num_slots).repeat_interleave(repeat, dim=2)
    scores_BHQL = torch.einsum("bqhd,blhd->bhql", q_BQHD, k_BLHD) * attn.scale
    probs_BHQL = _softmax(scores_BHQL, _visible(positions_BQ, num_slots)).to(v_BLHD.dtype)
    out_BQHD = torch.einsum("bhql,blhd->bqhd", probs_BHQL, v_BLHD)
    return attn.o_proj(out_BQHD.reshape(batch, queries, cfg.num_heads * cfg.head_dim))


def cached_attention(attention: nn.Module, x_BQD: torch.Tensor, positions_BQ: torch.Tensor, cache: LayerCache,
                     num_slots: int) -> torch.Tensor:
    if isinstance(attention, MLA):
        return mla_attend(attention, x_BQD, positions_BQ, cache, num_slots)
    return gqa_attend(attention, x_BQD, positions_BQ, cache, num_slots)
