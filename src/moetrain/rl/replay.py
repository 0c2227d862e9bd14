"""Router replay: recording the experts generation chose, and measuring what replay changes.

MoE RL breaks when generation and training route the same token to different experts: the trainer's
log-prob is then that of another sub-network, and importance ratios stop meaning anything (rl-anchors
§A.3 item 5). The rollout engine records, per decoder MoE layer, the experts every input token used;
training passes that record as ``expert_ids`` and the routers use those experts (``Router.forward``),
their gating weights still the trainer's own scores, so the routers keep learning.

A record is int64 [B, S, M, K]: batch row, sequence position, decoder MoE layer (``decoder_moe_layers``
order), the k experts. -1 marks a position without a record (padding, the last generated token, which
is never an input); those positions keep the router's own choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetrain.models.transformer import MoETransformer, decoder_moe_layers


def decoder_layers(model: MoETransformer) -> list[nn.Module]:
    """Decoder layers in order, for a plain model (``ModuleList``) or a parallelized one (``ModuleDict``)."""
    layers = model.layers
    return [layers[key] for key in sorted(layers, key=int)] if isinstance(layers, nn.ModuleDict) else list(layers)


class RoutingRecorder:
    """Within ``with recorder:``, keeps the experts each decoder MoE router chose on its latest call."""

    def __init__(self, model: MoETransformer) -> None:
        layers = decoder_layers(model)
        self.routers = [layers[i].moe.router for i in decoder_moe_layers(model.cfg)]
        self._handles: list = []

    def __enter__(self) -> RoutingRecorder:
        self._forget()
        self._handles = [router.register_forward_hook(_keep_latest_choice) for router in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._forget()

    def _forget(self) -> None:
        for router in self.routers:
            router.latest_expert_ids_TK = None

    def take(self, batch: int, queries: int) -> torch.Tensor | None:
        """The last call's choices as [B, Q, M, K] (None for a model without MoE layers)."""
        if not self.routers:
            return None
        latest = [router.latest_expert_ids_TK for router in self.routers]
        assert all(ids is not None for ids in latest), "a MoE layer did not run"
        self._forget()
        return torch.stack([ids.view(batch, queries, -1) for ids in latest], dim=2)  # type: ignore[union-attr]


def _keep_latest_choice(router: nn.Module, args: tuple, routing) -> None:
    # One hook for every router, keeping the choice on the router itself: a hook closing over its layer's
    # index made torch.compile guard on that index and build one graph per MoE layer, and past its
    # recompile limit (8) run the remaining layers eager.
    router.latest_expert_ids_TK = routing.expert_ids_TK.detach()


@dataclass(frozen=True)
class ReplayStats:
    """How far the trainer's own routing strays from generation's, over the recorded tokens."""

    layer_mismatch: float
    """Share of (token, MoE layer) pairs whose set of experts differs."""
    token_mismatch: float
    """Share of tokens whose experts differ in at least one MoE layer."""
    num_tokens: int


def routing_mismatch(recorded_BSMK: torch.Tensor, chosen_BSMK: torch.Tensor, mask_BS: torch.Tensor) -> ReplayStats:
    """Compare two records as expert *sets* (order within the top-k does not matter) on ``mask`` tokens."""
    same_BSM = (recorded_BSMK.sort(-1).values == chosen_BSMK.sort(-1).values).all(-1)
    valid_BS = mask_BS & (recorded_BSMK[..., 0, 0] >= 0)
    num_tokens = int(valid_BS.sum())
    if num_tokens == 0 or same_BSM.shape[-1] == 0:
        return ReplayStats(0.0, 0.0, num_tokens)
    differs_BSM = ~same_BSM & valid_BS.unsqueeze(-1)
    layer = float(differs_BSM.sum()) / (num_tokens * same_BSM.shape[-1])
    token = float(differs_BSM.any(-1).sum()) / num_tokens
    return ReplayStats(layer, token, num_tokens)
