"""Tensor-by-tensor mapping between Hugging Face checkpoints and moetrain's state dict.

Each ``TensorSpec`` says where one checkpoint tensor lives in our model: a whole parameter, or
one expert's slice of a stacked expert parameter (``w_gate_EDF [E, D, F]`` holds expert e's
``gate_proj.weight [F, D]`` transposed), possibly with its rows permuted (DeepSeek-V3's interleaved
rotary pairs). Published checkpoints (and transformers' own ``save_pretrained``) store experts one
module each; transformers 5 fuses them in memory into ``experts.gate_up_proj [E, 2F, D]`` and
``experts.down_proj [E, D, F]``, and a checkpoint written from that layout is read too.

Rotary layout: our RoPE rotates halves (x_i with x_{i+R/2}). DeepSeek-V3 with ``rope_interleave``
rotates adjacent pairs (x_{2i}, x_{2i+1}) and emits the result in rotate-half order. Both sides of
the score q_R·k_R see the same permutation P = [0, 2, 4, ..., 1, 3, 5, ...] of the projection rows,
so loading the rope rows of q and of the shared rotary key as ``W[P]`` computes the same scores
exactly (a permutation, no arithmetic); saving applies the inverse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from moetrain.config.model import MLAConfig, ModelConfig
from moetrain.hf.pangu import FAMILY as PANGU_FAMILY


@dataclass(frozen=True)
class TensorSpec:
    hf_name: str
    param: str
    """Our state-dict key."""
    expert: int | None = None
    """Index along dim 0 of a stacked expert parameter; the checkpoint tensor is its transpose."""
    row_index: torch.Tensor | None = None
    """Rows of the checkpoint tensor in our order (ours = theirs[row_index])."""

    def hf_shape(self, param_shape: torch.Size) -> tuple[int, ...]:
        """Shape of the checkpoint tensor for our parameter of ``param_shape``."""
        return (param_shape[2], param_shape[1]) if self.expert is not None else tuple(param_shape)

    def to_ours(self, hf_tensor: torch.Tensor) -> torch.Tensor:
        if self.row_index is not None:
            hf_tensor = hf_tensor[self.row_index]
        return hf_tensor.t() if self.expert is not None else hf_tensor

    def to_hf(self, ours: torch.Tensor) -> torch.Tensor:
        """``ours`` is the whole parameter; returns the checkpoint tensor (contiguous)."""
        if self.expert is not None:
            return ours[self.expert].t().contiguous()
        if self.row_index is not None:
            return ours[torch.argsort(self.row_index)].contiguous()
        return ours.contiguous()


def interleave_to_half_rows(rope_dim: int) -> torch.Tensor:
    """P with ours = theirs[P] for one rotary block: even pair members first, then odd ones."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def _q_rows(attn: MLAConfig) -> torch.Tensor:
    nope, rope, head = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.qk_head_dim
    rows = torch.arange(attn.num_heads * head)
    perm = interleave_to_half_rows(rope)
    for h in range(attn.num_heads):
        rows[h * head + nope:(h + 1) * head] = h * head + nope + perm
    return rows


def _kv_down_rows(attn: MLAConfig) -> torch.Tensor:
    rows = torch.arange(attn.kv_lora_rank + attn.qk_rope_head_dim)
    rows[attn.kv_lora_rank:] = attn.kv_lora_rank + interleave_to_half_rows(attn.qk_rope_head_dim)
    return rows


def _attention_specs(cfg: ModelConfig, ours: str, hf_prefix: str, rope_interleave: bool) -> Iterator[TensorSpec]:
    attn = cfg.attention
    if isinstance(attn, MLAConfig):
        q_rows = _q_rows(attn) if rope_interleave else None
        kv_rows = _kv_down_rows(attn) if rope_interleave else None
        if attn.q_lora_rank:
            yield TensorSpec(f"{hf_prefix}.q_a_proj.weight", f"{ours}.q_down.weight")
            yield TensorSpec(f"{hf_prefix}.q_a_layernorm.weight", f"{ours}.q_norm.weight")
            yield TensorSpec(f"{hf_prefix}.q_b_proj.weight", f"{ours}.q_up.weight", row_index=q_rows)
        else:
            yield TensorSpec(f"{hf_prefix}.q_proj.weight", f"{ours}.q_proj.weight", row_index=q_rows)
        yield TensorSpec(f"{hf_prefix}.kv_a_proj_with_mqa.weight", f"{ours}.kv_down.weight", row_index=kv_rows)
        yield TensorSpec(f"{hf_prefix}.kv_a_layernorm.weight", f"{ours}.kv_norm.weight")
        yield TensorSpec(f"{hf_prefix}.kv_b_proj.weight", f"{ours}.kv_up.weight")
        yield TensorSpec(f"{hf_prefix}.o_proj.weight", f"{ours}.o_proj.weight")
        return
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        yield TensorSpec(f"{hf_prefix}.{proj}.weight", f"{ours}.{proj}.weight")
    if attn.qk_norm:
        yield TensorSpec(f"{hf_prefix}.q_norm.weight", f"{ours}.q_norm.weight")
        yield TensorSpec(f"{hf_prefix}.k_norm.weight", f"{ours}.k_norm.weight")


# Per-expert projection names in the checkpoint: (gate, up, down).
_EXPERT_NAMES = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("gate_proj", "up_proj", "down_proj"),
    PANGU_FAMILY: ("gate_proj", "up_proj", "down_proj"),
}


def moe_prefix(family: str, i: int) -> str:
    return f"model.layers.{i}.block_sparse_moe" if family == "mixtral" else f"model.layers.{i}.mlp"


def _ffn_specs(cfg: ModelConfig, family: str, ours_layer: str, hf_layer: str, moe: bool) -> Iterator[TensorSpec]:
    if not moe:
        for ours, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            yield TensorSpec(f"{hf_layer}.mlp.{hf}.weight", f"{ours_layer}.ffn.{ours}.weight")
        return
    assert cfg.moe is not None
    hf = f"{hf_layer}.block_sparse_moe" if family == "mixtral" else f"{hf_layer}.mlp"
    ours = f"{ours_layer}.moe"
    yield TensorSpec(f"{hf}.gate.weight", f"{ours}.router.weight")
    if family == "deepseek_v3" or (family == PANGU_FAMILY and cfg.moe.router.score_bias):
        yield TensorSpec(f"{hf}.gate.e_score_correction_bias", f"{ours}.router.score_bias")
    gate, up, down = _EXPERT_NAMES[family]
    for e in range(cfg.moe.num_experts):
        yield TensorSpec(f"{hf}.experts.{e}.{gate}.weight", f"{ours}.experts.w_gate_EDF", expert=e)
        yield TensorSpec(f"{hf}.experts.{e}.{up}.weight", f"{ours}.experts.w_up_EDF", expert=e)
        yield TensorSpec(f"{hf}.experts.{e}.{down}.weight", f"{ours}.experts.w_down_EFD", expert=e)
    if cfg.moe.num_shared_experts:
        for ours_name, hf_name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            yield TensorSpec(f"{hf}.shared_experts.{hf_name}.weight", f"{ours}.shared_expert.{ours_name}.weight")


def _layer_specs(cfg: ModelConfig, family: str, ours: str, hf: str, moe: bool,
                 rope_interleave: bool) -> Iterator[TensorSpec]:
    """One decoder layer: ours ``layers.{i}`` (or an MTP module's ``mtp.{j}.layer``), theirs ``hf``."""
    yield TensorSpec(f"{hf}.input_layernorm.weight", f"{ours}.attn_norm.weight")
    yield from _attention_specs(cfg, f"{ours}.attention", f"{hf}.self_attn", rope_interleave)
    yield TensorSpec(f"{hf}.post_attention_layernorm.weight", f"{ours}.ffn_norm.weight")
    if cfg.norm_style == "sandwich":  # moetrain_pangu only (hf_family_for)
        yield TensorSpec(f"{hf}.attention_output_layernorm.weight", f"{ours}.attn_post_norm.weight")
        yield TensorSpec(f"{hf}.mlp_output_layernorm.weight", f"{ours}.ffn_post_norm.weight")
    yield from _ffn_specs(cfg, family, ours, hf, moe)


def _mtp_specs(cfg: ModelConfig, family: str, j: int) -> Iterator[TensorSpec]:
    """Multi-token-prediction module j (moetrain_pangu keeps them; the other families drop them)."""
    ours, hf = f"mtp.{j}", f"model.mtp_layers.{j}"
    for part in ("hidden_norm", "embed_norm", "proj", "final_norm"):
        yield TensorSpec(f"{hf}.{part}.weight", f"{ours}.{part}.weight")
    yield from _layer_specs(cfg, family, f"{ours}.layer", f"{hf}.layer", cfg.moe is not None, False)


def tensor_specs(cfg: ModelConfig, family: str, rope_interleave: bool = False) -> list[TensorSpec]:
    """Every checkpoint tensor of ``cfg`` in the per-expert layout, in checkpoint order."""
    specs = [TensorSpec("model.embed_tokens.weight", "embed.weight")]
    for i in range(cfg.num_layers):
        specs.extend(_layer_specs(cfg, family, f"layers.{i}", f"model.layers.{i}", cfg.is_moe_layer(i),
                                  rope_interleave))
    specs.append(TensorSpec("model.norm.weight", "final_norm.weight"))
    if not cfg.tie_embeddings:
        specs.append(TensorSpec("lm_head.weight", "head.weight"))
    if family == PANGU_FAMILY:
        for j in range(cfg.num_mtp_layers):
            specs.extend(_mtp_specs(cfg, family, j))
    return specs


# A fused expert tensor fills every expert of one or two stacked parameters at once.
FusedFill = Callable[[torch.Tensor], list[tuple[str, torch.Tensor]]]


def fused_expert_specs(cfg: ModelConfig, family: str) -> dict[str, tuple[FusedFill, list[tuple[str, int]]]]:
    """transformers-5 in-memory layout: ``experts.gate_up_proj [E, 2F, D]`` (gate rows first) and
    ``experts.down_proj [E, D, F]``; maps each name to (splitter, the (param, expert) pieces it fills)."""
    if cfg.moe is None:
        return {}
    num_experts, ffn = cfg.moe.num_experts, cfg.moe.expert_ffn_hidden
    out: dict[str, tuple[FusedFill, list[tuple[str, int]]]] = {}
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        ours = f"layers.{i}.moe.experts"
        gate, up, down = f"{ours}.w_gate_EDF", f"{ours}.w_up_EDF", f"{ours}.w_down_EFD"

        def split_gate_up(t: torch.Tensor, gate: str = gate, up: str = up) -> list[tuple[str, torch.Tensor]]:
            return [(gate, t[:, :ffn].transpose(1, 2)), (up, t[:, ffn:].transpose(1, 2))]

        def split_down(t: torch.Tensor, down: str = down) -> list[tuple[str, torch.Tensor]]:
            return [(down, t.transpose(1, 2))]

        for prefix in {moe_prefix(family, i), f"model.layers.{i}.mlp"}:
            out[f"{prefix}.experts.gate_up_proj"] = (
                split_gate_up, [(p, e) for p in (gate, up) for e in range(num_experts)])
            out[f"{prefix}.experts.down_proj"] = (split_down, [(down, e) for e in range(num_experts)])
    return out


def canonical_name(name: str, family: str) -> str:
    """Accept the spellings transformers 5 renames on load (Mixtral's ``.mlp.`` for ``.block_sparse_moe.``)."""
    if family == "mixtral" and ".mlp." in name and ".experts.gate_up_proj" not in name \
            and not name.endswith(".experts.down_proj"):
        return name.replace(".mlp.", ".block_sparse_moe.")
    return name
