"""The RL job's plan (``moetrain plan --rl``): how to split the devices between rollout and training, how many
rollout replicas of which generation layout, the trainer's layout and the staleness k, each priced with the
RL step model of ``moetrain simulate --rl`` (``moetrain.planner.rl_step``).

The search walks

    placement ∈ {colocated, disaggregated}
    × rollout devices R (disaggregated: a grid of 1 … D − 1; colocated: all D generate, all D train)
    × devices per generation replica g (divisors of the expert count; R / g replicas)
    × k ∈ {0, 1, …, max_staleness}

and takes the trainer's layout on the D − R training devices (all D colocated) from the training search
(``moetrain.planner.search``, on the step's samples as ``moetrain rl`` trains them: ``rl_step.training_workload``),
once per training device count: the same candidates and cost model as ``moetrain plan``, not a second one.

Memory: a generation replica holds the dense weights whole and its share of the routed experts, plus the KV
cache of its rows at full length; disaggregated, that alone must fit a rollout device; colocated, it sits
beside the training state (weights, grads and optimizer; with k ≥ 1 the update's activations too, as both
run at once; with offload only the weights stay). The trainer's layout fits by the training search's own
check.

In the steady state the step model prices every k ≥ 1 the same (``rl_step``: a larger k only absorbs the
jitter of variable-length generations, which a steady-state price does not see), so the search prices k = 0
and k = 1 and carries k = 1's price to the larger k; among equal steps the smallest k wins (staleness costs
learning, not speed). Torch-free, like the rest of the planner.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from moetrain.config.limits import MAX_STALENESS
from moetrain.config.nodes import RankGroups, placement_problems
from moetrain.config.parallel import ParallelConfig, runtime_limits
from moetrain.costs.params import count_params
from moetrain.errors import UserError
from moetrain.planner.calibration import Calibration
from moetrain.planner.device_memory import GIB
from moetrain.planner.generation import HostCosts, kv_cache_bytes_per_token
from moetrain.planner.rl_cores import RoleCPU
from moetrain.planner.rl_rates import PROBE_COMMAND, ProbedRankCPU, ProbedRoleCPU
from moetrain.planner.rl_step import (
    PHASES_MODEL,
    Placement,
    RLLayout,
    RLStepPrediction,
    RLWorkload,
    SyncRates,
    price_rl_step,
    rank_cpu_mismatch,
    role_cpu_mismatch,
    training_workload,
    weight_bytes,
)
from moetrain.planner.search import MEMORY_LIMIT_FRACTION, SearchOptions, SearchSpace, describe, search
from moetrain.planner.simulate import LayoutPrediction, simulate_layout
from moetrain.planner.strategy import Strategies

SPLIT_POINTS = 16
"""About how many rollout/training splits a large job is searched at (a grid of powers of two apart)."""


@dataclass(frozen=True)
class RLSearchOptions:
    placements: tuple[Placement, ...] = ("colocated", "disaggregated")
    max_staleness: int = 2
    """Largest k searched (k = 0, 1, …, this)."""
    rollout_devices: int | None = None
    """Fix the disaggregated split (None: search it)."""
    gen_devices_per_replica: int | None = None
    """Fix the generation layout (None: search it)."""
    offload: bool = False
    """Colocated: optimizer state and grads to host while generating (``RLLayout.offload``)."""
    host_link_gbps: float | None = None
    runnable_trainer_only: bool = True
    """Rank only trainer layouts that ``moetrain rl``'s trainer runs (``runtime_limits`` empty, no context
    parallelism); off: every layout the cost model prices."""
    split_points: int = SPLIT_POINTS
    sync: SyncRates | None = None
    """The weight sync's measured host rates (``--rl-rates``); None: the link alone."""
    probed_cpu: ProbedRoleCPU | None = None
    """One job's probed CPU-seconds per process (``--rl-rates``' ``role_cpu``): a disaggregated job at k ≥ 1
    whose processes are the probe's is priced by sharing them over the probed cores, as ``simulate --rl``
    prices it (``ProbedRoleCPU.on``); one whose processes are not is left out and named
    (``RLSearchResult.unprobed``). None: every job by its phases."""
    probed_ranks: ProbedRankCPU | None = None
    """One colocated job's probed CPU-seconds per rank (``--rl-rates``' ``rank_cpu``): a colocated job whose
    ranks, gen-ep and kind of k are the probe's is priced by sharing them over the probed cores
    (``ProbedRankCPU.on``); another colocated job is left out and named (``RLSearchResult.unprobed_colocated``),
    as its phases would price each rank as if it had a device of its own. None: colocated jobs by their phases."""


@dataclass(frozen=True)
class RLCandidate:
    """One priced way to run the job."""

    layout: RLLayout
    prediction: RLStepPrediction
    trainer_layouts_searched: int
    """Layouts the training search scored on this candidate's training devices."""
    generation_gib: float
    """Per generating device: the replica's weights share and its rows' KV cache."""
    device_gib: float
    """Per device at its fullest: generation's (disaggregated rollout device) or, colocated, generation's beside
    the training state."""
    not_runnable: tuple[str, ...] = ()
    """Why today's ``moetrain rl`` cannot run it yet (empty: it runs as planned)."""

    @property
    def step_s(self) -> float:
        return self.prediction.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.prediction.tokens_per_s

    @property
    def staleness(self) -> int:
        return self.layout.staleness

    def split(self) -> str:
        return split_text(self.layout)

    def generation(self) -> str:
        return generation_text(self.layout)

    def trainer(self) -> str:
        return describe(Strategies.from_parallel([self.layout.train]), 0)


@dataclass
class RLSearchResult:
    ranked: list[RLCandidate]
    """Every priced candidate, best first."""
    seconds: float
    trainer_searches: int
    trainer_layouts_evaluated: int
    left_out: dict[str, int] = field(default_factory=dict)
    """Candidates not priced, by the reason (generation does not fit, no trainer layout fits, …)."""
    why: list[str] = field(default_factory=list)
    unprobed: list[str] = field(default_factory=list)
    """The disaggregated jobs at k ≥ 1 the probed CPU-seconds per process do not price (their processes are
    not the probe's: ``rl_step.role_cpu_mismatch``), each as its split and generation layout; left out."""
    unprobed_colocated: list[str] = field(default_factory=list)
    """The colocated jobs the probed CPU-seconds per rank do not price (``rl_step.rank_cpu_mismatch``), each as
    its generation layout and k; left out."""

    @property
    def winner(self) -> RLCandidate:
        return self.ranked[0]


UNPROBED = "disaggregated k ≥ 1: the probed CPU-seconds per process (--rl-rates' role_cpu) are another job's"
"""The ``left_out`` reason of a job ``RLSearchOptions.probed_cpu`` cannot price."""
UNPROBED_COLOCATED = "colocated: the probed CPU-seconds per rank (--rl-rates' rank_cpu) are another job's"
"""The ``left_out`` reason of a colocated job ``RLSearchOptions.probed_ranks`` cannot price."""


def split_text(lay: RLLayout) -> str:
    if lay.placement == "colocated":
        return f"colocated: all {lay.devices} train and generate"
    return f"{lay.rollout_devices} generate / {lay.train_devices} train"


def generation_text(lay: RLLayout) -> str:
    return f"{lay.replicas} × gen-ep {lay.gen_devices_per_replica}"


def generation_bytes(w: RLWorkload, devices_per_replica: int, rows: int) -> float:
    """One generating device's bytes: the dense weights whole, its share of the routed experts, and the KV
    cache of its share of the replica's ``rows`` at their full length (prompt + response)."""
    counts = count_params(w.model)
    width = weight_bytes(w) / counts.total
    weights = (counts.total - counts.experts) * width + counts.experts * width / devices_per_replica
    per_token = kv_cache_bytes_per_token(w.model, w.samples_workload.activation_bytes) * w.model.num_layers
    return weights + math.ceil(rows / devices_per_replica) * (w.prompt_len + w.response_len) * per_token


def replica_sizes(w: RLWorkload, max_devices: int) -> list[int]:
    """Devices per generation replica the runtime can build: divisors of the expert count (its experts split
    evenly over them); 1 for a dense model."""
    moe = w.model.moe
    if moe is None:
        return [1]
    return [g for g in range(1, min(moe.num_experts, max_devices) + 1) if moe.num_experts % g == 0]


def rollout_grid(devices: int, points: int = SPLIT_POINTS) -> list[int]:
    """Rollout device counts searched for a disaggregated job of ``devices``: every count up to ``points``
    devices, else multiples of the power of two nearest devices / points (so that the training side keeps
    counts with many divisors)."""
    step = 1 if devices <= points else 2 ** round(math.log2(devices / points))
    return list(range(step, devices, step))


def rl_runtime_limits(w: RLWorkload, layout: RLLayout) -> list[str]:
    """Why today's ``moetrain rl`` cannot run ``layout``: one sentence each; empty when it runs. What the
    runtime runs: RL Fusion and colocated StaleSync in any trainer layout the training runtime runs without
    context parallelism, ``ranks / gen_ep`` replicas; the disaggregated pipeline as rollout replicas of
    ``gen_ep`` ranks (its EP layout: the planner's replicas split experts, never TP) beside a trainer group in
    such a layout; on one node or on several (``moetrain rl --nnodes``: the same ranks on every node, each
    replica and trainer TP group inside a node or on whole nodes, ``moetrain.config.nodes``)."""
    limits = []
    per_node = w.cluster.devices_per_node
    if layout.devices > per_node:
        limits += _node_limits(layout, per_node)
    if layout.placement == "disaggregated" and w.prompts % layout.replicas:
        limits.append(f"{w.prompts} prompts per step do not split over {layout.replicas} rollout replicas (each "
                      "generates whole groups)")
    if layout.placement == "disaggregated" and layout.train_devices > 1 and w.samples % layout.train_devices:
        # A trainer of several ranks keeps RL Fusion's whole model for its evaluation and log-probs, which deals
        # the step's rows out to its ranks in equal shares (``rl.fusion.Fusion.share``).
        limits.append(f"{w.samples} samples per step do not split over the trainer's {layout.train_devices} ranks "
                      "(each scores an equal share)")
    train = layout.train
    if train.cp > 1:
        limits.append(f"trainer cp {train.cp}: RL does not train with context parallelism yet")
    limits += [f"trainer: {reason}" for reason in runtime_limits(train, w.model.num_layers, w.samples, per_node)]
    return limits


def _node_limits(layout: RLLayout, per_node: int) -> list[str]:
    """A job of several nodes: every node runs the same ranks, and its groups place on them."""
    if layout.devices % per_node:
        return [f"{layout.devices} devices do not fill whole nodes of {per_node}: moetrain rl --nnodes runs the same "
                "--nproc ranks on every node"]
    g = layout.gen_devices_per_replica
    if layout.placement == "disaggregated":
        groups = RankGroups(layout.replicas, g, layout.rollout_devices, layout.train_devices, layout.train.tp)
    else:
        groups = RankGroups(layout.devices // g, g, 0, layout.devices, layout.train.tp, "generation replica")
    return [f"on nodes of {per_node}: {problem}" for problem in placement_problems(groups, per_node)]


@dataclass
class _Trainer:
    """The training search's best layout on one device count, and its step as ``rl_step`` prices it."""

    parallel: ParallelConfig | None
    prediction: LayoutPrediction | None
    evaluated: int


@dataclass
class _Trainers:
    """The training search's best layout per training device count, each searched once."""

    w: RLWorkload
    calibration: Calibration
    runnable_only: bool
    found: dict[int, _Trainer] = field(default_factory=dict)

    def __call__(self, count: int) -> _Trainer:
        if count not in self.found:
            workload, eff = training_workload(self.w), self.calibration.for_device(self.w.cluster.device)
            space = SearchSpace(cp=(1,)) if self.runnable_only else SearchSpace()
            options = SearchOptions(space, top_k=1, timeline_top=1, time_every_choice=False,
                                    runnable_only=self.runnable_only)
            found = search(workload, count, eff, options)
            parallel = found.ranked[0].parallel if found.ranked else None
            prediction = simulate_layout(workload, parallel, count, self.calibration) if parallel else None
            self.found[count] = _Trainer(parallel, prediction, found.candidates_evaluated)
        return self.found[count]


def _probed(layout: RLLayout, options: RLSearchOptions) -> tuple[RLLayout, bool]:
    """(``layout`` as ``options``' probes price it, whether the probe of its placement is another job's)."""
    if options.probed_ranks is not None:
        layout = options.probed_ranks.on(layout)
        if layout.rank_cpu is not None and rank_cpu_mismatch(layout.rank_cpu, layout) is not None:
            return layout, True
    if options.probed_cpu is None:
        return layout, False
    layout = options.probed_cpu.on(layout)
    return layout, layout.role_cpu is not None and role_cpu_mismatch(layout.role_cpu, layout) is not None


def search_rl(w: RLWorkload, devices: int, calibration: Calibration, host: HostCosts | None = None,
              options: RLSearchOptions | None = None) -> RLSearchResult:
    """Every split, generation layout, trainer layout and k of ``w`` on ``devices``, priced and ranked
    (fastest step first; equal steps: smaller k, colocated, fewer rollout devices). Raises ``UserError``
    when the options leave nothing to search or nothing fits."""
    options = options or RLSearchOptions()
    start = time.perf_counter()
    check_options(devices, options)
    walk = _Walk(w, devices, calibration, host or HostCosts(), options)
    for placement, rollout in _splits(devices, options):
        walk.split(placement, rollout)
    seconds = time.perf_counter() - start
    trainers = walk.trainer.found
    result = RLSearchResult(sorted(walk.ranked, key=_rank_key), seconds, len(trainers),
                            sum(t.evaluated for t in trainers.values()), walk.left_out, unprobed=walk.unprobed,
                            unprobed_colocated=walk.unprobed_colocated)
    if not walk.ranked:
        raise UserError(_nothing_fits(w, devices, walk.left_out))
    result.why = explain(result)
    cores = w.cluster.host_cores
    if cores is not None and devices > cores and result.winner.prediction.step_model == PHASES_MODEL:
        result.why.append(_unshared_phases_line(devices, cores))
    return result


@dataclass
class _Walk:
    """One ``search_rl``: its inputs, the training searches it has run, the candidates it has priced and those
    it has left out (by the reason, and the jobs the probes cannot price, by name)."""

    w: RLWorkload
    devices: int
    calibration: Calibration
    host: HostCosts
    options: RLSearchOptions
    ranked: list[RLCandidate] = field(default_factory=list)
    left_out: dict[str, int] = field(default_factory=dict)
    unprobed: list[str] = field(default_factory=list)
    unprobed_colocated: list[str] = field(default_factory=list)
    trainer: _Trainers = field(init=False)
    limit: float = field(init=False)
    """Bytes a device may hold (``MEMORY_LIMIT_FRACTION`` of its HBM)."""

    def __post_init__(self) -> None:
        self.trainer = _Trainers(self.w, self.calibration, self.options.runnable_trainer_only)
        self.limit = MEMORY_LIMIT_FRACTION * self.w.cluster.hbm_bytes

    def leave(self, reason: str) -> None:
        self.left_out[reason] = self.left_out.get(reason, 0) + 1

    def split(self, placement: Placement, rollout: int) -> None:
        """One split: every generation layout whose replicas split the samples and fit their devices, with the
        training search's best layout on the training devices, at k = 0 and k = 1."""
        w, options = self.w, self.options
        generating = self.devices if placement == "colocated" else rollout
        sizes = ([options.gen_devices_per_replica] if options.gen_devices_per_replica
                 else replica_sizes(w, generating))
        for g in sizes:
            if generating % g:
                continue
            replicas = generating // g
            if w.samples % replicas:
                self.leave("the step's samples do not split over the replicas")
                continue
            gen_bytes = generation_bytes(w, g, w.samples // replicas)
            if gen_bytes > self.limit:
                self.leave("a generation replica does not fit its devices")
                continue
            chosen = self.trainer(self.devices - rollout if placement == "disaggregated" else self.devices)
            if chosen.parallel is None or chosen.prediction is None:
                self.leave("no trainer layout fits the training devices")
                continue
            for k in range(min(options.max_staleness, 1) + 1):
                self.price(RLLayout(placement, self.devices, chosen.parallel, g, rollout, k,
                                    options.offload and placement == "colocated", options.host_link_gbps),
                           chosen, gen_bytes)

    def price(self, layout: RLLayout, chosen: _Trainer, gen_bytes: float) -> None:
        """``layout`` (k = 0 or 1) priced and ranked, k = 1's price carried to every larger k; or left out:
        colocated k ≥ 1 on replicas of several devices or with offload (not run), memory, or a probe that is
        another job's."""
        placement, k, options = layout.placement, layout.staleness, self.options
        if placement == "colocated" and k and (layout.gen_devices_per_replica > 1 or options.offload):
            return  # rl_step: colocated k ≥ 1 generates on a whole model per device beside the update
        assert chosen.prediction is not None
        device_bytes = gen_bytes
        if placement == "colocated":
            memory = chosen.prediction.memory_gib
            kept = ("weights",) if options.offload else ("weights", "grads", "optimizer")
            resident = memory["total"] if k else sum(memory[part] for part in kept)
            device_bytes += resident * GIB
        if device_bytes > self.limit:
            self.leave("colocated: generation does not fit beside the training state")
            return
        layout, unpriced = _probed(layout, options)
        if unpriced and placement == "colocated":
            self.leave(UNPROBED_COLOCATED)
            self.unprobed_colocated.append(f"{generation_text(layout)}, k {'≥ 1' if k else '= 0'}")
            return
        if unpriced:  # every k ≥ 1 alike: named once, at k = 1
            self.leave(UNPROBED)
            self.unprobed.append(f"{split_text(layout)} ({generation_text(layout)})")
            return
        prediction = price_rl_step(self.w, layout, self.calibration, self.host, options.sync,
                                   training=chosen.prediction)
        candidate = RLCandidate(layout, prediction, chosen.evaluated, gen_bytes / GIB, device_bytes / GIB,
                                tuple(rl_runtime_limits(self.w, layout)))
        self.ranked.append(candidate)
        if k == 1:  # every k ≥ 1 prices the same in the steady state (module docstring)
            self.ranked += [replace(candidate, layout=replace(layout, staleness=more),
                                    prediction=replace(prediction, staleness=more))
                            for more in range(2, options.max_staleness + 1)]


def _unshared_phases_line(devices: int, cores: int) -> str:
    """The caution under a winner priced by its phases where its ranks share fewer cores: the phases do not
    see the sharing, and measured steps there run longer than they say by more for some jobs than for
    others (``benchmarks/rl_plan_check.py``), so the order of the jobs is not to be trusted."""
    return (f"caution: priced by its phases, which do not see {devices} ranks share {cores} cores; measured steps "
            f"there run longer, by more for some jobs than others (docs/rl_plan.md), so this ranking may not hold: "
            f"probe a job of each placement (`{PROBE_COMMAND}`, the flag once for each) and plan again with "
            f"--rl-rates FILE")


def _rank_key(c: RLCandidate) -> tuple:
    lay = c.layout
    return (c.step_s, lay.staleness, lay.placement != "colocated", lay.rollout_devices, lay.gen_devices_per_replica)


def check_options(devices: int, options: RLSearchOptions) -> None:
    """Refuse options that leave nothing to search, before any search (one line each)."""
    if devices < 1:
        raise UserError(f"--devices {devices} must be positive")
    if options.max_staleness < 0:
        raise UserError(f"--max-staleness {options.max_staleness} cannot be negative")
    if options.max_staleness > MAX_STALENESS:  # every k up to it is listed: a typo's zeros would never end
        raise UserError(f"--max-staleness {options.max_staleness} is more than {MAX_STALENESS} weight versions (every "
                        f"k ≥ 1 prices the same, so the smallest wins); give 0 to {MAX_STALENESS}")
    if not options.placements:
        raise UserError("no placement to search")
    if options.rollout_devices is not None:
        if "disaggregated" not in options.placements:
            raise UserError("--rollout-devices fixes the disaggregated split: drop it or search --placement "
                            "disaggregated")
        if not 0 < options.rollout_devices < devices:
            raise UserError(f"--rollout-devices {options.rollout_devices} of --devices {devices} leaves "
                            f"{'no trainer' if options.rollout_devices >= devices else 'nothing to generate'}: "
                            f"give 1 to {devices - 1}")
    if options.placements == ("disaggregated",) and devices < 2:
        raise UserError(f"disaggregated needs a rollout device and a training device: --devices {devices} is too "
                        "few (give 2 or more, or --placement colocated)")
    if options.gen_devices_per_replica is not None:
        _check_gen_ep(options.gen_devices_per_replica, devices)


def _check_gen_ep(gen_ep: int, devices: int) -> None:
    if gen_ep < 1:
        raise UserError(f"--gen-ep {gen_ep} must be positive")
    if gen_ep > devices:
        raise UserError(f"--gen-ep {gen_ep} of --devices {devices}: a generation replica cannot span more devices "
                        f"than the job has; give 1 to {devices}")


def _splits(devices: int, options: RLSearchOptions) -> list[tuple[Placement, int]]:
    splits: list[tuple[Placement, int]] = []
    if "colocated" in options.placements and options.rollout_devices is None:
        splits.append(("colocated", 0))
    if "disaggregated" in options.placements and devices >= 2:
        grid = ([options.rollout_devices] if options.rollout_devices is not None
                else rollout_grid(devices, options.split_points))
        splits += [("disaggregated", r) for r in grid]
    return splits


def _nothing_fits(w: RLWorkload, devices: int, left_out: dict[str, int]) -> str:
    reasons = "; ".join(f"{reason} ({n})" for reason, n in sorted(left_out.items(), key=lambda kv: -kv[1]))
    smallest = min((g for g in replica_sizes(w, 10**9) if generation_bytes(w, g, 1) <= MEMORY_LIMIT_FRACTION
                    * w.cluster.hbm_bytes), default=None)
    need = (f"; one generation replica alone needs {smallest} devices of {w.cluster.hbm_bytes / GIB:.0f} GiB"
            if smallest and smallest > 1 else "")
    return (f"no way to run {w.model.name}'s RL step fits {devices} × {w.cluster.name}: "
            f"{reasons or 'nothing to price'}{need}; add devices (or shorten the step: fewer prompts, shorter "
            "responses)")


def explain(result: RLSearchResult) -> list[str]:
    """Why the winner wins: against the best candidate with another placement, split, generation layout and
    k, each as the ratio of its step to the winner's and the phases that decide it."""
    ranked, best = result.ranked, result.winner
    lay, p = best.layout, best.prediction
    lines = []

    def best_where(test) -> RLCandidate | None:
        return next((c for c in ranked if test(c)), None)

    other = best_where(lambda c: c.layout.placement != lay.placement)
    if other is not None:
        lines.append(f"placement {lay.placement}: the best {other.layout.placement} ({other.split()}, "
                     f"{other.generation()}, k = {other.staleness}) takes {other.step_s / best.step_s:.2f}x the step")
    elif lay.placement == "disaggregated" and any(r.startswith("colocated") for r in result.left_out):
        lines.append("placement disaggregated: no colocated job fits (generation does not fit beside the training "
                     "state; --offload with --host-link-gbps prices moving that state to host)")
    ph = p.phases
    rollout_side = ph.generate_s + ph.reward_s
    train_side = ph.logprob_s + ph.train_s
    if lay.placement == "disaggregated":
        fewer = best_where(lambda c: c.layout.placement == "disaggregated"
                           and c.layout.rollout_devices < lay.rollout_devices)
        more = best_where(lambda c: c.layout.placement == "disaggregated"
                          and c.layout.rollout_devices > lay.rollout_devices)
        around = ", ".join(f"{c.layout.rollout_devices} generating: {c.step_s / best.step_s:.2f}x"
                           for c in (fewer, more) if c is not None)
        lines.append(f"split {best.split()}: rollout side {rollout_side:.4g} s (generate + reward), trainer "
                     f"{train_side:.4g} s (log-prob forwards + train), push {ph.push_s:.3g} s"
                     + (f"; best with {around}" if around else ""))
        if lay.role_cpu is not None:
            lines.append(_shared_cpu_line(lay.role_cpu, lay.shared_cores, p.step_s))
    else:
        lines.append(f"colocated: generate {ph.generate_s:.4g} s, train {ph.train_s:.4g} s, reshard "
                     f"{ph.reshard_s:.3g} s on all {lay.devices} devices")
        if lay.rank_cpu is not None:
            ranks = ", ".join(f"{x:.4g}" for x in lay.rank_cpu.rank_s)
            lines.append(f"step {p.step_s:.4g} s: processor sharing of the probed CPU-seconds per rank over "
                         f"{lay.shared_cores:g} cores ({ranks}), not the phases")
    gen = best_where(lambda c: c.layout.placement == lay.placement
                     and c.layout.gen_devices_per_replica != lay.gen_devices_per_replica)
    if gen is not None:
        lines.append(f"generation {best.generation()}: the best with gen-ep {gen.layout.gen_devices_per_replica} "
                     f"takes {gen.step_s / best.step_s:.2f}x the step")
    other_k = best_where(lambda c: (c.staleness == 0) != (lay.staleness == 0))
    larger = [c.staleness for c in ranked if c.step_s == best.step_s and c.staleness > lay.staleness]
    k_line = f"k = {lay.staleness}"
    if other_k is not None:
        k_line += f": the best with k = {other_k.staleness} takes {other_k.step_s / best.step_s:.2f}x the step"
    if larger:
        span = f"{min(larger)}…{max(larger)}" if max(larger) > min(larger) else f"{min(larger)}"
        k_line += (f"; k = {span} prices the same in the steady state (a larger k only absorbs jitter), so the "
                   "smallest is kept")
    lines.append(k_line)
    lines.append(f"trainer {best.trainer()}: the training search's best of {best.trainer_layouts_searched:,} "
                 f"layouts on {lay.train_devices} devices ({ph.train_s:.4g} s per step"
                 f"{'' if p.train_fits_memory else ', DOES NOT FIT'})")
    return lines


def _shared_cpu_line(work: RoleCPU, cores: float | None, step_s: float) -> str:
    """How the probed CPU-seconds per process priced a step (``rl_cores.shared_cpu_step``)."""
    rollout = ", ".join(f"{x:.4g}" for x in work.rollout_s)
    trainer = ", ".join(f"{x:.4g}" for x in work.trainer_s)
    return (f"step {step_s:.4g} s: processor sharing of the probed CPU-seconds per process over {cores:g} cores "
            f"(rollout {rollout} × {work.overlap[0]:g}; trainer {trainer} × {work.overlap[1]:g}), not the phases")
