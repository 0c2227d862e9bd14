"""RL Fusion: training in its layout, generation in its own, on the same ranks, with an ordered switch.

Every rank keeps, beside its share of the training layout (TP, PP, EP, ... ``LayoutRun``), a generation
model in the generation layout: with ``gen_ep = 1`` a whole model per rank, each rank generating its
share of the step's prompts (data-parallel replicas, no pipeline); with ``gen_ep = E`` groups of E
consecutive ranks each hold 1/E of every MoE layer's experts and the rest whole, and generate one share
together (the ranks of a group run the same rows in lockstep; the experts' all-to-all serves them). One RL step's switch
(``moetrain.rl.switch``): offload optimizer state and gradients when generation would not fit, reshard
the trained weights into the generation model (``moetrain.distributed.weight_sync``: buckets with a
version and a checksum, every box verified), generate this rank's rows, free the KV cache, restore. The
rows of every rank are then gathered (token ids, rollout log-probs, replay record), so every rank builds
the same global batch the one-process trainer builds, and the training layout slices it as usual.

Sampling draws from one generator per sample, seeded by (seed, step, sample index): which rank
generates a sample, and beside which others, does not change its draws.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config import ModelConfig, ParallelConfig
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.parallelize import StageModel, parallelize
from moetrain.distributed.placements import local_pieces
from moetrain.distributed.step import LayoutRun
from moetrain.distributed.weight_sync import SyncReport, TensorView, WeightSync, WeightSyncError, tensor_views
from moetrain.errors import UserError
from moetrain.models.transformer import MoETransformer, build_model
from moetrain.rl.config import FusionOptions
from moetrain.rl.generate import Generation, RolloutEngine, SamplingParams, concat_generations
from moetrain.rl.offload import HostOffload, offload_decision
from moetrain.rl.switch import Switch


def sample_generators(seed: int, step: int, count: int, device: torch.device,
                      first: int = 0) -> list[torch.Generator]:
    """One generator per sample ``first .. first+count-1`` of ``step``: a function of (seed, step, index)."""
    base = (seed * 1_000_003 + step) * 1_000_033
    return [torch.Generator(device).manual_seed((base + first + i) % 2**63) for i in range(count)]


def global_shapes(model_cfg: ModelConfig) -> dict[str, torch.Size]:
    return {name: value.shape for name, value in build_model(model_cfg, "meta").state_dict().items()}


def training_views(run: LayoutRun, shapes: dict[str, torch.Size]) -> dict[str, TensorView]:
    """This rank's trained tensors as global regions (the live parameters under ZeRO-1; gathered copies
    under FSDP, whose parameters are sharded over data parallelism)."""
    tensors = {name: value.detach() for name, value in run.stage.model.state_dict(keep_vars=True).items()}
    if run.dims.parallel.zero > 1:
        tensors.update(run.optimizer.params_by_name())
    return tensor_views(tensors, local_pieces(run.stage, shapes))


def generation_model(model_cfg: ModelConfig, options: FusionOptions, rank: int, world_size: int,
                     device: torch.device) -> tuple[MoETransformer, StageModel | None]:
    """The generation model of this rank (whole, or its EP share with ``gen_ep`` > 1; the stage then).
    Built from seed 0: every value is overwritten by the first sync (which checks that it is)."""
    if options.gen_ep == 1:
        return build_model(model_cfg, device, seed=0).eval().requires_grad_(False), None
    return ep_generation_model(model_cfg, ParallelDims.build(ParallelConfig(dp=world_size, ep=options.gen_ep), rank),
                               device)


def ep_generation_model(model_cfg: ModelConfig, dims: ParallelDims,
                        device: torch.device) -> tuple[MoETransformer, StageModel]:
    """This rank's generation model in the EP layout ``dims`` (its experts, the dense tensors whole), and its
    stage. Built from seed 0: every value is overwritten by the first sync (which checks that it is)."""
    stage = parallelize(build_model(model_cfg, device, seed=0).eval(), dims)
    return stage.model.requires_grad_(False), stage


def generation_views(model: nn.Module, stage: StageModel | None, shapes: dict[str, torch.Size]):
    pieces_of = local_pieces(stage, shapes) if stage is not None else None
    return tensor_views(dict(model.state_dict(keep_vars=True)), pieces_of)


def whole_model(run: LayoutRun, model_cfg: ModelConfig, bucket_bytes: int = 32 * 2**20) -> MoETransformer:
    """The layout's trained weights as a whole model on every rank (the SFT warm-up's, for the RL run):
    one weight sync into data-parallel replicas."""
    shapes = global_shapes(model_cfg)
    model = build_model(model_cfg, run.device, seed=0)
    group = run.dims.get_group("world")
    sync = WeightSync.plan(training_views(run, shapes), generation_views(model, None, shapes), bucket_bytes, group)
    sync.run(version=0)
    return model


@dataclass(frozen=True)
class StepSwitch:
    """One step's switch: the sync's report and the switch's row fields (slowest rank's times)."""

    sync: SyncReport
    metrics: dict[str, Any]


class Fusion:
    """The generation side of an RL run across ranks: generation model, weight sync, switch, offload."""

    def __init__(self, run: LayoutRun, model_cfg: ModelConfig, options: FusionOptions, pad_id: int,
                 decode, bucket_bytes: int | None = None) -> None:
        dims = run.dims
        self.run, self.options, self.group = run, options, dims.get_group("world")
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.replicas = options.replicas(self.world_size)
        moe = model_cfg.moe
        if options.gen_ep > 1 and (moe is None or moe.num_experts % options.gen_ep):
            raise UserError(f"generation layout ep{options.gen_ep} needs MoE layers whose experts divide by it "
                            f"({model_cfg.name}: {moe.num_experts if moe else 0} experts)")
        shapes = global_shapes(model_cfg)
        self.model, stage = generation_model(model_cfg, options, self.rank, self.world_size, run.device)
        self.sync = WeightSync.plan(training_views(run, shapes), generation_views(self.model, stage, shapes),
                                    bucket_bytes or int(options.bucket_mib * 2**20), self.group)
        self.synced_version: int | None = None
        self.engine = RolloutEngine(self.model, pad_id, decode, run.autocast_dtype)
        self.engine.retain_cache = True
        optimizer = run.optimizer.optimizer
        params = list(run.stage.model.parameters()) + [p for g in optimizer.param_groups for p in g["params"]]
        self.offload = HostOffload(optimizer, list({id(p): p for p in params}.values()))
        self.switch = Switch(run.device)

    @property
    def replica(self) -> int:
        return self.rank // self.options.gen_ep

    def share(self, rows: int) -> range:
        """This rank's rows of a batch (its replica's contiguous share)."""
        if rows % self.replicas:
            raise UserError(f"{rows} samples do not split over {self.replicas} generation replicas; make prompts "
                            "per step × group size a multiple of them")
        per = rows // self.replicas
        return range(self.replica * per, (self.replica + 1) * per)

    def synchronize(self, version: int) -> SyncReport:
        report = self.sync.run(version)
        self.synced_version = version
        return report

    def ensure_synced(self, version: int) -> None:
        if self.synced_version != version:
            self.synchronize(version)

    def generate(self, prompts: list[list[int]], params: SamplingParams, generators: list[torch.Generator] | None,
                 version: int) -> Generation:
        """Every row of ``prompts`` (this rank generates its share; the rows are gathered)."""
        return self.gather(self.generate_share(prompts, params, generators, version))

    def generate_share(self, prompts: list[list[int]], params: SamplingParams,
                       generators: list[torch.Generator] | None, version: int) -> Generation:
        """This rank's rows of ``prompts``, generated with the weights of ``version``. With ``gen_ep`` = 1 no
        collective runs here (the colocated StaleSync trainer runs it beside the training step)."""
        if self.synced_version != version:
            raise WeightSyncError(f"generation weights are at version {self.synced_version}, training at {version}: "
                                  "a sync was missed")
        rows = self.share(len(prompts))
        return self.engine.generate([prompts[i] for i in rows], params,
                                    None if generators is None else [generators[i] for i in rows],
                                    weight_version=version)

    def gather(self, local: Generation) -> Generation:
        """Every replica's rows, in order, on every rank."""
        # the ranks of one EP group generate the same rows (in lockstep: the experts' all-to-all): one copy each
        return gather_generations(local, self.group, every=self.options.gen_ep)

    def step(self, version: int, prompts: list[list[int]], params: SamplingParams,
             generators: list[torch.Generator]) -> tuple[Generation, StepSwitch]:
        """The switch of one RL step, phase by phase."""
        switch, device = self.switch, self.run.device
        decision = offload_decision(self.options.offload, device, self.need_bytes())
        with switch.phase("offload", skipped=not decision.offload):
            if decision.offload:
                self.offload.offload()
        with switch.phase("reshard"):
            report = self.synchronize(version)
        with switch.phase("generate"):
            generation = self.generate(prompts, params, generators, version)
        with switch.phase("free"):
            self.engine.free_cache()
        with switch.phase("restore", skipped=not decision.offload):
            if decision.offload:
                self.offload.restore(device)
        return generation, StepSwitch(report, self.row_fields(report))

    def need_bytes(self) -> int:
        """Generation's extra memory: the latest KV cache (the weights are resident)."""
        return self.engine.cache_bytes

    def row_fields(self, report: SyncReport) -> dict[str, Any]:
        """The switch in a metrics row: the slowest rank's phase times and peaks, the world's bytes."""
        fields = self.switch.metrics()
        keys = sorted(k for k, v in fields.items() if isinstance(v, float))
        device = self.engine.device  # the group's device: NCCL takes device tensors only
        slowest = torch.tensor([fields[k] for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
        fields.update(zip(keys, slowest.tolist()))
        sent = torch.tensor([report.bytes_sent, report.checksums_verified], dtype=torch.float64, device=device)
        dist.all_reduce(sent, group=self.group)
        fields.update(sync_mib=float(sent[0]) / 2**20, sync_buckets=report.buckets,
                      sync_checksums_verified=int(sent[1]), sync_version=report.version)
        return fields


def gather_generations(local: Generation, group: dist.ProcessGroup, every: int = 1) -> Generation:
    """The rows of every ``every``-th rank, in rank order (replicas' shares are contiguous): one object
    all-gather."""
    everyone: list = [None] * dist.get_world_size(group)
    mine = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in local.__dict__.items()}
    dist.all_gather_object(everyone, mine, group=group)
    parts = [Generation(**part) for part in everyone[::every]]
    return replace(concat_generations(parts), weight_version=local.weight_version)
