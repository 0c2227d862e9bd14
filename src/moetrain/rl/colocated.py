"""StaleSync, colocated: RL Fusion's switch with the next batch's generation overlapping this step's update.

The same ranks train and generate (``moetrain.rl.fusion``: a generation model per rank beside its share
of the training layout). Synchronously, step s reshards version s into the generation model, generates
batch s and trains on it: generation and training take turns. With a staleness bound k ≥ 1 the
generation of batch s + 1 runs *during* step s's update instead, with the weights of version s that the
reshard has just copied into the generation model (the update writes only the training tensors):

    step s:  [reshard v_s] → [diagnostics] → launch: generate batch s+1 with v_s ──────────┐ (a thread)
             train on batch s (generated with v_{s-1}) ───────────────────────────────────┤ (this thread)
             wait for batch s+1, gather its rows from every rank ◄─────────────────────────┘

so every batch after the first is one version old (staleness 1 ≤ k), the schedule of the disaggregated
pipeline at k = 1 (``stalesync_schedule.Schedule``): a test holds the two placements to the same
samples, losses and weights, bit for bit. Running further ahead than one batch gains nothing here: the
devices that would generate batch s + 2 are busy with batch s + 1.

Where the overlap runs, and where it does not:

- generation keeps its KV cache and weights resident beside the training state, so the overlap needs the
  memory of both: ``--offload always`` is refused; on a GPU the first update runs alone to measure what it
  allocates, and a later step runs ahead only when the last KV cache and that fit in the free memory
  (``fits_beside_update``); otherwise the next step generates synchronously (with the offload that
  ``--offload auto`` decides), and its row says ``overlapped`` = False;
- the generating thread runs no collective (``gen_ep`` = 1: every rank generates its share on a whole
  model; the rows are gathered by the training thread after the step), so the two threads never
  interleave calls on one process group; on a GPU it queues its kernels on a stream of its own;
- a checkpoint is a synchronisation point: the batch after a checkpoint step is generated with the
  saved weights, after it (not ahead of it), so a run resumed from that checkpoint continues the
  uninterrupted one bit for bit (when it stops at a checkpoint step of the uninterrupted run).

The trainer admits a batch only if current version − batch version ≤ k and drops (and counts) an older
one (``admission.StalenessGate``, the disaggregated placement's gate too); by this schedule none is older
than 1. Staleness is corrected in the loss as in the disaggregated placement (truncated importance weights
against the rollout log-probs; ``grpo``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from moetrain.config.run import RunSpec
from moetrain.data.packing import StepBatch
from moetrain.errors import UserError
from moetrain.rl.admission import StalenessGate
from moetrain.rl.batch import Rollouts, TrainingSequences
from moetrain.rl.config import FusionOptions, RLOptions, StaleSyncOptions
from moetrain.rl.fusion import sample_generators
from moetrain.rl.generate import Generation
from moetrain.rl.loop import GRPO, scored_rollouts
from moetrain.rl.offload import FREE_MARGIN
from moetrain.rl.sft import prompt_ids
from moetrain.rl.stalesync_schedule import Schedule
from moetrain.train.trainer import Trainer


def check_colocated(stale: StaleSyncOptions, fusion: FusionOptions) -> None:
    """Refuse what the overlapped colocated step cannot run (before any rank starts)."""
    if stale.staleness < 1:
        raise UserError("--placement colocated with --staleness 0 is the synchronous loop: drop --staleness")
    if fusion.gen_ep > 1:
        raise UserError(f"--placement colocated with --staleness generates beside the update on a whole model per "
                        f"rank: use --gen-ep 1, not {fusion.gen_ep}")
    if fusion.offload == "always":
        raise UserError("--placement colocated with --staleness keeps generation and training resident together: "
                        "--offload always cannot overlap them; use --offload auto (or --staleness 0)")


def fits_beside_update(generation_bytes: int, update_bytes: int, free_bytes: int) -> bool:
    """Whether generation's KV cache fits in the device memory free before the update together with what
    the update allocates on top (measured at the last update; with the margin of ``offload``)."""
    return generation_bytes + update_bytes <= FREE_MARGIN * free_bytes


class ColocatedStaleSync(GRPO):
    """GRPO's hooks under RL Fusion whose next batch is generated while the current one trains."""

    def __init__(self, spec: RunSpec, options: RLOptions, stale: StaleSyncOptions, *,
                 fusion: FusionOptions | None = None, **kwargs: Any) -> None:
        """As ``GRPO``'s; ``fusion`` defaults to whole-model generation on every rank (in one process too:
        the generation model is then a second copy of the weights, which the overlap needs)."""
        fusion = fusion or FusionOptions()
        check_colocated(stale, fusion)
        super().__init__(spec, options, fusion=fusion, **kwargs)
        self.stale = stale
        # one batch ahead (k = 1 whatever the bound: see the module's docstring), checkpoints as sync points
        self.schedule = Schedule.of_run(1, spec, start=0)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetrain-rollout")
        self._side_stream: torch.cuda.Stream | None = None
        self._ahead: Future[Generation] | None = None
        self._ahead_step: int | None = None
        self._ready: Generation | None = None
        """The next step's rows of this rank, generated during the last update."""
        self._update_bytes: int | None = None
        """On a GPU: the last update's peak memory above what was allocated before it."""
        self._allocated_before_update = 0
        self.gate = StalenessGate(stale.staleness)

    def attach(self, trainer: Trainer) -> None:
        super().attach(trainer)
        assert self.fusion is not None
        self._side_stream = torch.cuda.Stream(trainer.device) if trainer.device.type == "cuda" else None

    @property
    def dropped_batches(self) -> int:
        return self.gate.stats().dropped_batches

    @property
    def dropped_samples(self) -> int:
        return self.gate.stats().dropped_samples

    # ----- the batch of a step -----
    def rollout(self, trainer: Trainer, step: int) -> Rollouts:
        fusion = self.fusion
        assert fusion is not None
        generation = None
        if self._ready is not None and self._ahead_step == step:
            local, self._ready, self._ahead_step = self._ready, None, None
            generation = fusion.gather(local)
            if not self.gate.admit(trainer.step, generation.sample_versions):
                generation = None  # not by this schedule; the bound is checked all the same
        overlapped = generation is not None
        if generation is None:
            rollouts = super().rollout(trainer, step)  # the synchronous switch, with the current weights
            admitted = self.gate.admit(trainer.step, rollouts.generation.sample_versions)
            assert admitted, "a batch of the current weights is 0 versions old"
        else:
            rollouts = scored_rollouts(self.task, self.tokenizer, self.options.grpo, self.step_problems(step),
                                       generation)
        start = time.perf_counter()
        fusion.ensure_synced(trainer.step)  # the current weights: diagnostics now, the next batch after
        trainer.note(overlapped=overlapped, reshard_s=time.perf_counter() - start, **self.gate.stats().row())
        return rollouts

    def proximal_logprobs(self, trainer: Trainer, sequences: TrainingSequences) -> torch.Tensor | None:
        """The decoupled loss's π_prox: the current weights, whole in the generation model (synced above)."""
        assert self.fusion is not None
        if self.stale.loss != "decoupled":
            return None
        return self.sequence_logprobs(trainer, self.fusion.model, sequences)

    def next_batch(self, trainer: Trainer, step: int) -> StepBatch:
        batch = super().next_batch(trainer, step)
        if self.runs_ahead(trainer, step):
            self._launch(trainer, step + 1)
        if trainer.device.type == "cuda":  # what the update (and a generation beside it) takes on top
            torch.cuda.reset_peak_memory_stats(trainer.device)
            self._allocated_before_update = torch.cuda.memory_allocated(trainer.device)
        return batch

    def runs_ahead(self, trainer: Trainer, step: int) -> bool:
        """Whether batch ``step`` + 1 is generated during step ``step``: not after the last step, not across a
        checkpoint, and only where generation fits beside the update."""
        following = step + 1
        if following >= self.schedule.last or self.schedule.version(following) != step:
            return False  # the run ends, or the batch after a checkpoint: generated after it, from its weights
        if trainer.device.type != "cuda":
            return True  # a CPU's memory is the host's: it fits (as ``offload_decision`` says)
        if self._update_bytes is None:
            return False  # the first update runs alone, so that its memory is measured
        assert self.fusion is not None
        free = torch.cuda.mem_get_info(trainer.device)[0]
        return fits_beside_update(self.fusion.need_bytes(), self._update_bytes, free)

    def _launch(self, trainer: Trainer, step: int) -> None:
        """Generate batch ``step``'s rows of this rank in the background, with the current weights."""
        problems = self.step_problems(step)
        prompts = [prompt_ids(self.tokenizer, p) for p in problems]
        generators = sample_generators(self.cfg.seed, step, len(problems), trainer.device)
        if self._side_stream is not None:
            self._side_stream.wait_stream(torch.cuda.current_stream(trainer.device))  # the reshard's copies
        self._ahead = self._executor.submit(self._generate_share, prompts, generators, trainer.step)
        self._ahead_step = step

    def _generate_share(self, prompts: list[list[int]], generators: list[torch.Generator], version: int) -> Generation:
        assert self.fusion is not None
        if self._side_stream is None:
            return self.fusion.generate_share(prompts, self.sampling, generators, version)
        with torch.cuda.stream(self._side_stream):
            return self.fusion.generate_share(prompts, self.sampling, generators, version)

    # ----- after the update -----
    def after_step(self, trainer: Trainer, step: int, batch: StepBatch) -> dict[str, Any]:
        if trainer.device.type == "cuda":
            self._update_bytes = torch.cuda.max_memory_allocated(trainer.device) - self._allocated_before_update
        if self._ahead is not None:
            start = time.perf_counter()
            self._ready, self._ahead = self._ahead.result(), None
            if self._side_stream is not None:
                torch.cuda.current_stream(trainer.device).wait_stream(self._side_stream)
            assert self.fusion is not None
            self.fusion.engine.free_cache()
            trainer.note(overlap_wait_s=time.perf_counter() - start, next_gen_time_s=self._ready.seconds)
        return super().after_step(trainer, step, batch)

    def close(self, trainer: Trainer) -> None:
        if self._ahead is not None:  # a failed step: let the generation end before the ranks part
            self._ahead.exception()
            self._ahead = None
        self._executor.shutdown(wait=True)

    def describe(self, trainer: Trainer) -> str:
        return (super().describe(trainer) + f" · StaleSync k={self.stale.staleness}, colocated (the next batch "
                f"generates during each update), loss {self.stale.loss}")


def rl_hooks(spec: RunSpec, options: RLOptions, stale: StaleSyncOptions | None, **kwargs: Any) -> GRPO:
    """The GRPO hooks of a colocated run: synchronous (``stale`` None) or overlapped (k ≥ 1)."""
    if stale is None:
        return GRPO(spec, options, **kwargs)
    return ColocatedStaleSync(spec, options, stale, **kwargs)
