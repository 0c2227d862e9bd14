"""The RL run spec: everything one ``moetrain rl`` run needs, validated once, handed to every process whole.

``moetrain rl`` builds an ``RLRunSpec`` from its defaults, an optional ``--config rl.yaml`` and the
command-line flags, in that order of precedence (a later source overrides an earlier one field by field),
as ``moetrain train`` builds its ``RunSpec``. Every process of the run (the CLI's own, torchrun's ranks,
Ray's actors) reads the same spec, as one JSON file (``write_spec`` / ``read_spec``, named in
``MOETRAIN_RL_SPEC``), and builds its run from it with ``moetrain.rl.run.build_rl_run``.

Sections: the model (and the weights it starts from), the SFT warm-up, GRPO and its sampling (``rl``),
the trainer's run (a ``RunSpec``: training, parallel layout, run options), the generation layout, the
rollout pool, StaleSync (placement, staleness k, the reward worker; the reference worker follows from
``rl.grpo.kl_coef``) and the engine that starts the workers.

The trainer's batch, sequence length, model and (unless given) micro-batch follow from the RL sections,
and the rollout pool from the generation layout: the spec fills them in, so the file every process reads
holds the numbers its run uses, and refuses a given value that disagrees.

Torch-free (pydantic only): the CLI validates a spec before anything heavy is imported.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moetrain.config.model import ModelConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.config.presets import load_model_config
from moetrain.config.run import RunSpec, check_layout_counts, fill_data_parallel, merge_sources
from moetrain.errors import UserError, describe_validation_error
from moetrain.rl.config import FusionOptions, GRPOConfig, RLOptions, StaleSyncOptions, WarmupCriterion
from moetrain.rl.roles import Roles
from moetrain.rl.tasks import get_task, new_tokens_for, sequence_len_for

DEFAULT_MODEL = "tiny-pangu"
SPEC_ENV = "MOETRAIN_RL_SPEC"
"""The variable naming the spec file a rank of a multi-process run reads."""
SPEC_FILE = "rl_spec.json"


class WarmupSpec(BaseModel):
    """The supervised warm-up on reference answers of the task's training split (``moetrain.rl.warmup``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    steps: int = Field(default=600, ge=0)
    """Most SFT steps (and the horizon of its learning-rate schedule); the criterion stops it sooner; 0 skips it."""
    batch: int = Field(default=64, gt=0)
    """Examples per SFT step."""
    lr: float = Field(default=3e-3, gt=0)
    """Peak SFT learning rate."""
    criterion: WarmupCriterion = Field(default_factory=WarmupCriterion)
    """When the warm-up stops before its step cap."""


class RolloutPool(BaseModel):
    """The generation replicas. Under RL Fusion (and colocated StaleSync) every training rank generates,
    ``ranks / generation.gen_ep`` replicas of ``gen_ep`` ranks each, and the pool follows from that. The
    disaggregated pipeline runs ``replicas`` rollout replicas of ``ranks_per_replica`` ranks each on ranks
    of their own, beside the trainer group: a replica of one rank holds the whole model, one of G ranks
    generates in the EP layout ``generation.gen_ep`` = G (the experts split over its ranks, the dense
    tensors whole on each), the TP layout ``generation.gen_tp`` = G (the heads and dense FFN columns
    split over its ranks, the experts whole on each), or both (G = gen_tp·gen_ep: the experts split over
    the gen_ep ranks at each TP position). Left empty, the spec fills them in; a pool sized otherwise is
    not built yet and is refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    replicas: int | None = Field(default=None, gt=0)
    ranks_per_replica: int | None = Field(default=None, gt=0)


def _rl_defaults() -> dict[str, Any]:
    return {"filter_groups": True, "replay_stats_every": 10, "eval_every": 20}


def _trainer_defaults() -> dict[str, Any]:
    return {"training": {"steps": 200, "lr": 3e-4, "warmup_steps": 5}, "run": {"cluster": "cpu"}}


SECTION_DEFAULTS = {"rl": _rl_defaults, "trainer": _trainer_defaults}
"""Where ``moetrain rl``'s defaults differ from the option classes' own (which library callers and tests use):
DAPO's group filter on, fewer no-replay diagnostics and evaluations, GRPO's steps and learning rate, and the
CPU cluster preset for MFU."""

DERIVED = {
    "global_batch": "rl.prompts_per_step × rl.grpo.group_size",
    "seq_len": "the task's longest prompt and rl.max_new_tokens (rounded up to a multiple of tp)",
}
"""The trainer's training fields the RL sections decide, and what they follow from."""


class RLRunSpec(BaseModel):
    """One RL run: what it learns, in which layouts, where the workers run."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    """Model preset name or YAML file (default: the model of ``start_from``, else tiny-pangu)."""
    start_from: str | None = None
    """Start from these weights (``--from``): a moetrain checkpoint (save dir or step folder) or a Hugging
    Face model folder."""
    initial_weights: str | None = None
    """GRPO's starting weights as a state-dict file (``torch.save``), in place of the warm-up and of
    ``start_from``'s weights: what ``moetrain rl`` hands the ranks of a disaggregated run after running the
    warm-up itself."""
    sft: WarmupSpec = Field(default_factory=WarmupSpec)
    rl: RLOptions = Field(default_factory=lambda: RLOptions(**_rl_defaults()))
    """The task, GRPO's constants, sampling, router replay and evaluation."""
    trainer: RunSpec = Field(default_factory=lambda: RunSpec(**_trainer_defaults()))
    """GRPO's run: steps, learning rate, micro-batch and seed (``training``), the training layout
    (``parallel``), device, threads, outputs and checkpoints (``run``; the warm-up saves under
    ``save_dir/sft``, GRPO under ``save_dir/rl``)."""
    generation: FusionOptions = Field(default_factory=FusionOptions)
    """The generation layout of each replica and the weight sync into it (RL Fusion)."""
    rollout: RolloutPool = Field(default_factory=RolloutPool)
    stalesync: StaleSyncOptions | None = None
    """Rollout and training as concurrent workers on samples at most k versions old: the placement, k, the
    loss's staleness correction, a reward worker (None: the synchronous loop)."""
    engine: Literal["local", "ray"] = "local"
    """What starts the disaggregated pipeline's workers: torchrun (local) or Ray actors."""
    plot: str | None = None
    """The reward-curve PNG (default: beside ``trainer.run.metrics_out``, else in ``trainer.run.save_dir``)."""

    @model_validator(mode="before")
    @classmethod
    def _defaults_and_batch(cls, data: Any) -> Any:
        """Lay the sections given as mappings over ``moetrain rl``'s defaults (a section given whole, as a
        model, is taken as it is), and give the trainer the step's batch before its own checks run."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, defaults in SECTION_DEFAULTS.items():
            if isinstance(data.get(name, {}), dict):
                data[name] = merge_sources(defaults(), data.get(name, {}))
        trainer = data["trainer"]
        if isinstance(trainer, dict) and isinstance(trainer.get("training", {}), dict):
            batch = _step_samples(data["rl"])
            if batch is not None:
                data["trainer"] = {**trainer, "training": _with_batch(trainer, batch)}
        return data

    @model_validator(mode="after")
    def _derived(self) -> RLRunSpec:
        self.trainer = _trainer_run(self)
        self.rollout = _rollout_pool(self)
        generation = self.generation
        if self.disaggregated and min(generation.gen_tp, generation.gen_ep) == 1:
            # one number for a one-axis replica's EP (or TP) degree: the pool's ranks per replica (a TP×EP
            # replica's T·E ranks follow from its two degrees)
            axis = "gen_tp" if generation.gen_tp > 1 else "gen_ep"
            self.generation = generation.model_copy(update={axis: self.rollout.ranks_per_replica})
        self.stalesync = _stalesync_sync_buckets(self)
        _check_placement(self)
        _check_one_process_generation(self)
        _check_restarts(self)
        if self.plot is None:
            self.plot = default_plot(self.trainer)
        return self

    @property
    def samples_per_step(self) -> int:
        return self.rl.prompts_per_step * self.rl.grpo.group_size

    @property
    def disaggregated(self) -> bool:
        return self.stalesync is not None and self.stalesync.placement == "disaggregated"

    @property
    def roles(self) -> Roles:
        """The disaggregated run's groups on its ranks (``moetrain.rl.roles``)."""
        assert self.stalesync is not None and self.rollout.replicas is not None
        assert self.rollout.ranks_per_replica is not None
        return Roles(self.stalesync.reward_worker, self.rl.grpo.kl_coef > 0, self.rollout.replicas,
                     self.trainer.world_size, self.rollout.ranks_per_replica, self.generation.gen_tp)

    @property
    def model_name(self) -> str:
        """What the trainer's run spec names: the model, else the starting weights', else the default."""
        return self.model or self.start_from or DEFAULT_MODEL


def _step_samples(rl: Any) -> int | None:
    """Samples per GRPO step of the ``rl`` section, when its counts are valid (else its own error tells)."""
    if isinstance(rl, RLOptions):
        return rl.prompts_per_step * rl.grpo.group_size
    if not isinstance(rl, dict):
        return None
    grpo = rl.get("grpo", {})
    prompts = rl.get("prompts_per_step", RLOptions.model_fields["prompts_per_step"].default)
    group = grpo.group_size if isinstance(grpo, GRPOConfig) else \
        grpo.get("group_size", GRPOConfig.model_fields["group_size"].default) if isinstance(grpo, dict) else None
    valid = all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (prompts, group))
    return prompts * group if valid else None


def _with_batch(trainer: dict[str, Any], batch: int) -> dict[str, Any]:
    """The trainer's training section with the step's batch and, unless given, one micro-batch per
    data-parallel rank."""
    training = dict(trainer.get("training", {}))
    given = training.get("global_batch", batch)
    if given != batch:
        raise ValueError(f"trainer.training.global_batch {given}: RL sets it to {batch} ({DERIVED['global_batch']}); "
                         "drop it")
    training["global_batch"] = batch
    parallel = trainer.get("parallel", {})
    dp = parallel.dp if isinstance(parallel, ParallelConfig) else parallel.get("dp", 1) if isinstance(parallel, dict) \
        else None
    if "micro_batch" not in training and isinstance(dp, int) and dp > 0:
        if batch % dp:  # else one micro-batch a rank would leave a remainder: a global_batch/micro_batch riddle
            raise UserError(f"the {batch} samples per step (--prompts × --group-size, rl.prompts_per_step × "
                            f"rl.grpo.group_size) do not split over the trainer's {dp} data-parallel ranks "
                            f"(--nproc ÷ tp·cp·pp); make --prompts × --group-size a multiple of {dp}, or give an "
                            f"--nproc whose dp divides {batch}")
        training["micro_batch"] = max(batch // dp, 1)
    micro = training["micro_batch"]
    if isinstance(micro, int) and micro > 0 and isinstance(dp, int) and dp > 0 and batch % dp == 0 \
            and (batch // dp) % micro:
        # else the trainer's check names a global_batch the user never set (it is prompts × group size)
        ranks = "the trainer's one rank" if dp == 1 else f"each of the trainer's {dp} data-parallel ranks"
        raise UserError(f"--micro-batch {micro} (trainer.training.micro_batch): a step's {batch} samples "
                        f"(--prompts × --group-size) give {ranks} {batch // dp}, which micro-batches of {micro} "
                        f"do not split; give a --micro-batch that divides {batch // dp}")
    return training


def _trainer_run(spec: RLRunSpec) -> RunSpec:
    """The trainer's ``RunSpec`` with the sequence length and the model RL decides (a given one must agree)."""
    trainer = spec.trainer
    training = trainer.training
    task = get_task(spec.rl.task)
    tp = trainer.parallel.tp
    seq_len = -(-sequence_len_for(task, new_tokens_for(task, spec.rl.max_new_tokens)) // tp) * tp
    if training.global_batch != spec.samples_per_step:  # a trainer given whole, as a RunSpec
        raise ValueError(f"trainer.training.global_batch {training.global_batch}: RL sets it to "
                         f"{spec.samples_per_step} ({DERIVED['global_batch']}); drop it")
    if "seq_len" in training.model_fields_set and training.seq_len != seq_len:
        raise ValueError(f"trainer.training.seq_len {training.seq_len}: RL sets it to {seq_len} "
                         f"({DERIVED['seq_len']}); drop it")
    if "model" in trainer.model_fields_set and trainer.model != spec.model_name:
        raise ValueError(f"trainer.model {trainer.model}: the model is set once, at the top (model: "
                         f"{spec.model_name}); drop trainer.model")
    if training.seq_len == seq_len and trainer.model == spec.model_name:
        return trainer
    data = trainer.model_dump()
    data["model"] = spec.model_name
    data["training"] = {**data["training"], "seq_len": seq_len}
    data["parallel"] = {k: v for k, v in data["parallel"].items() if k not in ("sp", "micro_batch")}
    return RunSpec(**data)


def _rollout_pool(spec: RLRunSpec) -> RolloutPool:
    """The pool the placement runs; a given size must be one it runs."""
    pool = spec.rollout
    if spec.disaggregated:
        return _disaggregated_pool(spec)
    if spec.generation.gen_tp > 1:
        raise ValueError(f"generation.gen_tp {spec.generation.gen_tp}: tensor-parallel generation runs in the "
                         "disaggregated pipeline's rollout replicas only (not built yet for RL Fusion or the "
                         "colocated placement); drop --gen-tp or give --staleness K --placement disaggregated")
    world = spec.trainer.world_size
    ranks = spec.generation.gen_ep if world > 1 else 1
    replicas = spec.generation.replicas(world) if world > 1 else 1
    how = f"every one of the {world} training ranks generates: ranks / generation.gen_ep replicas of gen_ep ranks"
    for field, value in (("replicas", replicas), ("ranks_per_replica", ranks)):
        given = getattr(pool, field)
        if given is not None and given != value:
            raise ValueError(f"rollout.{field} {given}: not built yet ({how}: {value} here); drop it")
    return RolloutPool(replicas=replicas, ranks_per_replica=ranks)


def _disaggregated_pool(spec: RLRunSpec) -> RolloutPool:
    """R replicas of G ranks: G is ``rollout.ranks_per_replica``, ``generation.gen_ep`` or ``generation.gen_tp``
    (one number, set once); the prompts must split over the replicas, and the experts (EP) or the heads
    (TP) over a replica's ranks."""
    pool, gen_ep, gen_tp = spec.rollout, spec.generation.gen_ep, spec.generation.gen_tp
    if gen_tp > 1:
        return _tp_pool(spec)
    replicas = pool.replicas or 1
    ranks = pool.ranks_per_replica or gen_ep
    if "gen_ep" in spec.generation.model_fields_set and ranks != gen_ep:
        raise ValueError(f"rollout.ranks_per_replica {ranks} differs from generation.gen_ep {gen_ep}: a "
                         "disaggregated replica of G ranks generates in the EP layout gen_ep = G; set one of them")
    _check_replicas_split_prompts(spec, replicas)
    experts = _experts(spec)
    if ranks > 1 and experts is not None and experts % ranks:
        raise ValueError(f"rollout.ranks_per_replica {ranks}: {spec.model_name}'s {experts} experts do not split "
                         f"over a replica's {ranks} ranks (each holds experts / ranks of every MoE layer); give "
                         "--gen-ep a divisor of the experts")
    return RolloutPool(replicas=replicas, ranks_per_replica=ranks)


def _check_replicas_split_prompts(spec: RLRunSpec, replicas: int) -> None:
    if spec.rl.prompts_per_step % replicas:
        raise ValueError(f"rollout.replicas {replicas}: the {spec.rl.prompts_per_step} prompts per step do not "
                         "split over them (each replica generates and scores whole groups); make the prompts "
                         "a multiple")


def _tp_pool(spec: RLRunSpec) -> RolloutPool:
    """R replicas of T = ``generation.gen_tp`` ranks, the heads and dense FFN columns split over them; with
    ``generation.gen_ep`` = E > 1, of T·E ranks, the experts split over the E ranks at each TP position too."""
    pool, gen_tp, gen_ep = spec.rollout, spec.generation.gen_tp, spec.generation.gen_ep
    ranks = pool.ranks_per_replica or gen_tp * gen_ep
    if ranks != gen_tp * gen_ep:
        if gen_ep > 1:
            raise ValueError(f"rollout.ranks_per_replica {ranks} differs from generation.gen_tp·gen_ep = "
                             f"{gen_tp}·{gen_ep}: a disaggregated replica of TP×EP generates on T·E ranks; set "
                             f"ranks_per_replica {gen_tp * gen_ep} or leave it out")
        raise ValueError(f"rollout.ranks_per_replica {ranks} differs from generation.gen_tp {gen_tp}: a "
                         "disaggregated replica of G ranks generates in the TP layout gen_tp = G; set one of them")
    replicas = pool.replicas or 1
    _check_replicas_split_prompts(spec, replicas)
    experts = _experts(spec)
    if gen_ep > 1 and experts is not None and experts % gen_ep:
        raise ValueError(f"generation.gen_ep {gen_ep}: {spec.model_name}'s {experts} experts do not split over "
                         f"the {gen_ep} expert-parallel ranks at each TP position of a replica; give --gen-ep a "
                         "divisor of the experts")
    shape = _model_shape(spec)
    if shape is not None:
        for what, count in (("attention heads", shape.attention.num_heads),
                            ("kv heads", getattr(shape.attention, "num_kv_heads", shape.attention.num_heads)),
                            ("dense FFN columns", shape.dense_ffn_hidden)):
            if count % gen_tp:
                raise ValueError(f"generation.gen_tp {gen_tp}: {spec.model_name}'s {count} {what} do not split "
                                 f"over a replica's {gen_tp} tensor-parallel ranks; give --gen-tp a divisor of "
                                 f"{count}")
    return RolloutPool(replicas=replicas, ranks_per_replica=ranks)


def _model_shape(spec: RLRunSpec) -> ModelConfig | None:
    """The model's config, when the spec names a preset or a model file (a ``start_from`` checkpoint's
    model is read by the run: it checks again)."""
    if spec.model is None and spec.start_from is not None:
        return None
    try:
        return load_model_config(spec.model_name)
    except UserError:
        return None  # the run names a bad model in its own words


def _experts(spec: RLRunSpec) -> int | None:
    """The model's experts per MoE layer (0: a dense model), when the spec names a preset or a model file
    (a ``start_from`` checkpoint's model is read by the run: it checks again)."""
    shape = _model_shape(spec)
    if shape is None:
        return None
    return shape.moe.num_experts if shape.moe is not None else 0


def _stalesync_sync_buckets(spec: RLRunSpec) -> StaleSyncOptions | None:
    """StaleSync's weight push uses the generation's bucket size: the size is set once."""
    stale = spec.stalesync
    if stale is None:
        return None
    if "bucket_mib" in stale.model_fields_set and stale.bucket_mib != spec.generation.bucket_mib:
        raise ValueError(f"stalesync.bucket_mib {stale.bucket_mib} differs from generation.bucket_mib "
                         f"{spec.generation.bucket_mib}: set the weight-sync bucket once, in generation")
    return stale.model_copy(update={"bucket_mib": spec.generation.bucket_mib})


def _check_placement(spec: RLRunSpec) -> None:
    """Refuse the combinations of placement, engine and ranks that are not built."""
    stale = spec.stalesync
    if stale is None:
        if spec.engine != "local":
            raise UserError("--engine ray starts StaleSync's workers: give --staleness K (a stalesync section)")
        return
    if spec.engine == "ray" and stale.placement == "colocated":
        raise UserError("--engine ray runs the disaggregated placement (a rollout actor and a trainer actor); "
                        "--placement colocated runs in one process: drop --engine ray")
    if stale.reward_worker and stale.placement == "colocated":
        raise UserError("--reward-worker is a rank of the disaggregated pipeline: drop it or use --placement "
                        "disaggregated")
    if stale.partial_rollouts and stale.placement == "colocated":
        raise UserError("--partial-rollouts interrupts the disaggregated replicas' generations: drop it or use "
                        "--placement disaggregated")


def _check_one_process_generation(spec: RLRunSpec) -> None:
    """The generation layout and its weight sync are RL Fusion's, across ranks: the one-process synchronous
    loop generates on its own model and would ignore them."""
    if spec.stalesync is not None or spec.trainer.world_size > 1:
        return
    generation, defaults = spec.generation, FusionOptions()
    flags = {"gen_ep": "--gen-ep", "bucket_mib": "--sync-bucket-mib", "offload": "--offload"}
    values = {field: getattr(generation, field) for field in flags}
    values["bucket_mib"] = format(values["bucket_mib"], "g")  # 64, not 64.0: as typed
    given = [f"{flag} {values[field]} (generation.{field})" for field, flag in flags.items()
             if getattr(generation, field) != getattr(defaults, field)]
    if given:
        raise UserError(f"{', '.join(given)} set{'s' * (len(given) == 1)} how RL Fusion generates across ranks, but "
                        f"this run is one process: give --nproc N, or drop {'it' if len(given) == 1 else 'them'}")


def _check_restarts(spec: RLRunSpec) -> None:
    """``--max-restarts N``: torchrun restarts the ranks, each resuming from the newest GRPO checkpoint."""
    restarts = spec.trainer.run.max_restarts
    if restarts == 0:
        return
    if not spec.trainer.run.save_dir:
        raise UserError(f"--max-restarts {restarts} needs --save-dir (each restart resumes from the newest "
                        "checkpoint there; add --save-every K to lose at most K steps)")
    if not spec.disaggregated and spec.trainer.world_size == 1:
        raise UserError(f"--max-restarts {restarts} restarts the ranks torchrun starts; this run is one process: "
                        "give --nproc N or --staleness K")


def default_plot(trainer: RunSpec) -> str | None:
    """The reward curve beside the metrics rows, else in the save dir."""
    if trainer.run.metrics_out:
        return str(Path(trainer.run.metrics_out).with_suffix(".png"))
    if trainer.run.save_dir:
        return str(Path(trainer.run.save_dir) / "reward.png")
    return None


PATH_FIELDS = (("start_from",), ("initial_weights",), ("plot",), ("trainer", "run", "metrics_out"),
               ("trainer", "run", "save_dir"), ("trainer", "run", "log_dir"))
"""Made absolute, so every rank (a Ray actor too, whatever its folder) reads and writes the same files."""

RUN_SPEC_SECTIONS = frozenset(RunSpec.model_fields) - frozenset(RLRunSpec.model_fields)
"""Top-level keys of a training run.yaml (``moetrain train --config``) that an RL spec does not have."""


def resolve_rl_spec(sources: list[dict[str, Any]], names: list[str], world_size: int | None = None) -> RLRunSpec:
    """Merge the sources (later ones winning field by field) into a validated ``RLRunSpec``.
    ``world_size`` (``--nproc``) fills the trainer's ``parallel.dp`` and must agree with a given one.
    Raises ``UserError`` (one line) on any bad field, naming the source that set it (``names``, one per
    source: a file name, or what the caller calls its flags) and, for an unknown key, the valid ones."""
    merged = merge_sources(*copy.deepcopy(sources))  # filled in below: the sources stay as given
    check_layout_counts(merged, sources, names, ("trainer", "parallel"), "RL run spec")
    trainer = merged.get("trainer", {})
    if world_size is not None and isinstance(trainer, dict) and isinstance(trainer.get("parallel", {}), dict):
        # (a trainer or layout that is no mapping: the spec's own check below names it)
        trainer_ranks = world_size - sum(pipeline_ranks(merged).values())
        if trainer_ranks < 1:
            raise UserError(f"--nproc {world_size} leaves no trainer rank beside the disaggregated run's "
                            f"{world_size - trainer_ranks} rollout (and reward, reference) ranks; give more ranks "
                            "or fewer --rollout-replicas")
        fill_data_parallel(merged.setdefault("trainer", {}).setdefault("parallel", {}), trainer_ranks)
    for path in PATH_FIELDS:
        parent = _at(merged, path[:-1])
        if isinstance(parent, dict) and isinstance(parent.get(path[-1]), str):
            parent[path[-1]] = str(Path(parent[path[-1]]).resolve())
    try:
        return RLRunSpec(**merged)
    except ValidationError as exc:
        def setter(loc: tuple[str, ...]) -> str | None:
            # the last source that set this field (a later one overrides an earlier one)
            setting = [i for i, source in enumerate(sources) if _at(source, loc) is not None]
            return names[setting[-1]] if setting and loc else None

        # a check of the whole spec has no location: its message starts with the field it is about
        blamed = iter([setter(tuple(str(x) for x in item["loc"])) if item["loc"] else
                       setter(tuple(item["msg"].removeprefix("Value error, ").split(" ")[0].split(".")))
                       for item in exc.errors()])
        raise UserError(describe_validation_error("RL run spec", exc, RLRunSpec, lambda _loc: next(blamed))) from None


def pipeline_ranks(merged: dict[str, Any]) -> dict[str, int]:
    """The ranks of a disaggregated run (a merged source) beside the trainer group, by role: its rollout
    replicas', a reward and a reference worker's (none for the other placements: every rank trains)."""
    stale = merged.get("stalesync")
    if not isinstance(stale, dict) or stale.get("placement", "disaggregated") != "disaggregated":
        return {}
    pool = merged.get("rollout") if isinstance(merged.get("rollout"), dict) else {}
    generation = merged.get("generation") if isinstance(merged.get("generation"), dict) else {}
    replicas = pool.get("replicas") or 1
    gen_tp, gen_ep = generation.get("gen_tp") or 1, generation.get("gen_ep") or 1
    grpo = merged.get("rl", {}).get("grpo", {}) if isinstance(merged.get("rl"), dict) else {}
    kl = grpo.get("kl_coef", 0) if isinstance(grpo, dict) else 0
    counts = [replicas, gen_tp, gen_ep, pool.get("ranks_per_replica") or 1, kl]
    if not all(isinstance(n, int | float) and not isinstance(n, bool) for n in counts):
        return {}  # the spec's own check names the bad field
    ranks = pool.get("ranks_per_replica") or gen_tp * gen_ep
    return {"rollout": int(replicas * ranks), "reward": int(bool(stale.get("reward_worker"))),
            "reference": int(kl > 0)}


def check_spec_kind(data: dict[str, Any], where: str) -> None:
    """Refuse a file of another kind (a training run.yaml, a plan) given as an RL spec, in one line."""
    stray = sorted(set(data) & RUN_SPEC_SECTIONS)
    if stray and not set(data) & (set(RLRunSpec.model_fields) - {"model"}):
        sections = f"{', '.join(stray)} section{'s are' if len(stray) > 1 else ' is'}"
        raise UserError(f"{where} is not an RL run spec: its {sections} a training run's (moetrain "
                        f"train --config or --plan); moetrain rl --config takes sections "
                        f"{', '.join(RLRunSpec.model_fields)} (a training run's sections go under trainer)")


PLAN_SECTIONS = ("trainer", "generation", "rollout", "stalesync")
"""What an RL plan (``moetrain plan --rl``) sets: the layout of the run. Flags and a ``--config`` that set them
too are refused beside ``--plan`` (as ``moetrain train --plan`` refuses layout flags)."""
TRAINING_PLAN_KEYS = frozenset({"parallel", "predicted", "runtime_support"})
"""Top-level keys of a training plan.yaml (``moetrain plan`` without ``--rl``)."""


def plan_source(data: dict[str, Any], where: str) -> dict[str, Any]:
    """An RL plan's sections as a source of ``resolve_rl_spec`` (between ``--config`` and the flags); a file
    of another kind (a training plan.yaml, a training run.yaml) is one line naming its kind."""
    if "parallel" in data and set(data) & TRAINING_PLAN_KEYS - {"parallel"}:
        raise UserError(f"{where} is a training plan (moetrain plan without --rl: its "
                        f"{', '.join(sorted(set(data) & TRAINING_PLAN_KEYS))}): run it with moetrain train --plan, "
                        "or write an RL plan with moetrain plan --rl")
    check_spec_kind(data, where)
    if not set(data) & set(PLAN_SECTIONS):
        raise UserError(f"{where} sets no layout ({', '.join(PLAN_SECTIONS)}): give it as --config, or write an RL "
                        "plan with moetrain plan --rl")
    return data


def write_spec(spec: RLRunSpec, folder: Path) -> Path:
    """The spec as the one file every process of the run reads."""
    path = folder / SPEC_FILE
    path.write_text(spec.model_dump_json(indent=1), encoding="utf-8")
    return path


def read_spec(path: Path) -> RLRunSpec:
    return RLRunSpec.model_validate_json(path.read_text(encoding="utf-8"))


def _at(source: Any, loc: tuple[str, ...]) -> Any:
    for key in loc:
        if not isinstance(source, dict) or key not in source:
            return None
        source = source[key]
    return source
