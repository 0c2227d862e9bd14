"""Attention: MLA (DeepSeek-V2/V3, Pangu) and GQA (Qwen3, Mixtral), causal with document masking.

Legend: B batch, S sequence, H query heads, G kv heads, D head dim, N/R non-rotary/rotary QK dims,
V value head dim, C kv latent rank, Q q latent rank.

MLA keeps QK head dim (N+R, 192 for Pangu) and V head dim (128) as they are: V is never padded.
Two backends compute the same function:
- ``eager`` adds the rotary and non-rotary score parts, ``q_N·k_N + q_R·k_R``, without concatenating q
  or k, and shares the single rotary key across heads by broadcasting (no copy per head);
- ``sdpa`` hands torch's fused ``scaled_dot_product_attention`` one concatenated q and k (it takes one
  QK tensor) and V with its own head dim; memory-efficient kernels avoid the S×S score matrix.

Packed documents (``document_ids``) are masked one of two ways, chosen when the context is built:
- ``dense``: a boolean [B, 1, S, S] mask handed to the kernel. Fused kernels given an arbitrary mask
  read it in full and skip nothing; on an H100 cuDNN's backward with it ran 4.5× its forward
  (``benchmarks/results/gpu_step_profile_small_compiled.json``).
- ``block``: a FlexAttention ``BlockMask`` (causal ∧ same document) whose empty tiles the kernel
  skips. Inductor generates that kernel inside a compiled layer; called eagerly ``flex_attention`` is
  an unfused reference that builds the S×S scores (on an H200 an eager step of 8×4096 tokens ran out
  of memory, ``benchmarks/results/step_speed_h200.json``). It has no CPU backward either, so it is the
  choice of compiled CUDA layers.
Either way a row inside one document needs no mask at all: it is plain causal attention at positions
0..S-1, the fused causal kernel's fast path, so the data loader gives a micro-batch of such rows no
documents (``moetrain.data.packing``). In a micro-batch that holds a boundary only the rows that hold one
need the mask: given them (``boundary_rows_R``: ``moetrain.data.packing.boundary_rows``, found on the host
before the batch's copy, so no device value is waited for), the context carries the mask of those rows
alone, and the core attention runs the causal kernel over every row and the masked one over those rows,
whose outputs replace theirs. On an H200 a
masked 8-row step of the 1.56 B model took about 86 ms more than a plain one when the whole micro-batch
ran FlexAttention (``benchmarks/notes/planner.md``, the H200 step check).

Under context parallelism (``moetrain.distributed.cp``) a layer computes the queries of its share of
the sequence only; ``AttentionContext.gather_kv`` brings the keys' sources of the whole sequence, and
the mask and positions come from the full sequence (``build_attention_context`` with token indices).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from moetrain.config.model import GQAConfig, MLAConfig, ModelConfig
from moetrain.models.norm import RMSNorm
from moetrain.models.rope import Rotary, apply_rope, positions_from_documents, yarn_softmax_scale_factor

AttentionBackend = Literal["sdpa", "eager"]
DocumentMask = Literal["dense", "block"]


@dataclass(frozen=True)
class AttentionContext:
    """Per-batch inputs every attention layer shares; built once per forward."""

    positions_BS: torch.Tensor
    """RoPE position of each query token."""
    mask_B1SS: torch.Tensor | None
    """Boolean [B|1, 1, queries, keys] (True = may attend); None means plain causal over one sequence."""
    key_positions_BS: torch.Tensor | None = None
    """RoPE position of each key token when the keys are not the queries (context parallelism: keys
    gathered from every rank); None means the queries' positions."""
    gather_kv: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Context parallelism: gathers a per-token key/value tensor [B, S_local, X] into the keys' order
    [B, S_keys, X] (its backward returns each rank the summed gradient of its own tokens)."""
    block_mask: BlockMask | None = None
    """The document mask as FlexAttention tiles (``document_mask="block"``); then ``mask_B1SS`` is None
    and the core attention runs ``flex_attention``."""
    masked_rows_R: torch.Tensor | None = None
    """The rows (int64 [R]) the mask is for, when not every row: ``mask_B1SS`` (as [R, 1, S, S]) or
    ``block_mask`` covers those rows alone and the others are plain causal."""


def document_block_mask(document_ids_BS: torch.Tensor) -> BlockMask:
    """Causal ∧ same-document mask as FlexAttention tiles of 128×128 (one mask shared by all heads)."""
    batch, seq = document_ids_BS.shape

    def causal_same_document(b, h, q_index, kv_index):
        return (q_index >= kv_index) & (document_ids_BS[b, q_index] == document_ids_BS[b, kv_index])

    return create_block_mask(causal_same_document, batch, None, seq, seq, device=document_ids_BS.device)


def build_attention_context(
    input_ids_BS: torch.Tensor, document_ids_BS: torch.Tensor | None,
    query_index_S: torch.Tensor | None = None, key_index_S: torch.Tensor | None = None,
    gather_kv: Callable[[torch.Tensor], torch.Tensor] | None = None, document_mask: DocumentMask = "dense",
    boundary_rows_R: torch.Tensor | None = None,
) -> AttentionContext:
    """The context of full sequences ``input_ids_BS`` (and their documents). With ``query_index_S``
    the layer computes only the queries at those sequence indices, against keys at ``key_index_S``
    (in the order ``gather_kv`` delivers them): positions and the causal + document mask are taken
    from the full sequence, so each token keeps its true position (context parallelism, which always
    masks ``dense``). ``document_mask``: how the document mask is handed to the kernel (module doc);
    ``boundary_rows_R``: the rows that hold a document boundary, the only ones masked (module doc)."""
    batch, seq = input_ids_BS.shape
    device = input_ids_BS.device
    if query_index_S is None:
        if document_ids_BS is None or (boundary_rows_R is not None and boundary_rows_R.numel() == 0):
            positions = torch.arange(seq, device=device).expand(batch, seq)
            return AttentionContext(positions, None)  # no row holds a boundary: plain causal
        positions = positions_from_documents(document_ids_BS)
        documents = document_ids_BS if boundary_rows_R is None else document_ids_BS.index_select(0, boundary_rows_R)
        if document_mask == "block":
            return AttentionContext(positions, None, block_mask=document_block_mask(documents),
                                    masked_rows_R=boundary_rows_R)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
        same_doc = documents.unsqueeze(2) == documents.unsqueeze(1)
        return AttentionContext(positions, (same_doc & causal).unsqueeze(1), masked_rows_R=boundary_rows_R)
    assert key_index_S is not None, "a query subset needs the keys' sequence indices"
    if document_ids_BS is None:
        positions = torch.arange(seq, device=device).expand(batch, seq)
    else:
        positions = positions_from_documents(document_ids_BS)
    mask_1SS = (key_index_S.unsqueeze(0) <= query_index_S.unsqueeze(1)).unsqueeze(0)  # causal on true indices
    if document_ids_BS is not None:
        same_doc = document_ids_BS[:, query_index_S].unsqueeze(2) == document_ids_BS[:, key_index_S].unsqueeze(1)
        mask_1SS = mask_1SS & same_doc
    return AttentionContext(positions[:, query_index_S], mask_1SS.unsqueeze(1), positions[:, key_index_S], gather_kv)


def full_mask(ctx: AttentionContext, batch: int) -> torch.Tensor | None:
    """``ctx``'s mask over every row: the masked rows' own, plain causal for the others."""
    if ctx.masked_rows_R is None or ctx.mask_B1SS is None:
        return ctx.mask_B1SS
    seq = ctx.mask_B1SS.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=ctx.mask_B1SS.device).tril()
    return causal.expand(batch, 1, seq, seq).index_copy(0, ctx.masked_rows_R, ctx.mask_B1SS)


def _masked_softmax_scores(scores_BHSS: torch.Tensor, mask_B1SS: torch.Tensor | None) -> torch.Tensor:
    seq = scores_BHSS.shape[-1]
    if mask_B1SS is None:
        mask_B1SS = torch.ones(seq, seq, dtype=torch.bool, device=scores_BHSS.device).tril()
    scores_BHSS = scores_BHSS.float().masked_fill(~mask_B1SS, float("-inf"))
    return scores_BHSS.softmax(dim=-1)


def core_attention(
    q_BHSD: torch.Tensor,
    k_BGSD: torch.Tensor,
    v_BGSV: torch.Tensor,
    ctx: AttentionContext,
    scale: float,
    backend: AttentionBackend,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v with GQA broadcasting (G divides H); returns [B, H, S, V]."""
    if ctx.masked_rows_R is not None:
        # every row through the causal kernel, then the boundary rows through the masked one in their place
        rows = ctx.masked_rows_R
        out = core_attention(q_BHSD, k_BGSD, v_BGSV, replace(ctx, mask_B1SS=None, block_mask=None,
                                                             masked_rows_R=None), scale, backend)
        # The rows are gathered as a product with their one-hot selection (exact: one term of 1·x): Inductor's
        # CPU backward through a one-row index_select into SDPA came out wrong (torch 2.13; the compiled test
        # in tests/models/test_attention.py). Built by comparison: one_hot's range check would wait for the
        # device.
        pick_RB = (rows.unsqueeze(1) == torch.arange(q_BHSD.shape[0], device=rows.device)).to(q_BHSD.dtype)

        def pick(t_B: torch.Tensor) -> torch.Tensor:
            return torch.einsum("rb,b...->r...", pick_RB, t_B)

        masked = core_attention(pick(q_BHSD), pick(k_BGSD), pick(v_BGSV), replace(ctx, masked_rows_R=None), scale,
                                backend)
        # Put back the same way, by the transposed selection, and chosen row by row (exact: each row is one
        # term). index_copy here did not compile on torch 2.11, the GPU machine's: AOTAutograd refused its
        # backward, a copy into a permuted empty tensor (the compiled test, run with torch 2.11 on a CPU).
        is_boundary_B = pick_RB.sum(0) > 0
        put_back = torch.einsum("rb,r...->b...", pick_RB, masked)
        return torch.where(is_boundary_B.view(-1, *([1] * (out.dim() - 1))), put_back, out)
    heads, groups = q_BHSD.shape[1], k_BGSD.shape[1]
    if ctx.block_mask is not None:
        # Inside a compiled layer the compiler generates the fused kernel; called eagerly flex_attention is
        # an unfused reference that materialises the scores (CPU tests compare it; the runtime uses block
        # masks in compiled layers only, ``resolve_document_mask``).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(q_BHSD, k_BGSD, v_BGSV, block_mask=ctx.block_mask, scale=scale,
                                  enable_gqa=groups != heads)
    if backend == "sdpa":
        return F.scaled_dot_product_attention(
            q_BHSD, k_BGSD, v_BGSV,
            attn_mask=ctx.mask_B1SS, is_causal=ctx.mask_B1SS is None, scale=scale, enable_gqa=groups != heads,
        )
    if groups != heads:
        k_BGSD = k_BGSD.repeat_interleave(heads // groups, dim=1)
        v_BGSV = v_BGSV.repeat_interleave(heads // groups, dim=1)
    probs = _masked_softmax_scores(q_BHSD @ k_BGSD.transpose(-1, -2) * scale, ctx.mask_B1SS)
    return probs.to(v_BGSV.dtype) @ v_BGSV


class MLA(nn.Module):
    def __init__(self, hidden: int, cfg: MLAConfig, eps: float, rotary: Rotary, backend: AttentionBackend,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg, self.rotary, self.backend = cfg, rotary, backend
        heads = cfg.num_heads
        if cfg.q_lora_rank:
            self.q_down = nn.Linear(hidden, cfg.q_lora_rank, bias=False, device=device)
            self.q_norm = RMSNorm(cfg.q_lora_rank, eps, device=device)
            self.q_up = nn.Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, bias=False, device=device)
        else:
            self.q_proj = nn.Linear(hidden, heads * cfg.qk_head_dim, bias=False, device=device)
        self.kv_down = nn.Linear(hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False, device=device)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, eps, device=device)
        self.kv_up = nn.Linear(
            cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False, device=device
        )
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, hidden, bias=False, device=device)
        # DeepSeek-V3 convention: YaRN also sharpens the softmax by mscale(factor, mscale_all_dim)²
        self.scale = cfg.qk_head_dim**-0.5 * yarn_softmax_scale_factor(rotary.scaling)

    def project_q(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank:
            return self.q_up(self.q_norm(self.q_down(x_BSD)))
        return self.q_proj(x_BSD)

    def project_down(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections of x: (q latent, or the full q without a q latent; kv latent; rotary key).

        Kept apart from ``project_up`` so the memory policy can recompute the up-projections from the
        small latents (``moetrain.memory``) without touching this code."""
        cfg = self.cfg
        q_source = self.q_down(x_BSD) if cfg.q_lora_rank else self.q_proj(x_BSD)
        latent_BSC, k_rope_BSR = self.kv_down(x_BSD).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        return q_source, latent_BSC, k_rope_BSR

    def project_up(self, q_source: torch.Tensor, latent_BSC: torch.Tensor, k_rope_BSR: torch.Tensor,
                   ctx: AttentionContext) -> tuple[torch.Tensor, ...]:
        """Latents to the core attention's inputs, rotary applied: (q, k, v) [B, H, S, ·] for sdpa,
        (q_nope, q_rope, k_nope, k_rope, v) for eager (k_rope has one head, shared by all)."""
        cfg = self.cfg
        batch, q_seq = q_source.shape[:2]
        kv_seq = latent_BSC.shape[1]  # the whole sequence's keys under context parallelism, else q_seq
        nope, rope, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q_flat = self.q_up(self.q_norm(q_source)) if cfg.q_lora_rank else q_source
        q_BSHK = q_flat.view(batch, q_seq, cfg.num_heads, nope + rope)
        q_nope_BSHN, q_rope_BSHR = q_BSHK.split([nope, rope], dim=-1)
        kv_BSHK = self.kv_up(self.kv_norm(latent_BSC)).view(batch, kv_seq, cfg.num_heads, nope + v_dim)
        k_nope_BSHN, v_BSHV = kv_BSHK.split([nope, v_dim], dim=-1)

        cos, sin = self.rotary.cos_sin(ctx.positions_BS, rope)
        if ctx.key_positions_BS is not None:
            k_cos, k_sin = self.rotary.cos_sin(ctx.key_positions_BS, rope)
        else:
            k_cos, k_sin = cos, sin
        q_rope_BSHR = apply_rope(q_rope_BSHR, cos, sin)
        k_rope_BS1R = apply_rope(k_rope_BSR.unsqueeze(2), k_cos, k_sin)  # one rotary key shared by all heads

        q_nope, q_rope = q_nope_BSHN.transpose(1, 2), q_rope_BSHR.transpose(1, 2)
        k_nope, k_rope = k_nope_BSHN.transpose(1, 2), k_rope_BS1R.transpose(1, 2)
        v = v_BSHV.transpose(1, 2)
        if self.backend == "eager" and ctx.block_mask is None:
            return q_nope, q_rope, k_nope, k_rope, v
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, cfg.num_heads, -1, -1)], dim=-1)
        return q, k, v

    def attend(self, qkv: tuple[torch.Tensor, ...], ctx: AttentionContext) -> torch.Tensor:
        """Core attention over ``project_up``'s output; returns [B, S, H·V], the o_proj input."""
        cfg = self.cfg
        if self.backend == "eager" and ctx.block_mask is None:
            q_nope, q_rope, k_nope, k_rope, v = qkv
            scores = (q_nope @ k_nope.transpose(-1, -2) + q_rope @ k_rope.transpose(-1, -2)) * self.scale
            out_BHSV = _masked_softmax_scores(scores, full_mask(ctx, scores.shape[0])).to(v.dtype) @ v
        else:
            q, k, v = qkv
            out_BHSV = core_attention(q, k, v, ctx, self.scale, "sdpa")  # flex when ctx holds a block mask
        batch, seq = out_BHSV.shape[0], out_BHSV.shape[2]
        return out_BHSV.transpose(1, 2).reshape(batch, seq, cfg.num_heads * cfg.v_head_dim)

    def forward(self, x_BSD: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        q_source, latent_BSC, k_rope_BSR = self.project_down(x_BSD)
        if ctx.gather_kv is not None:
            # Context parallelism: gather the keys' sources over the CP ranks *before* the up-projection.
            # MLA's advantage: a token's keys and values are rebuilt from its compressed latent c_kv (C)
            # and one rotary key shared by all heads (R), so C + R numbers per token travel instead of
            # the H·(N + V) of the expanded keys and values (DeepSeek-V2 §2.1, here applied to CP's
            # all-gather); queries stay local. RoPE is applied after the gather at the keys' own positions.
            cfg = self.cfg
            gathered = ctx.gather_kv(torch.cat([latent_BSC, k_rope_BSR], dim=-1))
            latent_BSC, k_rope_BSR = gathered.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        qkv = self.project_up(q_source, latent_BSC, k_rope_BSR, ctx)
        return self.o_proj(self.attend(qkv, ctx))


class GQA(nn.Module):
    def __init__(self, hidden: int, cfg: GQAConfig, eps: float, rotary: Rotary, backend: AttentionBackend,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg, self.rotary, self.backend = cfg, rotary, backend
        self.q_proj = nn.Linear(hidden, cfg.num_heads * cfg.head_dim, bias=False, device=device)
        self.k_proj = nn.Linear(hidden, cfg.num_kv_heads * cfg.head_dim, bias=False, device=device)
        self.v_proj = nn.Linear(hidden, cfg.num_kv_heads * cfg.head_dim, bias=False, device=device)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, hidden, bias=False, device=device)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's q and k before rotary
            self.q_norm = RMSNorm(cfg.head_dim, eps, device=device)
            self.k_norm = RMSNorm(cfg.head_dim, eps, device=device)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)  # YaRN scales only cos/sin here (Qwen3 convention)

    def forward(self, x_BSD: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        cfg = self.cfg
        batch, seq, _ = x_BSD.shape
        q = self.q_proj(x_BSD).view(batch, seq, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x_BSD).view(batch, seq, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x_BSD).view(batch, seq, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if ctx.gather_kv is not None:
            # Context parallelism: all-gather this rank's keys and values (one exchange) over the CP
            # ranks; RoPE is applied after the gather at the keys' own positions.
            kv = ctx.gather_kv(torch.cat([k, v], dim=-1).flatten(2))
            k, v = kv.view(batch, kv.shape[1], cfg.num_kv_heads, 2 * cfg.head_dim).split(cfg.head_dim, dim=-1)
        cos, sin = self.rotary.cos_sin(ctx.positions_BS, cfg.head_dim)
        k_cos, k_sin = (cos, sin) if ctx.key_positions_BS is None else self.rotary.cos_sin(
            ctx.key_positions_BS, cfg.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, k_cos, k_sin)
        out = core_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx, self.scale, self.backend)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, cfg.num_heads * cfg.head_dim))


def build_attention(model: ModelConfig, backend: AttentionBackend,
                    device: torch.device | str | None = None) -> nn.Module:
    """The attention of one of ``model``'s layers (MLA or grouped-query, as its config says)."""
    rotary = Rotary(model.rope_theta, model.rope_scaling)
    if isinstance(model.attention, MLAConfig):
        return MLA(model.hidden_size, model.attention, model.norm_eps, rotary, backend, device)
    return GQA(model.hidden_size, model.attention, model.norm_eps, rotary, backend, device)
