"""GRPO: group-normalised advantages and the clipped, importance-weighted token loss.

Advantages (Shao et al. 2024, DeepSeekMath §4.1): G samples per prompt; sample i of a group gets
``A_i = (r_i − mean(r)) / (std(r) + ε)`` (unbiased std, as TRL), the same for each of its tokens.
``scale_rewards=False`` drops the division (Dr. GRPO, Liu et al. 2025).

Loss per completion token t (three policies: π_θ being trained, π_old the trainer's own weights
before this update, μ the rollout engine that sampled the token):

    r_t   = π_θ(t) / π_old(t)                          ratio of the update (PPO)
    L_t   = −min(r_t·A, clip(r_t, 1−ε_low, 1+ε_high)·A) · w_t  +  β·KL_t
    w_t   = min(π_old(t) / μ(t), C)                     truncated importance weight (TIS)
    KL_t  = exp(ref − logπ_θ) − (ref − logπ_θ) − 1       k3 estimator of KL(π_θ ‖ π_ref)

π_old and μ are the same weights, yet not the same numbers: the two engines round differently and,
in an MoE, may route differently. w_t corrects the sample for that gap; truncating it at C keeps one
mismatched token from dominating the batch ("Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training", and TRL's/OpenRLHF's vLLM importance correction). With one optimizer step per
rollout batch, π_old is π_θ before the step: ``old_logp=None`` takes ``logπ_θ.detach()`` (r = 1 in value,
∇r = ∇logπ_θ), as TRL does; pass ``old_logp`` when a batch serves several updates. The same form covers
stale samples (the StaleSync issue): μ is then an older version and w_t carries the correction.

Aggregation is token-level (DAPO, Yu et al. 2025): the sum over every completion token of the global
batch divided by their number, which is the runtime's own loss normalisation (label tokens of the
global batch), so micro-batches and data-parallel ranks add up to the same gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moetrain.models.transformer import IGNORE_INDEX
from moetrain.rl.config import GRPOConfig


def group_advantages(rewards_B: torch.Tensor, group_size: int, scale_rewards: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """Per sample; rows ``g·G … g·G+G−1`` are the group of prompt g."""
    groups_PG = rewards_B.float().view(-1, group_size)
    centred_PG = groups_PG - groups_PG.mean(dim=1, keepdim=True)
    if scale_rewards:
        centred_PG = centred_PG / (groups_PG.std(dim=1, keepdim=True) + eps)
    return centred_PG.reshape(-1)


def token_logprobs(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of each label token in fp32; 0 where the label is ignored."""
    logits_BSV = logits_BSV.float()
    if temperature != 1.0:  # x / 1.0 is x: skip a pass over the logits (and its backward)
        logits_BSV = logits_BSV / temperature
    logp_BSV = logits_BSV.log_softmax(dim=-1)
    logp_BS = logp_BSV.gather(-1, labels_BS.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logp_BS.masked_fill(labels_BS == IGNORE_INDEX, 0.0)


@dataclass(frozen=True)
class TokenLoss:
    """Per-token terms of the loss (each of the log-probs' shape, [B, S] or [T]; zero outside the mask)."""

    loss_BS: torch.Tensor
    ratio_BS: torch.Tensor
    is_weight_BS: torch.Tensor
    clipped_BS: torch.Tensor
    """Where the clip is active (the gradient of the token is cut)."""
    truncated_BS: torch.Tensor
    """Where the importance weight hit its cap."""
    kl_BS: torch.Tensor | None


@dataclass(frozen=True)
class ScoredTokens:
    """What the loss knows of the scored tokens besides the trained policy's log-probs (each tensor of their
    shape, [B, S] or [T]): the rollout's (μ's) log-probs, the advantages and the mask; π_old's log-probs (the
    decoupled loss's proximal policy; None: the trained weights) and the reference model's (the KL term)."""

    rollout_logp_BS: torch.Tensor
    advantages_BS: torch.Tensor
    mask_BS: torch.Tensor
    old_logp_BS: torch.Tensor | None = None
    ref_logp_BS: torch.Tensor | None = None


def grpo_token_loss(logp_BS: torch.Tensor, tokens: ScoredTokens, cfg: GRPOConfig) -> TokenLoss:
    rollout_logp_BS, advantages_BS, ref_logp_BS = tokens.rollout_logp_BS, tokens.advantages_BS, tokens.ref_logp_BS
    mask_BS = tokens.mask_BS.to(logp_BS.dtype)
    old_BS = logp_BS.detach() if tokens.old_logp_BS is None else tokens.old_logp_BS
    ratio_BS = torch.exp(logp_BS - old_BS)
    clipped_ratio_BS = ratio_BS.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    policy_BS = -torch.min(ratio_BS * advantages_BS, clipped_ratio_BS * advantages_BS)
    raw_weight_BS = torch.exp(old_BS - rollout_logp_BS).detach()
    is_weight_BS = raw_weight_BS.clamp(max=cfg.is_cap)
    loss_BS = policy_BS * is_weight_BS
    kl_BS = None
    if cfg.kl_coef:
        assert ref_logp_BS is not None, "a KL term needs the reference model's log-probs"
        delta_BS = ref_logp_BS - logp_BS
        kl_BS = (torch.exp(delta_BS) - delta_BS - 1) * mask_BS
        loss_BS = loss_BS + cfg.kl_coef * kl_BS
    clipped_BS = ((ratio_BS < 1 - cfg.clip_low) & (advantages_BS < 0)) | ((ratio_BS > 1 + cfg.clip_high)
                                                                          & (advantages_BS > 0))
    return TokenLoss(loss_BS * mask_BS, ratio_BS.detach() * mask_BS, is_weight_BS * mask_BS,
                     clipped_BS & (mask_BS > 0), (raw_weight_BS > cfg.is_cap) & (mask_BS > 0), kl_BS)


def grpo_loss(logp_BS: torch.Tensor, tokens: ScoredTokens, cfg: GRPOConfig) -> torch.Tensor:
    """Token-level mean of the loss over the masked tokens of one batch."""
    return grpo_token_loss(logp_BS, tokens, cfg).loss_BS.sum() / tokens.mask_BS.sum().clamp(min=1)


STAT_FIELDS = ("tokens", "logp_sum", "gap_abs_sum", "clipped", "is_weight_sum", "truncated", "kl_sum")
"""What the objective sums over the step's completion tokens (all-reduced by the RL loop)."""


@dataclass
class StepStats:
    """Device accumulators one step's micro-batches add to: sums of ``STAT_FIELDS`` and the largest
    |logπ_θ − logμ| (reduced with max)."""

    sums: torch.Tensor
    gap_abs_max: torch.Tensor
    logprobs: list[torch.Tensor] | None = None
    """When a list: every micro-batch's trainer log-probs of its completion tokens [T] (tests of the
    train/generate gap)."""

    @classmethod
    def zeros(cls, device: torch.device, keep_logprobs: bool = False) -> StepStats:
        return cls(torch.zeros(len(STAT_FIELDS), dtype=torch.float64, device=device),
                   torch.zeros((), dtype=torch.float64, device=device), [] if keep_logprobs else None)

    def add(self, logp_BS: torch.Tensor, rollout_logp_BS: torch.Tensor, mask_BS: torch.Tensor,
            terms: TokenLoss) -> None:
        mask_BS = mask_BS.to(torch.float64)
        gap_BS = (logp_BS.detach().double() - rollout_logp_BS.double()).abs() * mask_BS
        kl = terms.kl_BS.detach().double().sum() if terms.kl_BS is not None else gap_BS.new_zeros(())
        self.sums += torch.stack([mask_BS.sum(), (logp_BS.detach().double() * mask_BS).sum(), gap_BS.sum(),
                                  terms.clipped_BS.sum().double(), terms.is_weight_BS.double().sum(),
                                  terms.truncated_BS.sum().double(), kl])
        self.gap_abs_max.copy_(torch.maximum(self.gap_abs_max, gap_BS.max() if gap_BS.numel() else self.gap_abs_max))
        if self.logprobs is not None:
            self.logprobs.append(logp_BS.detach().clone())

    def summary(self, sums: list[float], gap_abs_max: float) -> dict[str, float]:
        values = dict(zip(STAT_FIELDS, sums))
        tokens = max(values["tokens"], 1.0)
        summary = {"completion_tokens": values["tokens"], "nll": -values["logp_sum"] / tokens,
                   "logp_gap_mean": values["gap_abs_sum"] / tokens, "logp_gap_max": gap_abs_max,
                   "clip_frac": values["clipped"] / tokens, "is_weight_mean": values["is_weight_sum"] / tokens,
                   "is_truncated_frac": values["truncated"] / tokens}
        if values["kl_sum"]:
            summary["kl"] = values["kl_sum"] / tokens
        return summary


@dataclass(frozen=True)
class OtherLogprobs:
    """The step's rows' log-probs [B, S] under the two other policies the loss may read: the reference model's
    (the KL term; None: no KL) and π_old's (the decoupled loss's proximal policy; None: the trained weights)."""

    ref_logp_BS: torch.Tensor | None = None
    old_logp_BS: torch.Tensor | None = None


@dataclass
class PolicyObjective:
    """GRPO as the runtime's per-token objective (``distributed.pipeline.TokenObjective``) of one
    micro-batch. It scores only the micro-batch's completion tokens: ``index_T`` holds their flat
    positions in its [B, S] sequences (row-major), and every per-token tensor is [T], in that order. The
    runtime computes the output head at those positions only: a completion is a few tokens of a sequence
    that is mostly prompt and padding, and the head with its log-softmax over the vocabulary is the
    largest single piece of a small policy's step."""

    index_T: torch.Tensor
    labels_T: torch.Tensor
    rollout_logp_T: torch.Tensor
    advantages_T: torch.Tensor
    cfg: GRPOConfig
    stats: StepStats
    ref_logp_T: torch.Tensor | None = None
    old_logp_T: torch.Tensor | None = None

    @classmethod
    def of_rows(cls, labels_BS: torch.Tensor, rollout_logp_BS: torch.Tensor, advantages_BS: torch.Tensor,
                cfg: GRPOConfig, stats: StepStats, others: OtherLogprobs = OtherLogprobs()) -> PolicyObjective:
        """From full-sequence [B, S] host tensors (the label positions are found here, on the host, before
        the step: inside it they would be a data-dependent shape)."""
        index_T = label_positions(labels_BS)
        take = lambda t_BS: None if t_BS is None else t_BS.reshape(-1).index_select(0, index_T)
        return cls(index_T, take(labels_BS), take(rollout_logp_BS), take(advantages_BS), cfg, stats,
                   take(others.ref_logp_BS), take(others.old_logp_BS))

    def to(self, device: torch.device) -> PolicyObjective:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        return replace(self, index_T=move(self.index_T), labels_T=move(self.labels_T),
                       rollout_logp_T=move(self.rollout_logp_T), advantages_T=move(self.advantages_T),
                       ref_logp_T=move(self.ref_logp_T), old_logp_T=move(self.old_logp_T))

    def loss_sum(self, logits_TV: torch.Tensor) -> torch.Tensor:
        """The summed loss over the scored tokens, from their logits [T, V] (rows in ``index_T``'s order)."""
        mask_T = torch.ones_like(self.labels_T, dtype=torch.bool)
        logp_T = token_logprobs(logits_TV, self.labels_T, self.cfg.temperature)
        terms = grpo_token_loss(logp_T, ScoredTokens(self.rollout_logp_T, self.advantages_T, mask_T, self.old_logp_T,
                                                     self.ref_logp_T), self.cfg)
        self.stats.add(logp_T, self.rollout_logp_T, mask_T, terms)
        return terms.loss_BS.sum()


def label_positions(labels_BS: torch.Tensor) -> torch.Tensor:
    """Flat (row-major) positions of the label tokens of [B, S] labels: int64 [T]."""
    return (labels_BS.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
