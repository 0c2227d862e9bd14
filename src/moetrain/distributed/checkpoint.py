"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP) that load under any layout.

Every tensor is saved under its single-process name with its global shape, each rank writing the
pieces it holds at their global offsets: a tensor-parallel shard is a slice along its split
dimension, an expert-parallel rank writes one ``[1, …]`` piece per expert it holds (so a permuted
expert placement reshards too), a replicated tensor is written once (DCP drops the duplicates). The
ZeRO-1 AdamW moments, kept as flat slices of buckets, are first gathered back to each rank's
parameters (``ZeroAdamW.moments_by_name``) and saved the same way. Loading asks each rank for the
pieces its own layout holds; DCP reads them from whatever pieces were written. So a checkpoint saved
under TP2×EP2 loads under PP2×EP2, and a single-process checkpoint loads under a parallel layout.

The folder and its keys are those of the single-process trainer (``moetrain.runtime_base.checkpoint_files``):
``step-000123/`` written as ``step-000123.tmp/`` and renamed after the ``COMPLETE`` marker (the run's
identity and a SHA-256 of every file, ``seal_checkpoint``) is on disk; loads verify it first;
keys ``model.<name>``, ``optim.state.<name>.{step,exp_avg,exp_avg_sq}``, ``optim.param_groups``,
``rng.torch`` and ``trainer`` (JSON: step and learning-rate scheduler state), so the single-process
trainer can also read a checkpoint written here.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from moetrain.config import ModelConfig, TrainingConfig
from moetrain.distributed.placements import local_pieces
from moetrain.distributed.step import LayoutRun
from moetrain.errors import UserError
from moetrain.models.transformer import build_model
from moetrain.runtime_base.checkpoint_files import (
    COMPLETE_MARKER,
    check_resumable,
    checkpoint_dir,
    is_model_only,
    library_cause,
    marker_fields,
    quiet_checkpoint_load,
    read_marker,
    seal_checkpoint,
    verify_checkpoint,
)
from moetrain.runtime_base.optim import build_lr_scheduler, build_optimizer

MOMENTS = ("exp_avg", "exp_avg_sq")
EXPERT_PLACEMENT_FILE = "expert_placement.json"
"""Written beside the tensors by a run with online expert balancing: the placement of every MoE layer
(``OnlineExpertBalancer.state_dict``). Only a resume with balancing reads it; tensors are by expert."""


@dataclass
class GlobalPieces:
    """This rank's pieces of one tensor of global shape ``global_shape``: (offsets, local tensor).

    Implements the hooks DCP's planners call on a checkpointable tensor (as ``DTensor`` does), so
    each piece is written and read as a chunk of the global tensor."""

    global_shape: torch.Size
    pieces: list[tuple[torch.Size, torch.Tensor]]

    def size(self) -> torch.Size:
        return self.global_shape

    def __create_write_items__(self, fqn: str, _obj: object) -> list[WriteItem]:
        return [
            WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, piece.shape),
                                                  properties=TensorProperties.create_from_tensor(piece),
                                                  size=self.global_shape))
            for offsets, piece in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets, piece.shape) for offsets, piece in self.pieces]

    def piece_at(self, offsets: torch.Size) -> torch.Tensor:
        for at, piece in self.pieces:
            if at == offsets:
                return piece
        raise KeyError(f"no piece at offsets {tuple(offsets)}")


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, GlobalPieces):
            return obj.piece_at(index.offset)
        return super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """Takes a flat state dict. The default set-up rewrites every value it does not know as a tensor
    type to None; the pieces are put back after it."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:  # type: ignore[override]
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, GlobalPieces)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(pieces)
        self.state_dict.update(pieces)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, GlobalPieces):
            return obj.piece_at(index.offset)
        return super().lookup_tensor(index)


def _full_model(model_cfg: ModelConfig) -> nn.Module:
    """The single-process model on the meta device: global shapes and the trainer's optimizer groups."""
    return build_model(model_cfg, "meta")


def _placements(run: LayoutRun, global_shapes: dict[str, torch.Size]):
    """For each local tensor name: how to turn its local value into global pieces (``local_pieces``; DCP
    keeps one of identical pieces, so replicated experts and tensors are written once)."""
    pieces_of = local_pieces(run.stage, global_shapes)

    def to_global(name: str, local: torch.Tensor) -> GlobalPieces | torch.Tensor:
        pieces = pieces_of(name, local)
        return local if pieces is None else GlobalPieces(global_shapes[name], pieces)

    return to_global


def _model_tensors(run: LayoutRun) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of this rank in its local (tensor/expert-parallel) shape, unsharded over
    data parallelism: the parameters themselves under ZeRO-1, gathered copies under FSDP (ZeRO-2/3)."""
    tensors = {name: value.detach() for name, value in run.stage.model.state_dict(keep_vars=True).items()}
    tensors.update(run.optimizer.params_by_name())
    return tensors


def _trainer_extras(model_cfg: ModelConfig, cfg: TrainingConfig, step: int) -> tuple[list[dict], dict]:
    """The single-process trainer's optimizer groups (parameter names, learning rate after ``step``
    steps) and its scheduler state, built on a meta-device model so the keys match exactly."""
    full = _full_model(model_cfg)
    optimizer = build_optimizer(full, cfg)
    scheduler = build_lr_scheduler(optimizer, cfg)
    with warnings.catch_warnings():  # no optimizer step ran on this stand-in: the scheduler would warn
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(step):
            scheduler.step()
    names = {id(p): n for n, p in full.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = [names[id(p)] for p in group["params"]]
        groups.append(entry)
    scheduler_state = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    return groups, scheduler_state


def _state(run: LayoutRun, model_cfg: ModelConfig, model_tensors: dict[str, torch.Tensor],
           moments: dict[str, dict[str, torch.Tensor]], step_count: torch.Tensor) -> dict:
    global_shapes = {n: p.shape for n, p in _full_model(model_cfg).state_dict(keep_vars=True).items()}
    to_global = _placements(run, global_shapes)
    model_state = {name: to_global(name, value) for name, value in model_tensors.items()}
    optim_state = {
        name: {"step": step_count.clone(), **{k: to_global(name, by_kind[k]) for k in MOMENTS}}
        for name, by_kind in moments.items()
    }
    return {"model": model_state, "optim": {"state": optim_state}}


def _flatten(state: dict, prefix: str = "") -> dict:
    """Nested dicts to DCP's flat keys (``optim.state.<name>.exp_avg``)."""
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def checkpoint_state(run: LayoutRun, step: int) -> dict:
    """What a checkpoint after ``step`` completed steps holds, as DCP's state dict: this rank's pieces of
    the weights and moments, the optimizer groups, the RNG state and the trainer's step and schedule (of the
    run's model and training configs)."""
    model_cfg, cfg = run.model_cfg, run.cfg
    moments, step_count = run.optimizer.moments_by_name()
    state = _state(run, model_cfg, _model_tensors(run), moments, step_count)
    groups, scheduler_state = _trainer_extras(model_cfg, cfg, step)
    state["optim"]["param_groups"] = groups
    state["rng"] = {"torch": torch.get_rng_state()}
    state["trainer"] = json.dumps({"step": step, "lr_scheduler": scheduler_state}, sort_keys=True)
    return state


class CheckpointWriter(FileSystemWriter):
    """DCP's file writer, which can be told to fail as a full disk does (``MOETRAIN_FAULT``'s
    ``save_error``): ``OSError`` ENOSPC naming the folder, raised where a real write would raise it."""

    def __init__(self, path: Path, fail: bool = False) -> None:
        super().__init__(path)
        self.fail = fail

    def write_data(self, plan, planner):  # type: ignore[override]
        if self.fail:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected)", str(self.path))
        return super().write_data(plan, planner)


def write_state(state: dict, staging: Path, group: dist.ProcessGroup, fail: bool = False) -> None:
    """Every rank writes its pieces of ``state`` into ``staging`` (synchronously)."""
    dcp.save(state, storage_writer=CheckpointWriter(staging, fail), planner=_SavePlanner(), process_group=group)


class HostStager:
    """What copies a state to host memory for ``start_write``: DCP's default stager, copying before it
    returns, into pinned memory on a GPU machine. One per run: the stager keeps its host buffers and copies
    into them again when a save hands it the same tensors (the caller waits for the previous write first).
    On a torch whose stager can stage only once (``stager_reusable``) each save takes a new one."""

    def __init__(self) -> None:
        self._stager: DefaultStager | None = None

    def for_next_save(self) -> DefaultStager:
        """The stager for the next save; the previous save's write must have ended."""
        if self._stager is not None and not stager_reusable():
            self._stager.close()
            self._stager = None
        if self._stager is None:
            self._stager = _new_stager(pinned=torch.cuda.is_available())
        return self._stager

    def close(self) -> None:
        """Free the host buffers (call once no write is running)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _new_stager(pinned: bool) -> DefaultStager:
    return DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


@functools.cache
def stager_reusable() -> bool:
    """Whether one ``DefaultStager`` stages a second state. torch 2.11's clears its copier's table after
    every stage, so the next save failed in staging (``KeyError: <class 'type'>``) and every async
    checkpoint after the first was lost; torch 2.13's keeps it. Found out once, on two tiny states."""
    stager = _new_stager(pinned=False)
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)})
        return True
    except KeyError:
        return False
    finally:
        stager.close()


def start_write(state: dict, staging: Path, group: dist.ProcessGroup, stager: DefaultStager,
                fail: bool = False) -> Future:
    """``write_state`` in DCP's background thread: ``state`` is first copied to host memory by ``stager``
    (``HostStager.for_next_save``: here, before this returns, as the step may then change the weights), then
    written; the future holds the outcome. ``group`` must be a CPU (gloo) group of its own: its collectives
    run beside the training's."""
    return dcp.async_save(state, storage_writer=CheckpointWriter(staging, fail), planner=_SavePlanner(),
                          process_group=group, async_stager=stager)


def finish_folder(staging: Path, final: Path, step: int, identity: dict | str,
                  expert_placement: dict | None = None) -> Path:
    """The coordinator, once every rank has written: the placement file, then the sealing (checksums,
    ``COMPLETE`` last, the rename)."""
    if expert_placement is not None:
        (staging / EXPERT_PLACEMENT_FILE).write_text(json.dumps(expert_placement))
    return seal_checkpoint(staging, final, marker_fields(step, identity))


def save_checkpoint(save_dir: Path, step: int, run: LayoutRun, identity: dict | str = "",
                    expert_placement: dict | None = None) -> Path:
    """Every rank of the layout calls this after ``step`` completed steps (of the run's model and training
    configs); returns the folder. ``expert_placement``: the balancer's state (the same on every rank), saved
    for a resume. A failure raises its cause and leaves no folder behind (the trainer's ``CheckpointSaver``
    decides what then)."""
    world = run.stage.dims.get_group("world")
    final = checkpoint_dir(save_dir, step)
    staging = final.with_name(final.name + ".tmp")
    coordinator = dist.get_rank(world) == 0
    if coordinator:
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    state = checkpoint_state(run, step)
    dist.barrier(group=world)
    try:
        write_state(state, staging, world)
    except (Exception, KeyboardInterrupt, CheckpointException) as exc:
        # A save that did not finish leaves nothing that looks like a checkpoint; an interrupt (which the
        # library wraps in its own exception) stays an interrupt, so the run ends as "interrupted".
        if coordinator:
            shutil.rmtree(staging, ignore_errors=True)
        cause = library_cause(exc)
        if isinstance(cause, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        raise cause from None
    dist.barrier(group=world)
    if coordinator:
        finish_folder(staging, final, step, identity, expert_placement)  # marker last, then the rename
    dist.barrier(group=world)
    return final


def load_checkpoint(path: Path, run: LayoutRun, model_cfg: ModelConfig, identity: dict | str | None = None) -> int:
    """Load model and optimizer state saved under any layout into this layout; returns the number of
    completed steps to resume after. Before anything is read into the model: the marker's checksum,
    whether the run of ``identity`` (``run_identity``) may resume it (``check_resumable`` names what
    changed), then every file's checksum. A weights-only checkpoint (``moetrain convert --from-hf``)
    loads the weights and starts at step 0 with a fresh optimizer."""
    if not (path / COMPLETE_MARKER).is_file():
        raise UserError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker); pick a step-* folder")
    if is_model_only(path):
        return _load_model_only(path, run, model_cfg)
    marker = read_marker(path)
    if identity is not None:
        check_resumable(marker, identity if isinstance(identity, dict) else {"hash": identity}, f"checkpoint {path}")
    verify_checkpoint(path)
    world = run.stage.dims.get_group("world")
    tensors = _model_tensors(run)
    params = dict(run.stage.model.named_parameters())
    moments = {name: {k: torch.zeros_like(p) for k in MOMENTS} for name, p in tensors.items() if name in params}
    flat = _flatten(_state(run, model_cfg, tensors, moments, torch.zeros(())))
    flat["trainer"] = ""
    with quiet_checkpoint_load(path):
        dcp.load(flat, checkpoint_id=path, planner=_LoadPlanner(), process_group=world)
    trainer = json.loads(flat["trainer"])
    steps = {float(value) for key, value in flat.items() if key.startswith("optim.state.") and key.endswith(".step")}
    assert len(steps) == 1, f"optimizer step counts differ across parameters: {sorted(steps)}"
    run.optimizer.load_params(tensors)
    run.optimizer.load_moments(moments, steps.pop())
    assert int(trainer["step"]) == marker["step"]
    return marker["step"]


def _load_model_only(path: Path, run: LayoutRun, model_cfg: ModelConfig) -> int:
    """The weights of a converted checkpoint, by parameter name, into this layout; step 0."""
    tensors = _model_tensors(run)
    global_shapes = {n: p.shape for n, p in _full_model(model_cfg).state_dict(keep_vars=True).items()}
    to_global = _placements(run, global_shapes)
    flat = _flatten({"model": {name: to_global(name, value) for name, value in tensors.items()}})
    describe = lambda reason: (f"converted checkpoint {path} does not fit this model ({reason}); train with the "
                               "model.yaml written beside it")
    with quiet_checkpoint_load(path, describe):
        dcp.load(flat, checkpoint_id=path, planner=_LoadPlanner(), process_group=run.stage.dims.get_group("world"))
    run.optimizer.load_params(tensors)
    return 0


def read_expert_placement(path: Path) -> dict | None:
    """The expert placement saved with a checkpoint by a balancing run, or None."""
    file = path / EXPERT_PLACEMENT_FILE
    return json.loads(file.read_text()) if file.is_file() else None
