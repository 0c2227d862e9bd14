"""The RL hooks of the runtime's ``Trainer``: the SFT warm-up's, and GRPO's, whose batch for step s is a fresh,
scored set of rollouts (``Trainer(spec, SuppliedParts(hooks=GRPO(spec, options)))``).

One step (synchronous, colocated: in one process generation runs on the training model's own
parameters; across ranks, RL Fusion (``moetrain.rl.fusion``) reshards the current weights into a
generation model per rank first, so in both cases the weights it samples with are the current ones):

1. generate G samples for each of the step's prompts (``RolloutEngine``; KV cache, replay record);
2. score them (the task's exact scorer) and normalise rewards within each group (``grpo``);
3. optionally: the frozen reference's log-probs (KL term), and one forward without replay that measures
   how many tokens the trainer would route elsewhere (``replay.routing_mismatch``);
4. ``train_step`` on micro-batches whose objective is GRPO and whose routers replay generation's experts,
   so every layout, the memory policy, metrics and checkpoints of the runtime serve RL unchanged.

Prompts of step s and the sampling generator are functions of (seed, s), like the corpus batches of
``moetrain train``: a resumed run generates exactly what the uninterrupted one would have, and its
reward curve continues it. The weight version of a sample is the number of optimizer steps its
weights had taken (``Trainer.step`` at generation); rows log it and the staleness (0 here; the
StaleSync issue trains on older samples and bounds that number).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.table import Table

from moetrain.config import ModelConfig
from moetrain.config.run import RunSpec
from moetrain.data.packing import StepBatch
from moetrain.errors import UserError
from moetrain.models.attention import build_attention_context
from moetrain.models.transformer import MoETransformer, decoder_moe_layers, layer_replay
from moetrain.rl.batch import (
    Batching,
    Chunk,
    Rollouts,
    TrainingSequences,
    step_batch,
    trained_rows,
    training_sequences,
)
from moetrain.rl.config import FusionOptions, GRPOConfig, RLOptions, WarmupCriterion
from moetrain.rl.fusion import Fusion, sample_generators, whole_model
from moetrain.rl.generate import Generation, RolloutEngine, SamplingParams
from moetrain.rl.grpo import (
    STAT_FIELDS,
    OtherLogprobs,
    StepStats,
    group_advantages,
    label_positions,
    token_logprobs,
)
from moetrain.rl.replay import RoutingRecorder, decoder_layers, routing_mismatch
from moetrain.rl.sft import TaskSFTDataset, prompt_ids
from moetrain.rl.tasks import Problem, Task, get_task, heldout_problems, new_tokens_for, problem_at
from moetrain.rl.tokenizer import CharTokenizer
from moetrain.rl.warmup import WarmupCheck, WarmupDecision, decide, warmup_validation
from moetrain.train.trainer import Trainer, TrainerHooks

EVAL_BATCH = 256
WARMUP_DECISION_FILE = "warmup.json"
"""Beside the warm-up's checkpoints: where its criterion stopped it (``warmup.WarmupDecision``)."""


def policy_config(model_cfg: ModelConfig) -> ModelConfig:
    """The model RL trains: the preset without multi-token prediction. Generation never runs the MTP
    modules, so they would get no policy gradient and no replay record (DeepSeek-V3 also drops them for
    inference); SFT and RL use this same config, so their weights carry over one to one."""
    return model_cfg.model_copy(update={"num_mtp_layers": 0})


def policy_logprobs(model: MoETransformer, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor, temperature: float,
                    expert_ids_BSMK: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S] log-probs of the label tokens under ``model`` (a plain or one-rank parallelized model; 0 at
    ignored labels), by the training forward's layer calls (those of ``MoETransformer.forward`` and the
    step's ``chunk_forward``) with optional router replay. ``labels_BS`` stays on the host: the head runs
    at its label positions only (``grpo.label_positions``), as in the training step."""
    ctx = build_attention_context(input_ids_BS, None)
    column = {layer: col for col, layer in enumerate(decoder_moe_layers(model.cfg))}
    x = model.embed(input_ids_BS)
    for index, layer in enumerate(decoder_layers(model)):
        x, _, _ = layer(x, ctx, layer_replay(expert_ids_BSMK, column.get(index)))
    index_T = label_positions(labels_BS)
    device_index_T = index_T.to(x.device)
    labels_T = labels_BS.reshape(-1).index_select(0, index_T).to(x.device)
    logp_T = token_logprobs(model.logits_at(x, device_index_T), labels_T, temperature)
    return logp_T.new_zeros(labels_BS.numel()).index_copy_(0, device_index_T, logp_T).view(labels_BS.shape)


def _fusion_options(spec: RunSpec, fusion: FusionOptions | None) -> FusionOptions | None:
    """RL Fusion runs when the layout has several ranks (or when asked for): refuse what it cannot train."""
    if spec.world_size == 1 and fusion is None:
        return None
    parallel = spec.parallel
    if parallel.cp > 1:
        raise UserError(f"RL Fusion does not train with context parallelism (cp={parallel.cp}) yet; use tp, pp or ep")
    if spec.balance.enabled:
        raise UserError("RL Fusion does not run with online expert balancing yet (the weight sync's plan assumes a "
                        "fixed expert placement)")
    fusion = fusion or FusionOptions()
    fusion.replicas(spec.world_size)
    return fusion


class SFTWarmup(TrainerHooks):
    """The warm-up's hooks: the runtime's loop on ``TaskSFTDataset`` batches (answer tokens only, the batch
    source ``examples``), stopped by a measured criterion (``moetrain.rl.warmup``) when one is given, else
    after every step. ``decision``: where the criterion stopped it (None: not yet)."""

    def __init__(self, spec: RunSpec, task: Task, *, criterion: WarmupCriterion | None = None,
                 eval_size: int = RLOptions().eval_size) -> None:
        """``criterion``: when to stop before ``spec.training.steps`` (the cap); ``eval_size``: the GRPO
        run's evaluation set, which the validation problems avoid."""
        training = spec.training
        self.task, self.tokenizer = task, CharTokenizer()
        self.examples = TaskSFTDataset(task, self.tokenizer, training.seq_len, training.seed)
        """The batch source to give the trainer (``SuppliedParts(batches=...)``)."""
        self.criterion = criterion if criterion is not None and criterion.enabled else None
        self.decision: WarmupDecision | None = None
        self.validation = (warmup_validation(task, training.seed, self.criterion, eval_size)
                           if self.criterion is not None else [])

    def identity(self, trainer: Trainer) -> str:
        criterion = f":{self.criterion.model_dump_json()}" if self.criterion is not None else ""
        return f"sft:{self.task.name}{criterion}"

    def finished(self, trainer: Trainer) -> bool:
        return self.decision is not None

    def after_step(self, trainer: Trainer, step: int, batch: StepBatch) -> dict[str, Any]:
        criterion, steps = self.criterion, trainer.cfg.steps
        if criterion is None or not (step % criterion.check_every == 0 or step == steps):
            return {}
        start = time.perf_counter()
        check = WarmupCheck(step, self.validation_accuracy(trainer))
        self.decision = decide(check, criterion, steps)
        return {"validation_accuracy": check.accuracy, "check_time_s": time.perf_counter() - start}

    @torch.no_grad()
    def validation_accuracy(self, trainer: Trainer) -> float:
        """Greedy accuracy on the validation problems. Across ranks every rank holds the whole model (one
        weight sync) and scores its share; the counts are summed, so every rank takes the same decision."""
        world = trainer.spec.world_size
        if world == 1:
            model, share = trainer.run.stage.model, self.validation
        else:
            model, rank = whole_model(trainer.run, trainer.model_cfg), trainer.dims.rank
            share = self.validation[rank::world]
        engine = RolloutEngine(model, self.tokenizer.pad_id, self.tokenizer.decode, trainer.run.autocast_dtype)
        correct = greedy_correct(engine, self.task, self.tokenizer, share, new_tokens_for(self.task, None))
        if world > 1:
            total = torch.tensor([correct], dtype=torch.float64, device=trainer.device)
            dist.all_reduce(total, group=trainer.dims.get_group("world"))
            correct = float(total)
        return correct / len(self.validation)

    def saved(self, trainer: Trainer, path: Path) -> None:
        """Beside the checkpoint, the criterion's decision: a later run reuses the warm-up as finished."""
        if self.decision is not None and trainer.is_reporter:
            (Path(trainer.spec.run.save_dir) / WARMUP_DECISION_FILE).write_text(json.dumps(asdict(self.decision)))

    def loaded(self, trainer: Trainer, path: Path) -> None:
        record = Path(trainer.spec.run.save_dir) / WARMUP_DECISION_FILE
        if self.criterion is not None and record.is_file():
            decision = WarmupDecision(**json.loads(record.read_text()))
            self.decision = decision if decision.step == trainer.step else None

    def describe(self, trainer: Trainer) -> str:
        stop = "" if self.criterion is None else (
            f" at most, stopping when validation accuracy reaches {self.criterion.target:.0%} (checked every "
            f"{self.criterion.check_every} steps on {len(self.validation)} held-out problems)")
        cfg = trainer.cfg
        return (f"SFT warm-up on {self.task.name}: {cfg.steps} steps × {cfg.global_batch} examples{stop}, "
                f"model {trainer.model_cfg.name} · {trainer.device_text()}")


class GRPO(TrainerHooks):
    """GRPO's hooks: ``next_batch`` generates, scores and packs the step's samples; ``after_step`` reads the
    objective's statistics and evaluates. The StaleSync hooks change it through its own methods:
    ``rollout`` (where the samples come from), ``reference_logprobs`` and ``proximal_logprobs`` (the loss's
    other policies), and ``replay_diagnostics``; their row fields go through ``trainer.note``."""

    makes_batches = True

    def __init__(self, spec: RunSpec, options: RLOptions, *, reference: MoETransformer | None = None,
                 keep_logprobs: bool = False, fusion: FusionOptions | None = None,
                 reference_in_batches: bool = False) -> None:
        """``reference``: the frozen model of the KL term (needed when ``options.grpo.kl_coef`` > 0), unless
        ``reference_in_batches`` (a StaleSync reference worker's log-probs come with each batch).
        ``keep_logprobs``: keep each step's trainer log-probs (``last_stats.logprobs``, tests). ``fusion``:
        the generation layout across ranks (RL Fusion; the default one when the layout has several ranks)."""
        self.fusion_options = _fusion_options(spec, fusion)
        if options.grpo.kl_coef and reference is None and not reference_in_batches:
            raise UserError("a KL coefficient needs a reference model (the starting weights)")
        expected = spec.training.global_batch
        if options.prompts_per_step * options.grpo.group_size != expected:
            raise UserError(f"global batch {expected} must be prompts per step × group size "
                            f"({options.prompts_per_step} × {options.grpo.group_size})")
        self.spec, self.cfg, self.options = spec, spec.training, options
        self.task, self.tokenizer = get_task(options.task), CharTokenizer()
        self.keep_logprobs, self.reference_in_batches = keep_logprobs, reference_in_batches
        self.reference = reference.eval().requires_grad_(False) if reference is not None else None
        self.fusion: Fusion | None = None
        self.engine: RolloutEngine | None = None
        self.batching: Batching | None = None
        """The step's micro-batches (``attach``): this rank's rows, cut to their longest sample in multiples
        of the layout's sequence split (tp: sequence parallelism; RL refuses context parallelism)."""
        self.sampling = SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=options.grpo.temperature, top_k=options.top_k,
            top_p=options.top_p, stop_token_ids=(self.tokenizer.eos_id,))
        self.eval_problems = heldout_problems(self.task, self.cfg.seed, options.eval_size)
        self.last_stats: StepStats | None = None
        self.last_sequences: TrainingSequences | None = None
        """The latest step's training sequences (with the rollout log-probs)."""

    def attach(self, trainer: Trainer) -> None:
        """The rollout engine on the trained model (or RL Fusion's generation model), the run's batching."""
        model_cfg = trainer.model_cfg
        self.tokenizer.check_fits(model_cfg.vocab_size, model_cfg.name)
        if self.fusion_options is not None:
            self.fusion = Fusion(trainer.run, model_cfg, self.fusion_options, self.tokenizer.pad_id,
                                 self.tokenizer.decode)
            self.fusion.share(self.cfg.global_batch)  # the step's samples split over the generation replicas
            self.engine = self.fusion.engine
        else:
            self.engine = RolloutEngine(trainer.run.stage.model, self.tokenizer.pad_id, self.tokenizer.decode,
                                        trainer.run.autocast_dtype)
        parallel = self.spec.parallel
        self.batching = Batching(self.cfg.micro_batch, parallel.tp, self.options.group_by_length, trainer.dp_rank,
                                 parallel.dp)

    @property
    def max_new_tokens(self) -> int:
        return new_tokens_for(self.task, self.options.max_new_tokens)

    def identity(self, trainer: Trainer) -> str:
        # The task and every RL option are part of what is learned: a checkpoint resumes only into the same.
        return f"rl:{self.options.model_dump_json()}"

    # ----- one step's batch -----
    def step_problems(self, step: int) -> list[Problem]:
        """The step's prompts, each repeated group_size times (groups contiguous)."""
        return step_problems(self.task, self.options, self.cfg.seed, step)

    def rollout(self, trainer: Trainer, step: int) -> Rollouts:
        """The step's samples, scored, generated with the current weights (version ``trainer.step``). Sample
        i draws from a generator of (seed, step, i), so a sample is the same whichever rank generates it
        (RL Fusion) and whichever samples share its batch."""
        problems = self.step_problems(step)
        prompts = [prompt_ids(self.tokenizer, p) for p in problems]
        generators = sample_generators(self.cfg.seed, step, len(problems), trainer.device)
        if self.fusion is not None:
            generation, switch = self.fusion.step(trainer.step, prompts, self.sampling, generators)
            trainer.note(**switch.metrics)
        else:
            assert self.engine is not None
            generation = self.engine.generate(prompts, self.sampling, generators, weight_version=trainer.step)
        start = time.perf_counter()
        rollouts = scored_rollouts(self.task, self.tokenizer, self.options.grpo, problems, generation)
        trainer.note(score_time_s=time.perf_counter() - start)
        return rollouts

    def next_batch(self, trainer: Trainer, step: int) -> StepBatch:
        if step == 0 and not trainer.metrics.rows:
            # The starting policy's held-out accuracy, as the curve's step 0 (a fresh run only).
            trainer.metrics.log({"step": 0, "heldout_accuracy": self.evaluate(trainer)})
        rollouts = self.rollout(trainer, step)
        sequences = self.last_sequences = training_sequences(rollouts, self.cfg.seq_len, self.tokenizer.pad_id)
        trainer.note(**rollout_metrics(rollouts, self.options.grpo.group_size, trainer.step))
        has_reference = self.reference is not None or self.reference_in_batches
        ref_logp_BS = self.reference_logprobs(trainer, rollouts, sequences) if has_reference else None
        every = self.options.replay_stats_every
        if every and step % every == 0 and sequences.expert_ids_BSMK is not None:
            trainer.note(**self.replay_diagnostics(trainer, sequences))
        old_logp_BS = self.proximal_logprobs(trainer, sequences)
        rows = self.trained_rows(rollouts)
        if rows is not None:
            take = lambda t_BS: None if t_BS is None else t_BS.index_select(0, rows)
            sequences, ref_logp_BS, old_logp_BS = sequences.select(rows), take(ref_logp_BS), take(old_logp_BS)
            self.last_sequences = sequences
        trainer.note(trained_frac=1.0 if rows is None else len(rows) / len(rollouts.problems))
        self.last_stats = StepStats.zeros(trainer.device, self.keep_logprobs)
        assert self.batching is not None
        return step_batch(sequences, self.options.grpo, self.batching, self.last_stats, self.options.replay,
                          OtherLogprobs(ref_logp_BS, old_logp_BS))

    def trained_rows(self, rollouts: Rollouts) -> torch.Tensor | None:
        """The step's rows to train on: those of groups whose rewards differ, with ``filter_groups``
        (``batch.trained_rows``); None: every row."""
        if not self.options.filter_groups:
            return None
        parallel = self.spec.parallel
        return trained_rows(rollouts.rewards_B, self.options.grpo.group_size, self.cfg.micro_batch, parallel.dp,
                            parallel.dp * (parallel.pp if parallel.vpp > 1 else 1))

    def proximal_logprobs(self, trainer: Trainer, sequences: TrainingSequences) -> torch.Tensor | None:
        """π_old of the ratio when it is not the trained weights before the step (None: it is; the
        StaleSync hooks' decoupled loss overrides this)."""
        return None

    def reference_logprobs(self, trainer: Trainer, rollouts: Rollouts, sequences: TrainingSequences) -> torch.Tensor:
        """The KL reference's log-probs of the samples: the frozen reference model's."""
        assert self.reference is not None
        return self.sequence_logprobs(trainer, self.reference, sequences)

    def sequence_logprobs(self, trainer: Trainer, model: MoETransformer, sequences: TrainingSequences) -> torch.Tensor:
        """[B, S] log-probs of the samples' tokens under ``model`` (a whole one), by this run's micro-batches,
        with generation's experts when the run replays them."""
        return sequence_logprobs(model, sequences, self.options, self.cfg.micro_batch, trainer.device)

    @torch.no_grad()
    def replay_diagnostics(self, trainer: Trainer, sequences: TrainingSequences) -> dict[str, float]:
        """One forward of the current weights *without* replay: the share of tokens routed elsewhere than
        in generation, and the train/generate log-prob gap that routing leaves. Under RL Fusion on the
        generation model, which holds the current weights whole (synced for this step)."""
        model = self.fusion.model if self.fusion is not None else trainer.run.stage.model
        start = time.perf_counter()
        gaps = []
        recorder = RoutingRecorder(model)
        record = sequences.expert_ids_BSMK
        assert record is not None
        chosen = torch.full_like(record, -1)  # positions after a chunk's longest row are padding: not compared
        with recorder:
            for chunk in forward_chunks(sequences, self.cfg.micro_batch, self.options.group_by_length):
                ids, labels = chunk.cut(sequences.input_ids_BS).to(trainer.device), chunk.cut(sequences.labels_BS)
                logp = policy_logprobs(model, ids, labels, self.options.grpo.temperature)
                chosen[chunk.rows, : chunk.length] = recorder.take(*ids.shape).cpu()
                gap = (logp.cpu() - chunk.cut(sequences.rollout_logp_BS)).abs()
                gaps.append(gap[labels != -100])
        stats = routing_mismatch(record, chosen, sequences.input_ids_BS != self.tokenizer.pad_id)
        gap = torch.cat(gaps)
        return {"replay_layer_mismatch": stats.layer_mismatch, "replay_token_mismatch": stats.token_mismatch,
                "logp_gap_no_replay_mean": float(gap.mean()), "logp_gap_no_replay_max": float(gap.max()),
                "replay_stats_time_s": time.perf_counter() - start}

    # ----- after the step -----
    def after_step(self, trainer: Trainer, step: int, batch: StepBatch) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        start = time.perf_counter()
        stats = self.last_stats
        if stats is not None:
            # One read of the objective's sums (all-reduced, so every rank logs the same row).
            world = trainer.dims.get_group("world")
            dist.all_reduce(stats.sums, group=world)
            dist.all_reduce(stats.gap_abs_max, op=dist.ReduceOp.MAX, group=world)
            values = torch.cat([stats.sums, stats.gap_abs_max.reshape(1)]).tolist()
            # every TP rank of the last stage computes the objective on the whole sequence
            sums = [v / self.spec.parallel.tp for v in values[: len(STAT_FIELDS)]]
            extra.update(stats.summary(sums, values[-1]))
        last = min(self.cfg.steps, self.spec.run.stop_at or self.cfg.steps)
        every = self.options.eval_every
        extra["stats_time_s"] = time.perf_counter() - start
        if step == last or (every and step % every == 0):
            start = time.perf_counter()
            extra["heldout_accuracy"] = self.evaluate(trainer)
            extra["eval_time_s"] = time.perf_counter() - start
        return extra

    @torch.no_grad()
    def evaluate(self, trainer: Trainer, problems: list[Problem] | None = None) -> float:
        """Greedy accuracy on held-out problems (the fixed evaluation set by default); under RL Fusion each
        generation replica scores its share, on weights synced to the current version."""
        problems = problems if problems is not None else self.eval_problems
        mine = problems
        if self.fusion is not None:
            self.fusion.ensure_synced(trainer.step)
            per = -(-len(problems) // self.fusion.replicas)
            mine = problems[self.fusion.replica * per:(self.fusion.replica + 1) * per]
        assert self.engine is not None
        correct = greedy_correct(self.engine, self.task, self.tokenizer, mine, self.max_new_tokens, trainer.step)
        if self.fusion is not None:
            self.engine.free_cache()
            # on the device the group communicates on (NCCL takes device tensors only)
            total = torch.tensor([correct], dtype=torch.float64, device=trainer.device)
            dist.all_reduce(total, group=self.fusion.group)
            correct = float(total) / self.fusion.options.gen_ep
        return correct / max(len(problems), 1)

    def describe(self, trainer: Trainer) -> str:
        o = self.options
        return (f"GRPO on {o.task}: {self.cfg.steps} steps × {o.prompts_per_step} prompts × {o.grpo.group_size} "
                f"samples, ≤{self.max_new_tokens} new tokens, T={o.grpo.temperature}, router replay "
                f"{'on' if o.replay else 'off'} · model {trainer.model_cfg.name} · {trainer.device_text()}"
                + self.fusion_text())

    def fusion_text(self) -> str:
        if self.fusion is None:
            return ""
        p = self.spec.parallel
        axes = ("tp", "pp", "dp", "ep", "etp")
        train = "×".join(f"{axis}{getattr(p, axis)}" for axis in axes if getattr(p, axis) > 1)
        return (f" · RL Fusion on {self.spec.world_size} ranks: train {train or 'dp1'}, generate in "
                f"{self.fusion.replicas} replicas, offload {self.fusion.options.offload}")

    def summary(self, trainer: Trainer) -> Table:
        return rl_summary_table(trainer.metrics.rows, f"{trainer.model_cfg.name}: GRPO on {self.options.task}")


@torch.no_grad()
def sequence_logprobs(model: MoETransformer, sequences: TrainingSequences, options: RLOptions, micro_batch: int,
                      device: torch.device) -> torch.Tensor:
    """[B, S] log-probs of the samples' tokens under a whole ``model``, ``micro_batch`` rows at a time, with
    generation's experts when ``options.replay`` (a reference, a proximal policy: no gradient)."""
    replay = sequences.expert_ids_BSMK if options.replay else None
    logp_BS = torch.zeros(sequences.labels_BS.shape)
    for chunk in forward_chunks(sequences, micro_batch, options.group_by_length):
        record = chunk.cut(replay)
        logp = policy_logprobs(model, chunk.cut(sequences.input_ids_BS).to(device), chunk.cut(sequences.labels_BS),
                               options.grpo.temperature, None if record is None else record.to(device))
        logp_BS[chunk.rows, : chunk.length] = logp.cpu()
    return logp_BS


@torch.no_grad()
def greedy_correct(engine: RolloutEngine, task: Task, tokenizer: CharTokenizer, problems: list[Problem],
                   max_new_tokens: int, weight_version: int = 0) -> float:
    """How many of ``problems`` the engine's model answers right, greedily (``EVAL_BATCH`` at a time)."""
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(tokenizer.eos_id,))
    correct = 0.0
    for start in range(0, len(problems), EVAL_BATCH):
        chunk = problems[start:start + EVAL_BATCH]
        generation = engine.generate([prompt_ids(tokenizer, p) for p in chunk], greedy, weight_version=weight_version)
        for row, problem in enumerate(chunk):
            correct += task.score(problem, tokenizer.decode(generation.completion(row)))
    return correct


def forward_chunks(sequences: TrainingSequences, micro_batch: int, group_by_length: bool) -> list[Chunk]:
    """The chunks of a whole model's forward over all the samples (a log-prob forward): the micro-batches
    of the one-process run (``Batching``: ``micro_batch`` rows, each chunk cut to its longest sample)."""
    return Batching(micro_batch, group_by_length=group_by_length).chunks(sequences.labels_BS)


def step_problems(task: Task, options: RLOptions, seed: int, step: int) -> list[Problem]:
    """The prompts of step ``step``, each repeated group_size times (groups contiguous): a function of
    (seed, step), whichever process generates them (one process, RL Fusion, a StaleSync rollout worker)."""
    count, group = options.prompts_per_step, options.grpo.group_size
    problems = [problem_at(task, seed, "rl", step * count + i) for i in range(count)]
    return [problem for problem in problems for _ in range(group)]


def scored_rollouts(task: Task, tokenizer: CharTokenizer, grpo: GRPOConfig, problems: list[Problem],
                    generation: Generation) -> Rollouts:
    """The samples scored by the task's exact scorer, with their group-normalised advantages."""
    texts = [tokenizer.decode(generation.completion(row)) for row in range(len(problems))]
    rewards_B = torch.tensor([task.score(p, text) for p, text in zip(problems, texts)])
    advantages_B = group_advantages(rewards_B, grpo.group_size, grpo.scale_rewards, grpo.eps)
    return Rollouts(problems, generation, texts, rewards_B, advantages_B)


def rollout_metrics(rollouts: Rollouts, group_size: int, current_version: int) -> dict[str, Any]:
    """The step's samples in numbers: reward, accuracy, groups without signal, lengths, generation speed."""
    generation, rewards_B = rollouts.generation, rollouts.rewards_B
    groups_PG = rewards_B.view(-1, group_size)
    return {
        "reward": float(rewards_B.mean()),
        "accuracy": float((rewards_B >= 1).float().mean()),
        "uniform_groups": float((groups_PG.std(dim=1) == 0).float().mean()),
        "completion_len": float(generation.lengths_B.float().mean()),
        "stopped_frac": float(generation.stopped_B.float().mean()),
        "gen_time_s": generation.seconds,
        "gen_tokens_per_s": generation.num_generated / max(generation.seconds, 1e-9),
        "weight_version": generation.weight_version,
        "staleness": current_version - generation.weight_version,
    }


def rl_summary_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    steps = [r for r in rows if r.get("step", 0) > 0 and "reward" in r]
    evals = [r for r in rows if "heldout_accuracy" in r]
    if steps:
        head, tail = steps[: max(len(steps) // 5, 1)], steps[-max(len(steps) // 5, 1):]
        mean = lambda part, key: sum(r[key] for r in part) / len(part)
        table.add_row("steps", f"{steps[0]['step']}–{steps[-1]['step']}")
        table.add_row("reward, first → last fifth", f"{mean(head, 'reward'):.3f} → {mean(tail, 'reward'):.3f}")
        table.add_row("minutes", f"{sum(r['step_time_s'] for r in steps) / 60:.1f}")
        for key, label in (("replay_token_mismatch", "tokens routed elsewhere without replay"),
                           ("logp_gap_mean", "train/generate |Δlogp|, as trained"),
                           ("logp_gap_no_replay_mean", "train/generate |Δlogp| without replay")):
            values = [r[key] for r in steps if key in r]
            if values:
                table.add_row(label, f"{sum(values) / len(values):.2e}" if "gap" in key
                              else f"{sum(values) / len(values):.1%}")
    if evals:
        table.add_row("held-out accuracy",
                      " → ".join(f"{r['heldout_accuracy']:.1%} (step {r['step']})" for r in (evals[0], evals[-1])))
    return table
