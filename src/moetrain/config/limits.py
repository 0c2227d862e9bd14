"""Bounds on sizes that no real run reaches, so that a typo (a few zeros too many) is refused in one line
before any work instead of running for hours: the planner's search and timeline, a training step's batch
and a process per rank all grow with these numbers.

Each bound sits well above the largest published value of its kind and is stated with it; the checks
raise ``UserError`` naming the flag, the number and the mend. Torch-free.
"""

from __future__ import annotations

import os

from moetrain.errors import UserError

MAX_DEVICES = 2**20
"""1,048,576 accelerators: about ten times the largest training clusters announced (~100k GPUs)."""
MAX_TOKENS_PER_STEP = 2**27
"""134,217,728 tokens in one optimizer step: twice the largest published batch (DeepSeek-V3's 15,360
sequences of 4,096 tokens, 62.9M tokens)."""
MAX_RUN_TOKENS = 10**15
"""Tokens a whole run trains on: 25 times the longest published pre-training runs (about 40T tokens)."""
MAX_EVAL_PROBLEMS = 2**16
"""65,536 problems in one evaluation set: over ten times the largest common RL benchmarks' test sets
(MATH's 5,000 problems; GSM8K's 1,319), and each evaluation generates an answer to every one."""
MAX_REPEATS = 1_000
"""Timed repetitions of one measurement: a median of a thousand no longer moves by more than the machine's
own drift from minute to minute."""
PROCESSES_PER_CORE = 8
"""Ranks or threads one CPU core may carry: beyond it they only wait for each other."""
MAX_RESTARTS = 10_000
"""Restarts of a failed run's whole group: over twenty times the 419 unexpected interruptions of Llama 3
405B's 54-day pre-training on 16K GPUs; a run failing more often has a fault no restart mends."""
MAX_STALENESS = 64
"""Weight versions a sample may lag (``plan --rl --max-staleness``): asynchronous RL runs keep k in single
digits, as a sample's gradient drifts with its age; the RL search lists every k up to this one."""

# A model's sizes (``ModelConfig``): far beyond every published model, so a model-info, plan or train of a
# typo'd YAML is refused before torch builds a module of that size (one meta module per layer).
MAX_HIDDEN = 2**18
"""262,144: ten times the widest published model (Megatron-LM's 1T GPT, hidden 25,600)."""
MAX_FFN_HIDDEN = 2**20
"""1,048,576: ten times the widest published feed-forward (the same model's 102,400)."""
MAX_LAYERS = 2**12
"""4,096: four times the deepest Transformer trained (DeepNet's 1,000 layers), thirty times the deepest
published LLM (Llama 3 405B's 126)."""
MAX_VOCAB = 2**22
"""4,194,304: sixteen times the largest published vocabulary (Gemma 3's 262,144)."""
MAX_CONTEXT = 2**27
"""134,217,728 positions: thirteen times the longest published context (Llama 4 Scout's 10M tokens)."""
MAX_EXPERTS = 2**16
"""65,536: thirty-two times the most experts a published MoE routes over (Switch-C's 2,048)."""
MAX_HEADS = 2**12
"""4,096: twenty-five times the most attention heads published (Megatron-LM's 1T GPT, 160)."""
MAX_HEAD_DIM = 2**14
"""16,384: ten times the widest per-head or latent dimension published (MLA's q_lora_rank, 1,536)."""


def check_devices(devices: int, flag: str = "--devices") -> None:
    if devices > MAX_DEVICES:
        raise UserError(f"{flag} {devices} is beyond any cluster (the planner takes up to {MAX_DEVICES:,} "
                        "accelerators, ten times the largest built); check the number")


def check_step_tokens(tokens: int, product: str, mend: str) -> None:
    """``product`` (the flags that multiply to ``tokens``, with their values) names what to lower."""
    if tokens > MAX_TOKENS_PER_STEP:
        raise UserError(f"{product} = {tokens:,} tokens per step, more than {MAX_TOKENS_PER_STEP:,} (twice the "
                        f"largest published batch, DeepSeek-V3's 62.9M tokens); {mend}")


def check_total_tokens(tokens: int, product: str, mend: str) -> None:
    if tokens > MAX_RUN_TOKENS:
        raise UserError(f"{product} = {tokens:.2e} tokens, more than {MAX_RUN_TOKENS:.0e} (25 times the longest "
                        f"published pre-training run); {mend}")


def check_batch_tokens(global_batch: int, seq_len: int) -> None:
    check_step_tokens(global_batch * seq_len, f"--global-batch {global_batch} × --seq-len {seq_len}",
                      "lower --global-batch")


def check_run_tokens(steps: int, global_batch: int, seq_len: int) -> None:
    check_total_tokens(steps * global_batch * seq_len,
                       f"--steps {steps} × --global-batch {global_batch} × --seq-len {seq_len}", "lower --steps")


def check_seq_len(seq_len: int, max_seq_len: int, model_name: str) -> None:
    """Rotary positions (and the model's trained context) end at ``max_seq_len``."""
    if seq_len > max_seq_len:
        raise UserError(f"--seq-len {seq_len} exceeds {model_name}'s max_seq_len {max_seq_len} (its rotary "
                        "range); lower --seq-len or use a model whose max_seq_len reaches it")


def check_processes(count: int, flag: str, what: str) -> None:
    """``count`` processes or threads on this machine: refused beyond ``PROCESSES_PER_CORE`` per core."""
    cores = os.cpu_count() or 1
    limit = PROCESSES_PER_CORE * cores
    if count > limit:
        raise UserError(f"{flag} {count} asks for {count:,} {what} on this machine, which has {cores} core"
                        f"{'s' * (cores > 1)}; give at most {limit} ({PROCESSES_PER_CORE} per core)")


def check_repeats(repeats: int, flag: str = "--repeats") -> None:
    if not 1 <= repeats <= MAX_REPEATS:
        raise UserError(f"{flag} {repeats} must lie in 1..{MAX_REPEATS:,} (timed repetitions per measurement; a median "
                        f"of {MAX_REPEATS:,} no longer moves); give a count in that range")
