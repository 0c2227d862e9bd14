"""What an RL run learns with, beside its ``RunSpec``: the task, GRPO's constants, sampling, replay,
evaluation. Torch-free (pydantic), so the CLI validates it before anything heavy is imported."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from moetrain.config.limits import MAX_STALENESS
from moetrain.errors import UserError
from moetrain.rl.tasks import TASKS


class GRPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    group_size: int = Field(default=8, ge=2)
    """Samples per prompt (G)."""
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    clip_high: float = Field(default=0.28, ge=0)
    """ε_high > ε_low lets unlikely tokens with positive advantage grow (DAPO's clip-higher)."""
    is_cap: float = Field(default=2.0, ge=1)
    """C: importance weights above it are truncated to it."""
    kl_coef: float = Field(default=0.0, ge=0)
    """β (0: no reference model is kept)."""
    scale_rewards: bool = True
    temperature: float = Field(default=1.0, gt=0)
    """The sampling temperature: log-probs are those of logits / T on both sides."""
    eps: float = Field(default=1e-4, gt=0)


class RLOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    task: str = "addition"
    prompts_per_step: int = Field(default=32, gt=0)
    """Prompts per optimizer step; the step trains on prompts_per_step × group_size samples."""
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_new_tokens: int | None = Field(default=None, gt=0)
    """Generated tokens per sample at most (default: the task's longest answer + 2)."""
    replay: bool = True
    """Train with the experts generation chose (router replay)."""
    filter_groups: bool = False
    """Train only on the groups whose rewards differ (``batch.trained_rows``; DAPO's dynamic-sampling
    filter without the over-sampling): the others have zero advantage and no policy gradient."""
    replay_stats_every: int = Field(default=1, ge=0)
    """Every this many steps, one extra forward without replay measures the routing mismatch (0: never)."""
    group_by_length: bool = True
    """Micro-batches of samples of like length (the step's samples shortest first, the micro-batches dealt
    to the data-parallel ranks in turn); each micro-batch is cut to its longest sample either way, so the
    shorter ones compute less padding (``rl.batch.Batching``)."""
    eval_every: int = Field(default=10, ge=0)
    """Held-out accuracy every this many steps (0: only at the end); always before the first step."""
    eval_size: int = Field(default=256, gt=0)

    @field_validator("task")
    @classmethod
    def _known_task(cls, name: str) -> str:
        if name not in TASKS and not name.startswith("rg:"):  # rg: tasks are checked when loaded
            raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)} or rg:<reasoning-gym dataset>")
        return name


class WarmupCriterion(BaseModel):
    """When the SFT warm-up stops (``moetrain.rl.warmup``): at the first check whose validation accuracy
    reaches ``target``, else at the step cap. Part of what the warm-up learns (a saved warm-up is reused
    only under the same criterion)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    target: float = Field(default=0.3, ge=0, le=1)
    """Greedy validation accuracy at which the warm-up stops (0: no checks, every step of the cap)."""
    check_every: int = Field(default=10, gt=0)
    """SFT steps between checks."""
    val_size: int = Field(default=256, gt=0)
    """Validation problems: held out from training, none of them in the evaluation set."""

    @property
    def enabled(self) -> bool:
        return self.target > 0


class FusionOptions(BaseModel):
    """RL Fusion across ranks: the generation layout and the switch between it and the training layout.
    Not part of what is learned (a run may resume under another generation layout)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    gen_ep: int = Field(default=1, ge=1)
    """Expert-parallel degree of generation; world / gen_ep data-parallel generation replicas (1: every
    rank a whole model, generating its share of the prompts; no pipeline, no tensor parallelism)."""
    gen_tp: int = Field(default=1, ge=1)
    """Tensor-parallel degree of a disaggregated rollout replica: its gen_tp ranks split every attention
    layer's heads and dense FFN's columns, the experts whole on each, or with gen_ep > 1 split over the
    gen_ep ranks at each TP position (a replica of gen_tp·gen_ep ranks) (1: no tensor parallelism; RL
    Fusion and the colocated placement generate with gen_tp = 1)."""
    bucket_mib: float = Field(default=32.0, gt=0)
    """Weight-sync buckets of at most this size."""
    offload: Literal["auto", "always", "never"] = "auto"
    """Optimizer state and gradients to host during generation: when generation does not fit (auto)."""

    def replicas(self, world_size: int) -> int:
        """Generation replicas of this world (the layout must divide it)."""
        if world_size % self.gen_ep:
            raise UserError(f"generation layout ep{self.gen_ep} does not divide the {world_size} ranks; "
                            f"pick --gen-ep dividing --nproc")
        return world_size // self.gen_ep


class StaleSyncOptions(BaseModel):
    """StaleSync (docs/rl_stalesync.md): rollout and training as separate workers, the trainer admitting
    samples at most ``staleness`` weight versions old. Not part of what is learned."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    staleness: int = Field(default=0, ge=0)
    """k: the trainer admits a sample only if current version − sample version ≤ k (0: synchronous)."""
    placement: Literal["colocated", "disaggregated"] = "disaggregated"
    """disaggregated: rollout replicas and a trainer group on ranks of their own; colocated: RL Fusion's
    ranks, each generating the next batch while the current one trains (``moetrain.rl.colocated``)."""
    loss: Literal["tis", "decoupled"] = "tis"
    """tis: ratio against the trained weights, importance weight min(π_old/μ, C) against the behaviour
    policy μ; decoupled: ratio against a proximal policy from a forward before the step (Hilton et al.
    2022), weight min(π_prox/μ, C)."""
    bucket_mib: float = Field(default=32.0, gt=0)
    """Weight-sync buckets of at most this size."""
    reward_worker: bool = False
    """Disaggregated: score on a rank of its own between the rollout worker and the trainer (else the
    rollout worker scores). A KL reference (``grpo.kl_coef`` > 0) always runs on a rank of its own."""
    partial_rollouts: bool = False
    """Disaggregated: a batch is interrupted halfway through its token budget when newer weights are due
    and resumed on them; its samples are admitted by their oldest token's version (``partial_rollout``)."""

    @field_validator("staleness")
    @classmethod
    def _bounded(cls, staleness: int) -> int:
        # a typo's zeros would only queue that many batches ahead; ``plan --rl`` searches the same range
        if staleness > MAX_STALENESS:
            raise ValueError(f"Input should be at most {MAX_STALENESS} weight versions (asynchronous RL keeps k in "
                             f"single digits: a sample's gradient drifts with its age); give 0 to {MAX_STALENESS}")
        return staleness
