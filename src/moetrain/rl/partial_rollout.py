"""Partial rollouts: a generation interrupted at a weight update and resumed under the new weights.

A rollout replica that generates with version v while the trainer is about to publish v + 1 need not
finish the batch on v: it generates the first part of every sample's token budget, takes the new
weights, and finishes the samples still running under them. Resuming re-reads each running sample
(its prompt and the tokens it has so far) with the new weights, a prefill that rebuilds its KV cache,
so every token after the interruption is sampled from the new weights alone; the per-sample generators
carry on where they stopped, so the run stays a function of (seed, step, sample).

Each sample records which version sampled each of its tokens (``Generation.token_versions_BN``) and,
for its router-replay record, that of the forward that finished it. Admission judges a sample by its
oldest token (``Generation.sample_versions``): a sample begun on weights too old is dropped even when
its last tokens are current, so the bound on staleness holds of every token trained on.

Legend: B rows, C running rows at the interruption, N generated slots.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from moetrain.rl.generate import Generation, RolloutEngine, SamplingParams


def interrupt_point(max_new_tokens: int) -> int:
    """Tokens generated under the first version: half of the budget (at least one)."""
    return max(1, max_new_tokens // 2)


def generate_with_resume(engine: RolloutEngine, prompts: Sequence[Sequence[int]], params: SamplingParams,
                         generators: Sequence[torch.Generator], version: int,
                         resume: Callable[[], int]) -> Generation:
    """Generate under ``version`` up to ``interrupt_point`` tokens per sample, call ``resume`` (which
    loads the next weights and returns their version; called even when no sample still runs, since a
    weight sync is collective), then finish the running samples under those weights."""
    start = time.perf_counter()
    first = engine.generate(prompts, params, list(generators), [interrupt_point(params.max_new_tokens)] * len(prompts),
                            weight_version=version)
    new_version = resume()
    running = [row for row in range(len(prompts))
               if not bool(first.stopped_B[row]) and int(first.lengths_B[row]) < params.max_new_tokens]
    if not running:
        return replace(first, seconds=time.perf_counter() - start)
    so_far = [list(prompts[row]) + first.completion(row) for row in running]
    rest = [params.max_new_tokens - int(first.lengths_B[row]) for row in running]
    second = engine.generate(so_far, params, [generators[row] for row in running], rest, weight_version=new_version)
    return _joined(first, second, running, new_version, time.perf_counter() - start)


def _joined(first: Generation, second: Generation, running: list[int], new_version: int,
            seconds: float) -> Generation:
    """``first`` with the running rows continued by ``second`` (whose row c is ``running[c]``)."""
    tokens_BN, logprobs_BN = first.tokens_BN.clone(), first.logprobs_BN.clone()
    lengths_B, stopped_B = first.lengths_B.clone(), first.stopped_B.clone()
    versions_BN = torch.full_like(tokens_BN, first.weight_version)
    record = None if first.expert_ids_BSMK is None else first.expert_ids_BSMK.clone()
    for c, row in enumerate(running):
        done, more = int(first.lengths_B[row]), int(second.lengths_B[c])
        tokens_BN[row, done:done + more] = second.tokens_BN[c, :more]
        logprobs_BN[row, done:done + more] = second.logprobs_BN[c, :more]
        versions_BN[row, done:] = new_version
        lengths_B[row] = done + more
        stopped_B[row] = second.stopped_B[c]
        if record is not None and second.expert_ids_BSMK is not None:
            # the replay record of the forward that finished the sample (its prefill re-read every earlier token)
            width = min(record.shape[1], second.expert_ids_BSMK.shape[1])
            record[row] = -1
            record[row, :width] = second.expert_ids_BSMK[c, :width]
    return replace(first, tokens_BN=tokens_BN, logprobs_BN=logprobs_BN, lengths_B=lengths_B, stopped_B=stopped_B,
                   expert_ids_BSMK=record, decode_steps=first.decode_steps + second.decode_steps,
                   rows_computed=first.rows_computed + second.rows_computed, seconds=seconds,
                   token_versions_BN=versions_BN)
