"""The run spec: everything one training run needs, validated once, handed to every rank whole.

``moetrain train`` builds a ``RunSpec`` from defaults, an optional ``--config run.yaml``, an optional
``--plan plan.yaml`` (the file ``moetrain plan --out`` writes) and the command-line flags, in that order
of precedence (a later source overrides an earlier one field by field). A multi-rank run writes the
validated spec as JSON for its ranks; the worker that users start themselves with ``torchrun`` on
several nodes builds the same object from the same sources, so both see the same defaults and checks.

Torch-free (pydantic only): the planner and the CLI import it without the runtime.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moetrain.config import limits
from moetrain.config.parallel import ParallelConfig
from moetrain.config.training import TrainingConfig
from moetrain.errors import UserError, describe_validation_error

MemoryPolicyName = Literal["none", "full", "selective", "auto"]
SaveErrorChoice = Literal["continue", "stop"]
DocumentMaskChoice = Literal["auto", "dense", "block"]
DEVICES = "'auto', 'cpu', 'cuda' or 'cuda:N' (N: a GPU's index)"
"""The devices a run (and ``moetrain profile``) takes, as a refusal lists them."""
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def is_device(name: str) -> bool:
    """One of ``DEVICES``: any other name would reach ``torch.device`` (a traceback) or a backend never run."""
    return _DEVICE.fullmatch(name) is not None


class RunOptions(BaseModel):
    """How to run (not what to learn): device, data, paths, checkpoints, progress."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    device: str = "auto"
    """cpu, cuda, cuda:N or auto (cuda when available). Each rank of a multi-rank CUDA run takes its local GPU."""
    threads: int | None = Field(default=None, ge=1)
    """CPU threads of torch in each rank (default: the free cores this process may use, shared among the ranks,
    at least one each; ``OMP_NUM_THREADS`` where set: ``moetrain.threads``)."""
    cluster: str = "auto"
    """Cluster preset (or YAML file) whose peak FLOP/s the MFU divides by; auto: cpu on CPU, on a GPU the preset
    of its name (``moetrain.config.cluster_for_device``: an H200 is h200-sxm-141gb)."""
    data: str | None = None
    """The user's .txt/.jsonl file or folder; None: the embedded Shakespeare corpus."""
    synthetic_data: bool = False
    """Counting sequences instead of a corpus (benchmarks that must not depend on a tokenizer)."""
    metrics_out: str | None = None
    tensorboard: str | None = None
    """Also write the metrics rows as TensorBoard scalars to this folder (optional ``tensorboard`` package)."""
    trace_routing: str | None = None
    """Write per step and MoE layer the global tokens routed to each expert (JSONL)."""
    save_dir: str | None = None
    save_every: int = Field(default=0, ge=0)
    """Save every this many steps (0: only at the end and at stop_at)."""
    stop_at: int | None = Field(default=None, gt=0)
    """End after this step as if interrupted, saving a checkpoint; the schedule still spans every step."""
    resume: bool = False
    max_restarts: int = Field(default=0, ge=0, le=limits.MAX_RESTARTS)
    """Restarts of the whole group (torchrun's elastic agent) after a rank fails; each resumes every rank
    from the newest complete checkpoint in ``save_dir``. 0: a failure ends the run."""
    async_save: bool = False
    """Write checkpoints in the background (DCP ``async_save`` from a host copy); the ``COMPLETE`` marker is
    written once the write has finished, checked at the next save and at the end."""
    keep_last: int | None = Field(default=None, ge=1)
    """Keep the newest this many complete checkpoints, deleting older ones once a newer one is complete
    (None: keep every one)."""
    on_save_error: SaveErrorChoice = "stop"
    """A save that fails (a full disk, a permission) keeps the previous checkpoint; then ``stop`` ends the
    run, ``continue`` trains on and saves again at the next save."""
    quiet: bool = False
    ranks_per_node: int | None = Field(default=None, gt=0)
    """Node size for the hierarchical all-to-all (default: the launcher's ranks on one node)."""
    trace_dir: str | None = None
    """Write each rank's timeline of compute and communication spans (Chrome trace JSON) here."""
    log_dir: str | None = None
    """A multi-rank run's torchrun log and the ranks' error lines (default: a new temporary folder)."""
    timeout_s: float = Field(default=60.0, gt=0)
    """Collective timeout: a rank waiting on a dead peer gives up after this long."""
    startup_timeout_s: float = Field(default=600.0, gt=0)
    """Collective timeout until the first step ends (``timeout_s`` if that is longer): loading a checkpoint,
    building and compiling the model can keep one rank minutes behind its peers."""
    compile: bool | None = None
    """``torch.compile`` each decoder layer (None: on for CUDA, off for CPU, where compiling a small model
    takes longer than it saves)."""
    document_mask: DocumentMaskChoice = "auto"
    """How attention masks packed documents: ``block`` (FlexAttention tiles, in compiled CUDA layers only: the
    compiler generates its kernel, and it has no CPU backward), ``dense`` (a boolean mask), ``auto`` (block
    in compiled CUDA layers, else dense)."""

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if not is_device(device):
            raise ValueError(f"Input should be {DEVICES}")
        return device

    @property
    def first_step_timeout_s(self) -> float:
        """The collective timeout a run joins with, lowered to ``timeout_s`` after its first step."""
        return max(self.startup_timeout_s, self.timeout_s)


class MemoryOptions(BaseModel):
    """Selective recompute and swap (``moetrain.memory``); a plan's ``recompute`` sets the policy."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    policy: MemoryPolicyName = "none"
    budget_fraction: float | None = Field(default=None, gt=0, le=1)
    """Activation budget as a fraction of the no-recompute activation bytes."""
    budget_gib: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_budget(self) -> MemoryOptions:
        if self.budget_fraction is not None and self.budget_gib is not None:
            raise ValueError("give one of budget_fraction and budget_gib, not both")
        if self.policy == "auto" and self.budget_fraction is None and self.budget_gib is None:
            raise ValueError("--policy auto needs a budget: add --budget-fraction F or --budget-gib G "
                             "(memory.budget_fraction or budget_gib in a config)")
        return self


class BalanceOptions(BaseModel):
    """Online expert balancing (``moetrain.balance``): migrate and replicate hot experts while training."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = False
    interval: int | None = Field(default=None, gt=0)
    """Steps between full re-plans (drift is checked every step)."""
    horizon: int | None = Field(default=None, gt=0)
    """Steps over which a migration must repay its cost."""
    slots_per_rank: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _tuning_needs_enabled(self) -> BalanceOptions:
        tuning = {"interval": self.interval, "horizon": self.horizon, "slots_per_rank": self.slots_per_rank}
        given = [name for name, value in tuning.items() if value is not None]
        if not self.enabled and given:
            # a run spec names fields and the CLI flags: say both, as either may have set them
            flags = ", ".join(f"--{'balance-' * (name != 'slots_per_rank')}{name.replace('_', '-')}" for name in given)
            verb, them = ("tunes", "it") if len(given) == 1 else ("tune", "them")
            raise ValueError(f"{', '.join(given)} ({flags}) {verb} online balancing, which is off; add "
                             f"--online-balance (enabled: true) or drop {them}")
        return self


class GuardOptions(BaseModel):
    """Bad-step guards (``moetrain.train.guards``): a step whose loss or gradient norm is not finite is
    always skipped; these decide when the run rolls back to its last checkpoint instead."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    spike_factor: float | None = Field(default=None, gt=1)
    """Roll back when a step's loss exceeds this multiple of the median of the last ``spike_window``
    finite losses. None (the default): never; what counts as a spike depends on the run (a fast early
    descent, a small noisy batch), so the user sets it from their own curves."""
    spike_window: int = Field(default=20, ge=1)
    """Finite losses the median is taken over; no step is judged a spike before there are this many."""
    max_bad_steps: int = Field(default=5, ge=1)
    """Roll back after this many skipped (non-finite) steps in a row: one is noise, a run of them means
    the weights or the data went bad."""


class RunSpec(BaseModel):
    """Model, training, parallel layout and run options of one run."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = "tiny-pangu"
    """Model preset name or YAML file."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """The layout. Sequence parallelism is decided here: it is on exactly when tp > 1 (the runtime always
    shards the residual stream's sequence over the TP group); ``micro_batch`` is the training's."""
    run: RunOptions = Field(default_factory=RunOptions)
    memory: MemoryOptions = Field(default_factory=MemoryOptions)
    balance: BalanceOptions = Field(default_factory=BalanceOptions)
    guards: GuardOptions = Field(default_factory=GuardOptions)

    @model_validator(mode="before")
    @classmethod
    def _sequence_parallel_and_micro_batch(cls, data: Any) -> Any:
        """The one place that decides sequence parallelism, and the one micro-batch of the run."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        parallel = data.get("parallel", {})
        if not isinstance(parallel, dict | BaseModel) or not isinstance(data.get("training", {}), dict | BaseModel):
            return data  # not a section: the field's own validation names it
        parallel = parallel.model_dump(exclude_unset=True) if isinstance(parallel, BaseModel) else dict(parallel)
        training = data.get("training", {})
        training = training.model_dump() if isinstance(training, BaseModel) else dict(training)
        tp = parallel.get("tp", 1)
        if "sp" in parallel and bool(parallel["sp"]) != (tp > 1):
            raise ValueError(f"parallel.sp={parallel['sp']} with tp={tp}: the runtime runs sequence parallelism "
                             "exactly when tp > 1; drop sp (it follows tp)")
        parallel["sp"] = tp > 1
        micro = training.get("micro_batch", TrainingConfig.model_fields["micro_batch"].default)
        if isinstance(micro, int) and micro > 0:  # else training's own check names it, once
            if "micro_batch" in parallel and parallel["micro_batch"] != micro:
                raise ValueError(f"parallel.micro_batch={parallel['micro_batch']} differs from "
                                 f"training.micro_batch={micro}; set the micro-batch once, in training")
            parallel["micro_batch"] = micro
        data["parallel"], data["training"] = parallel, training
        return data

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def to_json(self) -> str:
        return self.model_dump_json()


def merge_sources(*sources: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge nested mappings, later sources winning field by field (defaults < file < plan < flags)."""
    merged: dict[str, Any] = {}
    for source in sources:
        for key, value in source.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = merge_sources(merged[key], value)
            else:
                merged[key] = value
    return merged


PLAN_LAYOUT_FIELDS = ("tp", "sp", "pp", "vpp", "ep", "etp", "cp", "dp", "zero", "a2a", "overlap")
"""The plan's ``parallel`` fields a run takes (``micro_batch`` goes to training, ``recompute`` to the
memory policy); an ``sp`` that disagrees with tp is refused by ``RunSpec``."""


def spec_source_from_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """The run-spec fields a plan file sets: its model, sequence length, global batch, layout,
    micro-batch, recompute level (as the memory policy) and, for the hierarchical all-to-all, its
    cluster's node size."""
    parallel = plan["parallel"]
    if isinstance(parallel, BaseModel):
        parallel = parallel.model_dump()
    source: dict[str, Any] = {
        "parallel": {k: parallel[k] for k in PLAN_LAYOUT_FIELDS if k in parallel},
        "training": {},
    }
    if "model" in plan:
        source["model"] = plan["model"]
    for field in ("seq_len", "global_batch"):
        if field in plan:
            source["training"][field] = plan[field]
    if "micro_batch" in parallel:
        source["training"]["micro_batch"] = parallel["micro_batch"]
    if parallel.get("recompute", "none") != "none":
        source["memory"] = {"policy": parallel["recompute"]}
    if parallel.get("a2a") == "hierarchical" and "cluster" in plan:
        # the node size the plan was searched for is the one its two-hop all-to-all assumes
        from moetrain.config.presets import load_cluster_config

        source["run"] = {"ranks_per_node": load_cluster_config(plan["cluster"]).devices_per_node}
    return source


def resolve_run_spec(sources: list[dict[str, Any]], world_size: int | None = None,
                     names: list[str] | None = None) -> RunSpec:
    """Merge the sources into a validated ``RunSpec``; ``world_size`` (``--nproc``, or torchrun's
    ``WORLD_SIZE``) fills ``parallel.dp`` when no source sets it and must agree when one does.
    Raises ``UserError`` (one line) on any bad field, naming the source that set it (``names``, one per
    source: a file name, or what the caller calls its flags) and, for an unknown key, the valid ones."""
    merged = merge_sources(*sources)
    check_layout_counts(merged, sources, names)
    if world_size is not None:
        fill_data_parallel(merged.setdefault("parallel", {}), world_size)
    try:
        return RunSpec(**merged)
    except ValidationError as exc:
        def origin(loc: tuple[str, ...]) -> str | None:
            # the last source that set this field (a later one overrides an earlier one); a section that
            # several sources filled is named as the run spec's
            setting = [i for i, source in enumerate(sources) if _holds(source, loc)]
            if not names or not setting or (len(setting) > 1 and isinstance(_at(sources[setting[-1]], loc), dict)):
                return None
            return names[setting[-1]]

        raise UserError(describe_validation_error("run spec", exc, RunSpec, origin)) from None


LAYOUT_COUNTS = ("tp", "cp", "pp", "dp", "vpp", "ep", "etp")
"""A layout's counts, multiplied and compared (``fill_data_parallel``, the sequence-parallel rule) before
pydantic checks their types."""


def check_layout_counts(merged: dict[str, Any], sources: list[dict[str, Any]], names: list[str] | None,
                        loc: tuple[str, ...] = ("parallel",), spec_name: str = "run spec") -> None:
    """A layout count at ``loc`` that is no whole number (a YAML ``tp: "2"``, a ``null``) is one line naming the
    source that set it, not a ``TypeError`` from the arithmetic that runs before the spec's own validation."""
    parallel = _at(merged, loc) if _holds(merged, loc) else None
    if not isinstance(parallel, dict):
        return
    for axis in LAYOUT_COUNTS:
        value = parallel.get(axis, 1)
        if not isinstance(value, int) or isinstance(value, bool):
            setting = [i for i, source in enumerate(sources) if _holds(source, (*loc, axis))]
            where = names[setting[-1]] if names and setting else spec_name
            unquote = " (unquoted in YAML)" if isinstance(value, str) and value.strip().isdigit() else ""
            raise UserError(f"{where}: {'.'.join(loc)}.{axis}: Input should be a whole number{unquote}, "
                            f"got {json.dumps(value)}")


def fill_data_parallel(parallel: dict[str, Any], world_size: int) -> None:
    """Set ``parallel["dp"]`` to what ``world_size`` ranks leave after tp·cp·pp; a given dp must agree."""
    base = parallel.get("tp", 1) * parallel.get("cp", 1) * parallel.get("pp", 1)
    if world_size % base:
        raise UserError(f"{world_size} ranks are not a multiple of tp·cp·pp = {base}; "
                        "run tp·cp·pp·dp ranks (--nproc)")
    if "dp" in parallel and parallel["dp"] * base != world_size:
        raise UserError(f"the layout's tp·cp·pp·dp is {parallel['dp'] * base} but {world_size} ranks run it; "
                        "drop dp (it follows the rank count) or run that many ranks")
    parallel["dp"] = world_size // base


def _holds(source: dict[str, Any], loc: tuple[str, ...]) -> bool:
    node: Any = source
    for key in loc:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def _at(source: dict[str, Any], loc: tuple[str, ...]) -> Any:
    for key in loc:
        source = source[key]
    return source
