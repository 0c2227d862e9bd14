"""Top-k router, all math in fp32.

Scores: softmax (Mixtral, Qwen3) or sigmoid (DeepSeek-V3, Pangu) of ``x·Wᵀ``. Selection may add an
aux-loss-free bias (DeepSeek-V3 §2.1.2: a per-expert bias that only steers the choice) and may be
group-limited (experts in ``num_groups`` groups; a token only uses its ``num_top_groups`` best groups,
a group scored by its top-2 sigmoid scores, or its max softmax score). Gating weights are the
unbiased scores of the chosen experts, optionally renormalised over the k, times ``scaling_factor``.

Balance losses (added to the training loss, scaled by their coefficients):
- expert level (Switch Transformer, Fedus et al. 2021): E · Σ_e f_e · P_e, f_e the fraction of the
  T·k assignments that went to expert e and P_e the mean normalised score of e;
- device level (DeepSeek-V2 §2.2.2; Pangu balances EP groups, not experts): the same with the E
  experts folded into D contiguous groups: D · Σ_d f_d · P_d;
- z-loss (ST-MoE, Zoph et al. 2022): mean over tokens of logsumexp(logits)².
All three equal their minimum (1, 1, −) under perfectly uniform routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetrain.config.model import RouterConfig


@dataclass(frozen=True)
class Routing:
    """The router's decision for T tokens."""

    expert_ids_TK: torch.Tensor
    """Chosen logical experts, int64 [T, k]."""
    weights_TK: torch.Tensor
    """Gating weights in fp32 [T, k] (renormalised and scaled)."""
    tokens_per_expert_E: torch.Tensor
    """Assignments per logical expert, int64 [E], computed on device without a host sync."""
    aux_loss: torch.Tensor
    """Weighted sum of the balance and z losses (fp32 scalar)."""


def count_tokens_per_expert(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Histogram of expert ids by scatter-add: unlike ``bincount`` it never reads the max back to the host."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=expert_ids.device)
    return counts.scatter_add_(0, expert_ids.reshape(-1), torch.ones_like(expert_ids.reshape(-1)))


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, cfg: RouterConfig,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg, self.num_experts = cfg, num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device))
        # Not a parameter: the aux-loss-free bias moves by a sign rule, not by gradient.
        self.register_buffer("score_bias", torch.zeros(num_experts, device=device), persistent=cfg.score_bias)

    def scores(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits_TE = x_TD.float() @ self.weight.float().t()
        if self.cfg.score_function == "softmax":
            return logits_TE, logits_TE.softmax(dim=-1)
        return logits_TE, logits_TE.sigmoid()

    def _select(self, scores_TE: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        choice_TE = scores_TE + self.score_bias if cfg.score_bias else scores_TE
        if cfg.num_groups > 1:
            tokens = choice_TE.shape[0]
            grouped = choice_TE.view(tokens, cfg.num_groups, -1)
            if cfg.score_function == "sigmoid":
                group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            else:
                group_score = grouped.max(dim=-1).values
            top_groups = group_score.topk(cfg.num_top_groups, dim=-1).indices
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, top_groups, True)
            choice_TE = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, -1)
        return choice_TE.topk(cfg.top_k, dim=-1).indices

    def forward(self, x_TD: torch.Tensor, replay_TK: torch.Tensor | None = None) -> Routing:
        """``replay_TK``: router replay (R3, arXiv 2510.11370), the experts an earlier pass chose for these
        tokens (int64 [T, k]; a row of -1 keeps this router's own choice). The gating weights are still
        this router's scores of the replayed experts, so the router keeps its gradient."""
        cfg = self.cfg
        logits_TE, scores_TE = self.scores(x_TD)
        expert_ids_TK = self._select(scores_TE.detach())
        if replay_TK is not None:
            expert_ids_TK = torch.where(replay_TK[:, :1] >= 0, replay_TK, expert_ids_TK)
        weights_TK = scores_TE.gather(1, expert_ids_TK)
        if cfg.normalize_top_k:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        weights_TK = weights_TK * cfg.scaling_factor
        tokens_per_expert = count_tokens_per_expert(expert_ids_TK, self.num_experts)
        aux = self.balance_losses(logits_TE, scores_TE, tokens_per_expert)
        return Routing(expert_ids_TK, weights_TK, tokens_per_expert, aux)

    def balance_losses(self, logits_TE: torch.Tensor, scores_TE: torch.Tensor,
                       tokens_per_expert: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        aux = logits_TE.new_zeros(())
        if not (cfg.expert_balance_coef or cfg.device_balance_coef or cfg.z_loss_coef):
            return aux
        tokens = scores_TE.shape[0]
        fraction_E = tokens_per_expert.float() / (tokens * cfg.top_k)
        probs_E = (scores_TE / scores_TE.sum(-1, keepdim=True)).mean(0)
        if cfg.expert_balance_coef:
            aux = aux + cfg.expert_balance_coef * self.num_experts * (fraction_E * probs_E).sum()
        if cfg.device_balance_coef:
            # Groups are contiguous LOGICAL experts, whatever the runtime's placement: the loss is
            # part of the model's objective, so online expert balancing (which moves and replicates
            # experts) must not change it; a migrated run then trains exactly as an unmigrated one.
            # The placement absorbs the imbalance instead (benchmarks/notes/balance.md, "The device-level
            # balance loss keeps the logical grouping").
            groups = cfg.num_device_groups
            fraction_D = fraction_E.view(groups, -1).sum(-1)
            probs_D = probs_E.view(groups, -1).sum(-1)
            aux = aux + cfg.device_balance_coef * groups * (fraction_D * probs_D).sum()
        if cfg.z_loss_coef:
            aux = aux + cfg.z_loss_coef * torch.logsumexp(logits_TE, dim=-1).pow(2).mean()
        return aux

    @torch.no_grad()
    def update_bias(self, tokens_per_expert_E: torch.Tensor) -> None:
        """Aux-loss-free step: raise the bias of under-loaded experts, lower over-loaded ones."""
        if not self.cfg.score_bias:
            return
        load = tokens_per_expert_E.float()
        self.score_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)
