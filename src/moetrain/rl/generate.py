"""The rollout engine: batched autoregressive generation with a KV cache, on the training model's weights.

``RolloutEngine(model).generate(prompts, params)`` prefills every prompt in one forward (right-padded;
each row keeps its own positions), then decodes one token per step for the rows still running. A row
stops at a stop id, a stop string or its own token limit; finished rows leave the batch and their cache
(``LayerCache.select_rows``), so no step computes a finished row.

Per generated token it returns the sampled id, its log-prob under the weights that generated it and, per
decoder MoE layer, the experts every input token was routed to (the router-replay record). Log-probs are
those of the tempered distribution ``log_softmax(logits / T)`` before top-k/top-p truncation: the
quantity the trainer computes from its own logits (``moetrain.rl.grpo.token_logprobs``), so a gap between
the two measures the engines, not the sampler. Greedy (T = 0) reports ``log_softmax(logits)``.

Each ``Generation`` carries the weight version it was sampled with (the StaleSync issue bounds how old
a sample may be when it is trained on).

Legend: B rows, A active rows, P prompt slots, N generated slots, V vocabulary, M decoder MoE layers, K top-k.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetrain.models.transformer import MoETransformer, decoder_moe_layers
from moetrain.rl.kv_cache import LayerCache, cached_attention, new_cache
from moetrain.rl.replay import RoutingRecorder, decoder_layers
from moetrain.runtime_base.precision import autocast


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    """0: greedy."""
    top_k: int = 0
    """Sample among the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Sample from the smallest set of tokens whose probability reaches p (1: all)."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a row ends after it samples one of these (it is kept, and trained on)."""
    stop_strings: tuple[str, ...] = ()
    """... or once its decoded text contains one of these (needs the engine's ``decode``)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"bad sampling parameters {self}")


@dataclass(frozen=True)
class Generation:
    """What B prompts produced. Row b generated ``lengths_B[b]`` tokens after its ``prompt_lengths_B[b]``."""

    prompt_ids: list[list[int]]
    tokens_BN: torch.Tensor
    """int64 [B, N], the engine's pad id after each row's end."""
    logprobs_BN: torch.Tensor
    """fp32 [B, N], log-prob of each sampled token under the generating weights (0 after the end)."""
    lengths_B: torch.Tensor
    prompt_lengths_B: torch.Tensor
    stopped_B: torch.Tensor
    """True where a stop id or string ended the row, False where it ran into its token limit."""
    expert_ids_BSMK: torch.Tensor | None
    """Router-replay record over sequence positions 0..P+N-1 (prompt then completion; -1 where no token
    was an input), or None for a model without MoE layers."""
    weight_version: int
    """Optimizer steps the generating weights had taken."""
    decode_steps: int
    """Decode forwards run after the prefill."""
    rows_computed: int
    """Sum over decode steps of the rows each computed: finished rows are not computed."""
    seconds: float
    token_versions_BN: torch.Tensor | None = None
    """int64 [B, N]: the weight version that sampled each token, when a partial rollout spans several
    (``partial_rollout``); None: ``weight_version`` sampled every token."""

    def completion(self, row: int) -> list[int]:
        return self.tokens_BN[row, : int(self.lengths_B[row])].tolist()

    @property
    def num_generated(self) -> int:
        return int(self.lengths_B.sum())

    @property
    def sample_versions(self) -> list[int]:
        """Each sample's oldest token's weight version, what admission judges (``admission``)."""
        if self.token_versions_BN is None:
            return [self.weight_version] * len(self.prompt_ids)
        return [int(self.token_versions_BN[row, : max(int(self.lengths_B[row]), 1)].min())
                for row in range(len(self.prompt_ids))]


def concat_generations(parts: Sequence[Generation]) -> Generation:
    """The rows of ``parts`` in order, as one generation (replicas' shares of one batch): replay records
    padded with -1 to the widest prompt; the first part's version; the slowest part's time."""
    first = parts[0]
    slots = max(p.expert_ids_BSMK.shape[1] for p in parts) if first.expert_ids_BSMK is not None else 0

    def record(part: Generation) -> torch.Tensor:
        ids = part.expert_ids_BSMK
        assert ids is not None
        pad = ids.new_full((ids.shape[0], slots - ids.shape[1], *ids.shape[2:]), -1)
        return torch.cat([ids, pad], dim=1)

    cat = lambda key: torch.cat([getattr(p, key) for p in parts])
    versions = None
    if any(p.token_versions_BN is not None for p in parts):
        versions = torch.cat([p.token_versions_BN if p.token_versions_BN is not None
                              else torch.full_like(p.tokens_BN, p.weight_version) for p in parts])
    return Generation(
        [prompt for p in parts for prompt in p.prompt_ids], cat("tokens_BN"), cat("logprobs_BN"), cat("lengths_B"),
        cat("prompt_lengths_B"), cat("stopped_B"), torch.cat([record(p) for p in parts]) if slots else None,
        first.weight_version, max(p.decode_steps for p in parts), sum(p.rows_computed for p in parts),
        max(p.seconds for p in parts), versions)


def filter_logits(logits_AV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits outside the top-k and outside the top-p nucleus set to -inf (the most likely token always stays)."""
    if top_k and top_k < logits_AV.shape[-1]:
        kth = logits_AV.topk(top_k, dim=-1).values[:, -1:]
        logits_AV = logits_AV.masked_fill(logits_AV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_AV, order_AV = logits_AV.sort(dim=-1, descending=True)
        before_AV = sorted_AV.softmax(-1).cumsum(-1) - sorted_AV.softmax(-1)  # mass strictly before each token
        drop_AV = before_AV >= top_p
        logits_AV = logits_AV.masked_fill(drop_AV.scatter(1, order_AV, drop_AV), float("-inf"))
    return logits_AV


def sample(logits_AV: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | Sequence[torch.Generator] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, its log-prob under the tempered, untruncated distribution) per row; ``generator``: one for
    the batch, or one per row (a row's draws then do not depend on which rows share its batch)."""
    logits_AV = logits_AV.float()
    if params.temperature == 0:
        token_A = logits_AV.argmax(-1)
        return token_A, logits_AV.log_softmax(-1).gather(1, token_A[:, None]).squeeze(1)
    scaled_AV = logits_AV / params.temperature
    probs_AV = filter_logits(scaled_AV, params.top_k, params.top_p).softmax(-1)
    if isinstance(generator, Sequence):
        token_A = torch.cat([torch.multinomial(probs_AV[row:row + 1], 1, generator=g)[0]
                             for row, g in enumerate(generator)])
    else:
        token_A = torch.multinomial(probs_AV, 1, generator=generator).squeeze(1)
    return token_A, scaled_AV.log_softmax(-1).gather(1, token_A[:, None]).squeeze(1)


class RolloutEngine:
    """Generation on ``model``'s own parameters (the colocated case: no copy, always the current weights)."""

    def __init__(self, model: MoETransformer, pad_id: int, decode: Callable[[list[int]], str] | None = None,
                 autocast_dtype: torch.dtype | None = None) -> None:
        self.model, self.pad_id, self.decode, self.autocast_dtype = model, pad_id, decode, autocast_dtype
        self.layers = decoder_layers(model)
        self.num_moe_layers = len(decoder_moe_layers(model.cfg))
        self.cache_bytes = 0
        """Bytes of the KV cache of the latest ``generate`` (freed when it returns, or by ``free_cache``)."""
        self.retain_cache = False
        self.caches: list[LayerCache] = []

    def free_cache(self) -> int:
        """Release the retained KV cache; its bytes."""
        freed = sum(cache.num_bytes for cache in self.caches) if self.caches else 0
        self.caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    def _forward(self, ids_AQ: torch.Tensor, positions_AQ: torch.Tensor, caches: list[LayerCache],
                 last_AQ: torch.Tensor) -> torch.Tensor:
        """Logits [A, V] at query index ``last_AQ`` of each row, after writing the queries into the caches."""
        model = self.model
        num_slots = int(positions_AQ.max()) + 1
        x = model.embed(ids_AQ)
        for layer, cache in zip(self.layers, caches):
            # DecoderLayer.forward with the cached attention: same norms, residuals and FFN/MoE modules.
            attn = cached_attention(layer.attention, layer.attn_norm(x), positions_AQ, cache, num_slots)
            x = x + (layer.attn_post_norm(attn) if layer.sandwich else attn)
            hidden = layer.ffn_norm(x)
            ffn = layer.moe(hidden).out_TD if layer.is_moe else layer.ffn(hidden)
            x = x + (layer.ffn_post_norm(ffn) if layer.sandwich else ffn)
        last_AD = x[torch.arange(x.shape[0], device=x.device), last_AQ]
        return model.output_head(model.final_norm(last_AD))

    def _stopped(self, rows: list[int], tokens_BN: torch.Tensor, lengths_B: torch.Tensor,
                 params: SamplingParams) -> list[bool]:
        if not params.stop_strings or self.decode is None:
            return [False] * len(rows)
        texts = [self.decode(tokens_BN[row, : int(lengths_B[row])].tolist()) for row in rows]
        return [any(stop in text for stop in params.stop_strings) for text in texts]

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | Sequence[torch.Generator] | None = None,
                 max_new_tokens: Sequence[int] | None = None, weight_version: int = 0) -> Generation:
        """Generate for every prompt; ``max_new_tokens``: a per-row limit (each at most ``params``');
        ``generator``: one for the batch or one per prompt. With ``retain_cache`` set, the KV cache stays
        allocated after the call until ``free_cache`` (RL Fusion frees it as a phase of its own)."""
        start = time.perf_counter()
        device, batch = self.device, len(prompts)
        limits_B = torch.tensor(max_new_tokens if max_new_tokens is not None else [params.max_new_tokens] * batch,
                                device=device).clamp(max=params.max_new_tokens)
        prompt_lengths_B = torch.tensor([len(p) for p in prompts], device=device)
        assert batch and int(prompt_lengths_B.min()) > 0, "every prompt needs at least one token"
        prompt_slots, new_slots = int(prompt_lengths_B.max()), params.max_new_tokens
        ids_BP = torch.full((batch, prompt_slots), self.pad_id, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            ids_BP[row, : len(prompt)] = torch.tensor(list(prompt), device=device)
        dtype = self.model.embed.weight.dtype if self.autocast_dtype is None else self.autocast_dtype
        # The last sampled token is never fed back, so P + N - 1 slots hold every input.
        caches = [new_cache(layer.attention, batch, prompt_slots + new_slots - 1, device, dtype)
                  for layer in self.layers]
        self.cache_bytes = sum(cache.num_bytes for cache in caches)

        tokens_BN = torch.full((batch, new_slots), self.pad_id, dtype=torch.long, device=device)
        logprobs_BN = torch.zeros(batch, new_slots, device=device)
        lengths_B = torch.zeros(batch, dtype=torch.long, device=device)
        stopped_B = torch.zeros(batch, dtype=torch.bool, device=device)
        record = None
        if self.num_moe_layers:
            top_k = self.model.cfg.moe.router.top_k
            record = torch.full((batch, prompt_slots + new_slots, self.num_moe_layers, top_k), -1,
                                dtype=torch.long, device=device)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)

        recorder = RoutingRecorder(self.model)
        with recorder, autocast(self.autocast_dtype, device.type):
            positions_BP = torch.arange(prompt_slots, device=device).expand(batch, -1)
            logits_AV = self._forward(ids_BP, positions_BP, caches, prompt_lengths_B - 1)
            if record is not None:
                prompt_mask_BP = positions_BP < prompt_lengths_B[:, None]
                record[:, :prompt_slots] = torch.where(prompt_mask_BP[..., None, None],
                                                       recorder.take(batch, prompt_slots), -1)
            active_A = torch.arange(batch, device=device)  # original row of each running row
            position_A = prompt_lengths_B.clone()  # where each running row's next input token goes
            decode_steps = rows_computed = 0
            for step in range(new_slots):
                row_generators = ([generator[row] for row in active_A.tolist()] if isinstance(generator, Sequence)
                                  else generator)
                token_A, logprob_A = sample(logits_AV, params, row_generators)
                tokens_BN[active_A, step] = token_A
                logprobs_BN[active_A, step] = logprob_A
                lengths_B[active_A] += 1
                hit_A = torch.isin(token_A, stop_ids)
                if params.stop_strings:
                    hit_A |= torch.tensor(self._stopped(active_A.tolist(), tokens_BN, lengths_B, params),
                                          device=device)
                stopped_B[active_A] = hit_A
                done_A = hit_A | (lengths_B[active_A] >= limits_B[active_A])
                if bool(done_A.all()) or step == new_slots - 1:
                    break
                if bool(done_A.any()):
                    keep_A = (~done_A).nonzero().squeeze(1)
                    active_A, position_A, token_A = active_A[keep_A], position_A[keep_A], token_A[keep_A]
                    for cache in caches:
                        cache.select_rows(keep_A)
                logits_AV = self._forward(token_A[:, None], position_A[:, None], caches,
                                          torch.zeros_like(token_A))
                if record is not None:
                    record[active_A, position_A] = recorder.take(len(active_A), 1)[:, 0]
                position_A = position_A + 1
                decode_steps += 1
                rows_computed += len(active_A)
        if self.retain_cache:
            self.caches = caches
        else:
            caches.clear()
        return Generation([list(p) for p in prompts], tokens_BN, logprobs_BN, lengths_B, prompt_lengths_B,
                          stopped_B, record, weight_version, decode_steps, rows_computed,
                          time.perf_counter() - start)


def full_recompute_generate(model: MoETransformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                            stop_token_ids: Sequence[int] = ()) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy generation without a cache, one row at a time, every step recomputing the whole sequence:
    the reference the engine is tested against (and the baseline of the speed benchmark)."""
    completions, logprobs = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            tokens: list[int] = []
            values: list[float] = []
            for _ in range(max_new_tokens):
                logits_V = model(torch.tensor([ids], device=model.embed.weight.device)).logits[0, -1].float()
                token = int(logits_V.argmax())
                tokens.append(token)
                values.append(float(F.log_softmax(logits_V, -1)[token]))
                ids.append(token)
                if token in stop_token_ids:
                    break
            completions.append(tokens)
            logprobs.append(values)
    return completions, logprobs
