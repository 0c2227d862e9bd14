"""The step executor: runs one rank's schedule (a list of F/B actions) over its model chunks.

A chunk's forward is the slice of ``MoETransformer.forward`` it owns: the embedding on the first
chunk, its decoder layers, and on the last chunk the head, the multi-token-prediction modules and the
loss. Every chunk also returns the sum of its MoE layers' balance losses (scaled), which joins the
backward of that chunk, so each layer's auxiliary gradient is produced where the layer lives.

Activations move between pipeline ranks by point-to-point messages: sends are non-blocking (their
handles are waited at the end of the step), receives block when the action needs the tensor. Tags
name (micro-batch, chunk, direction), so messages cannot be confused. The schedules of
``moetrain.schedules`` are deadlock-free under this rule. An ``Overlapped`` step receives
both of its inputs first, then runs its forward and backward taking turns at every exchange
(``moetrain.distributed.overlap``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from moetrain.distributed.cp import ContextParallel
from moetrain.distributed.overlap import flush_weight_grads, run_pair, set_split_grads
from moetrain.distributed.parallelize import Chunk, StageModel
from moetrain.distributed.tp import gather_sequence, split_sequence
from moetrain.distributed.trace import span
from moetrain.models.attention import AttentionContext, DocumentMask, build_attention_context
from moetrain.models.transformer import (
    IGNORE_INDEX,
    MoETransformer,
    decoder_moe_layers,
    layer_replay,
    shift_left,
    token_loss_sum,
)
from moetrain.runtime_base.precision import autocast
from moetrain.schedules import Action, Overlapped, Step


class TokenObjective(Protocol):
    """A per-token objective that replaces next-token cross-entropy on the last chunk (RL: the policy loss
    of ``moetrain.rl.grpo``). It scores only some tokens of the micro-batch's full sequences, whose flat
    positions it names; the head runs at those positions only."""

    index_T: torch.Tensor
    """Flat (row-major) positions in the micro-batch's [B, S] sequences of the T tokens it scores."""

    def to(self, device: torch.device) -> TokenObjective: ...

    def loss_sum(self, logits_TV: torch.Tensor) -> torch.Tensor:
        """The summed loss over the scored tokens, from their logits (the step divides it by the global
        label count)."""
        ...


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor | None = None
    """Document of each token (packed corpus data): attention is masked across documents."""
    objective: TokenObjective | None = None
    """Replaces the language-model loss when set (RL); the MTP loss, if any, stays next-token."""
    expert_ids: torch.Tensor | None = None
    """Router replay: the experts each token must use, int64 [B, S, M, K] over the M decoder MoE layers."""
    boundary_rows: torch.Tensor | None = None
    """With ``document_ids``: the rows that hold a document boundary (int64 [R], found on the host), the only
    ones the attention masks (``models.attention``); None: every row is masked."""


@dataclass
class StepContext:
    """What every chunk of one step shares."""

    loss_normalizer: torch.Tensor
    aux_loss_scale: float
    micro_batches: list[MicroBatch]
    hidden_shapes: list[tuple[int, ...]]
    """Per micro-batch, the activation a stage sends on (micro-batches may differ in length: RL cuts each
    to its longest sample)."""
    dtype: torch.dtype
    device: torch.device
    loss_sum: torch.Tensor
    """This rank's share of the reported step loss (summed over ranks afterwards)."""
    tp_group: dist.ProcessGroup | None = None
    """Set under tensor parallelism: the residual stream is split along the sequence over it."""
    saved: dict[tuple[int, int], tuple] = field(default_factory=dict)
    pending_sends: list = field(default_factory=list)
    loss_parts: torch.Tensor | None = None
    """When set ([3] zeros): this rank's summed (lm loss, MTP loss, scaled aux loss), for metrics."""
    tokens_per_expert: dict[int, torch.Tensor] | None = None
    """When set ({}): tokens this rank routed to each expert, summed over micro-batches, keyed by MoE
    layer index (MTP module j as ``num_layers + j``)."""
    autocast_dtype: torch.dtype | None = None
    """Forward passes run under autocast to this dtype (None: the parameters' dtype)."""
    document_mask: DocumentMask = "dense"
    """How attention masks packed documents (``moetrain.models.attention``); context parallelism is dense."""


def _record_counts(step: StepContext, layer: int, counts: torch.Tensor | None) -> None:
    if step.tokens_per_expert is None or counts is None:
        return
    counts = counts.detach()
    previous = step.tokens_per_expert.get(layer)
    step.tokens_per_expert[layer] = counts if previous is None else previous + counts


def _local_replay(expert_ids_BSMK: torch.Tensor | None, local: Callable[[torch.Tensor], torch.Tensor],
                  tp_group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """This rank's tokens of a replay record, in the order its layers see them: the context-parallel
    share, then the sequence shard of tensor parallelism (``split_sequence``'s contiguous chunks)."""
    if expert_ids_BSMK is None:
        return None
    ids = local(expert_ids_BSMK)
    if tp_group is not None:
        ids = ids.chunk(dist.get_world_size(tp_group), dim=1)[dist.get_rank(tp_group)]
    return ids


@dataclass(frozen=True)
class RankMicroBatch:
    """One micro-batch as this rank's chunks see it: ``mb`` holds full sequences; under context parallelism
    (``cp``) the rank takes its tokens of them (``local``, after the MTP shifts), which ``attn_ctx`` masks."""

    mb: MicroBatch
    attn_ctx: AttentionContext
    cp: ContextParallel | None = None

    def local(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.cp.local_tokens(tokens) if self.cp is not None else tokens


def chunk_forward(model: MoETransformer, chunk: Chunk, x: torch.Tensor | None, batch: RankMicroBatch,
                  step: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, scaled aux loss): the output is the hidden state (this rank's sequence shard under
    tensor and context parallelism), or on the last chunk the loss."""
    tp_group = step.tp_group
    mb, attn_ctx, cp, local = batch.mb, batch.attn_ctx, batch.cp, batch.local
    if chunk.is_first:
        x = model.embed(local(mb.input_ids))
        if tp_group is not None:
            x = split_sequence(x, tp_group)
    assert x is not None
    aux_terms = []
    replay = _local_replay(mb.expert_ids, local, tp_group)
    column = {layer: col for col, layer in enumerate(decoder_moe_layers(model.cfg))}
    for index in chunk.layers:
        x, aux, counts = model.layers[str(index)](x, attn_ctx, layer_replay(replay, column.get(index)))
        _record_counts(step, index, counts)
        if aux is not None:
            aux_terms.append(aux)
    if not chunk.is_last:
        aux = torch.stack(aux_terms).sum() if aux_terms else x.new_zeros((), dtype=torch.float32)
        if step.loss_parts is not None:
            step.loss_parts[2] += (aux * step.aux_loss_scale).detach()
        return x, aux * step.aux_loss_scale
    # The loss exactly as MoETransformer.forward computes it.
    normalizer = step.loss_normalizer
    full = lambda h: gather_sequence(h, tp_group) if tp_group is not None else h
    if mb.objective is not None:
        # the head at the scored tokens only (their positions are of full sequences: RL runs without CP)
        assert cp is None, "a token objective scores full sequences; context parallelism is refused for RL"
        lm_loss = mb.objective.loss_sum(model.logits_at(full(x), mb.objective.index_T)) / normalizer
    else:
        lm_loss = token_loss_sum(model.output_head(model.final_norm(full(x))), local(mb.labels)) / normalizer
    mtp_loss = lm_loss.new_zeros((), dtype=torch.float32)
    hidden, next_ids, next_labels = x, mb.input_ids, mb.labels
    for mtp_index, module in enumerate(model.mtp):
        next_ids = shift_left(next_ids, 0)
        next_labels = shift_left(next_labels, IGNORE_INDEX)
        next_embed = model.embed(local(next_ids))
        if tp_group is not None:
            next_embed = split_sequence(next_embed, tp_group)
        hidden, aux, counts = module(hidden, next_embed, attn_ctx)
        _record_counts(step, model.cfg.num_layers + mtp_index, counts)
        if aux is not None:
            aux_terms.append(aux)
        mtp_logits = model.output_head(module.final_norm(full(hidden)))
        mtp_loss = mtp_loss + token_loss_sum(mtp_logits, local(next_labels)) / normalizer
    if len(model.mtp):
        mtp_loss = mtp_loss / len(model.mtp)
    aux = torch.stack(aux_terms).sum() if aux_terms else lm_loss.new_zeros(())
    loss = lm_loss + model.cfg.mtp_loss_weight * mtp_loss
    if step.loss_parts is not None:
        step.loss_parts += torch.stack([lm_loss, mtp_loss, aux * step.aux_loss_scale]).detach().float()
    return loss, aux * step.aux_loss_scale


class Executor:
    """Runs a list of actions for one rank of one layout."""

    def __init__(self, stage: StageModel) -> None:
        self.stage = stage
        dims = stage.dims
        self.pp = dims.parallel.pp
        self.num_chunks = dims.parallel.pp * dims.parallel.vpp
        pp_ranks = dims.group_ranks["pp"]
        self.next_rank = pp_ranks[(dims.pp_rank + 1) % self.pp]
        self.prev_rank = pp_ranks[(dims.pp_rank - 1) % self.pp]

    def _tag(self, micro_batch: int, chunk_index: int, backward: bool) -> int:
        return (micro_batch * self.num_chunks + chunk_index) * 2 + int(backward)

    def _recv(self, step: StepContext, src: int, micro_batch: int, tag: int) -> torch.Tensor:
        buffer = torch.empty(step.hidden_shapes[micro_batch], dtype=step.dtype, device=step.device)
        with span("pp_recv", "comm"):
            dist.recv(buffer, src=src, tag=tag)
        return buffer

    def _send(self, step: StepContext, tensor: torch.Tensor, dst: int, tag: int) -> None:
        # Activations and their gradients travel in the step's dtype, whatever autocast produced.
        tensor = tensor.detach().to(step.dtype).contiguous()
        step.pending_sends.append((dist.isend(tensor, dst=dst, tag=tag), tensor))

    def receive_input(self, action: Action, step: StepContext) -> torch.Tensor | None:
        """The forward's input activation (None on the first chunk)."""
        chunk = self.stage.chunks[action.chunk]
        if chunk.is_first:
            return None
        x = self._recv(step, self.prev_rank, action.micro_batch, self._tag(action.micro_batch, chunk.index - 1, False))
        return x.requires_grad_(True)

    def receive_grad(self, action: Action, step: StepContext) -> torch.Tensor | None:
        """The backward's output gradient (None on the last chunk, which starts from the loss)."""
        chunk = self.stage.chunks[action.chunk]
        if chunk.is_last:
            return None
        return self._recv(step, self.next_rank, action.micro_batch, self._tag(action.micro_batch, chunk.index, True))

    def forward(self, action: Action, step: StepContext, x: torch.Tensor | None) -> None:
        chunk = self.stage.chunks[action.chunk]
        mb = step.micro_batches[action.micro_batch]
        cp = self.stage.cp
        if cp is not None:
            attn_ctx = cp.attention_context(mb.input_ids, mb.document_ids)
        else:
            attn_ctx = build_attention_context(mb.input_ids, mb.document_ids, document_mask=step.document_mask,
                                               boundary_rows_R=mb.boundary_rows)
        with span(f"F{chunk.index}", "compute"), autocast(step.autocast_dtype, step.device.type):
            out, aux = chunk_forward(self.stage.model, chunk, x, RankMicroBatch(mb, attn_ctx, cp), step)
        if chunk.is_last:
            step.loss_sum += (out + aux).detach()
        else:
            step.loss_sum += aux.detach()
            self._send(step, out, self.next_rank, self._tag(action.micro_batch, chunk.index, False))
        step.saved[(action.chunk, action.micro_batch)] = (x, out, aux)

    def backward(self, action: Action, step: StepContext, grad: torch.Tensor | None) -> None:
        chunk = self.stage.chunks[action.chunk]
        x, out, aux = step.saved.pop((action.chunk, action.micro_batch))
        with span(f"B{chunk.index}", "compute"):
            if chunk.is_last:
                (out + aux).backward()
            elif aux.requires_grad:
                torch.autograd.backward([out, aux], [grad.to(out.dtype), torch.ones_like(aux)])
            else:  # a chunk of dense layers only
                out.backward(grad.to(out.dtype))
            flush_weight_grads()
        if not chunk.is_first:
            assert x is not None and x.grad is not None
            self._send(step, x.grad, self.prev_rank, self._tag(action.micro_batch, chunk.index - 1, True))

    def overlapped(self, pair: Overlapped, step: StepContext) -> None:
        """Both inputs first (the schedule guarantees they can arrive), then the two micro-batches
        taking turns at every exchange (``moetrain.distributed.overlap``)."""
        x = self.receive_input(pair.forward, step)
        grad = self.receive_grad(pair.backward, step)
        run_pair(lambda: self.forward(pair.forward, step, x), lambda: self.backward(pair.backward, step, grad))

    def run(self, steps: list[Step], step: StepContext) -> None:
        set_split_grads(self.stage.dims.parallel.overlap)
        for item in steps:
            if isinstance(item, Overlapped):
                self.overlapped(item, step)
            elif item.kind == "F":
                self.forward(item, step, self.receive_input(item, step))
            else:
                self.backward(item, step, self.receive_grad(item, step))
        for work, _ in step.pending_sends:
            work.wait()
        step.pending_sends.clear()
        assert not step.saved, "schedule left forward activations without a backward"
