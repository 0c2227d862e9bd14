"""The MoE block: router → dispatch → grouped experts → combine, plus the shared expert.

Dropless: every (token, expert) assignment is computed. The dispatcher is swappable: the local one
by default; ``moetrain.distributed`` installs an expert-parallel one (flat or hierarchical
all-to-all) that owns only this rank's slice of the experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from moetrain.config.model import MoEConfig
from moetrain.models.dispatch import LocalDispatcher
from moetrain.models.experts import GroupedExperts, SwiGLU
from moetrain.models.router import Router, Routing


class PendingDispatch(Protocol):
    def finish(self) -> tuple[torch.Tensor, torch.Tensor, object]: ...


class Dispatcher(Protocol):
    def start_dispatch(self, x_TD: torch.Tensor, routing: Routing) -> PendingDispatch: ...

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, object]: ...

    def combine(self, y_PD: torch.Tensor, meta: object) -> torch.Tensor: ...


@dataclass(frozen=True)
class MoEOutput:
    out_TD: torch.Tensor
    aux_loss: torch.Tensor
    tokens_per_expert_E: torch.Tensor


class MoE(nn.Module):
    def __init__(self, hidden: int, cfg: MoEConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(hidden, cfg.num_experts, cfg.router, device=device)
        self.experts = GroupedExperts(cfg.num_experts, hidden, cfg.expert_ffn_hidden, device=device)
        self.shared_expert = SwiGLU(hidden, cfg.shared_ffn_hidden, device=device) if cfg.num_shared_experts else None
        self.dispatcher: Dispatcher = LocalDispatcher()

    def forward(self, x_BSD: torch.Tensor, replay_TK: torch.Tensor | None = None) -> MoEOutput:
        """``replay_TK``: the experts to use per token (router replay, see ``Router.forward``)."""
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        routing = self.router(x_TD, replay_TK)
        pending = self.dispatcher.start_dispatch(x_TD, routing)
        # The shared expert needs no dispatch: computed here, it runs while an expert-parallel
        # dispatcher's exchange is in flight.
        shared_TD = self.shared_expert(x_TD) if self.shared_expert is not None else None
        tokens_PD, tokens_per_local_expert, meta = pending.finish()
        expert_out_PD = self.experts(tokens_PD, tokens_per_local_expert)
        out_TD = self.dispatcher.combine(expert_out_PD, meta)
        if shared_TD is not None:
            out_TD = out_TD + shared_TD
        return MoEOutput(out_TD.view_as(x_BSD), routing.aux_loss, routing.tokens_per_expert_E)
