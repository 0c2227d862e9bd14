"""ZeRO-2 and ZeRO-3 AdamW through PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

(Rajbhandari et al. 2020, "ZeRO", stages 2 and 3; Zhao et al. 2023, "PyTorch FSDP", and the FSDP2
per-parameter sharding with DTensor.) Every parameter of the stage model is sharded along dim 0 over
the same group ``ZeroAdamW`` reduces it over (``grad_groups.kind_rules``): routed experts over ``edp``,
replicated dense parameters and the shared embedding over the whole ``stage``, tensor-parallel shards
and TP-identical parameters over ``dp_cp``. Each rank keeps the AdamW moments and the summed gradient
of its shard only (stage 2); with stage 3 it also frees the gathered parameters after each forward
and gathers them again for the backward.

FSDP2 gathers and reduces per *unit*, a module run through its ``__call__``. The units are the modules
the pipeline executor calls itself (the embedding, each decoder layer, the final norm, the head, each
multi-token-prediction module and its final norm), and inside a unit, on another group, the largest
submodules whose parameters all reduce over that other group (the experts; under tensor parallelism
the sharded projections and dense FFNs). A final ``fully_shard`` of the whole model, owning no
parameter, is the root that ties the units' states together (one end-of-backward callback).

Choices that keep the arithmetic that of ``ZeroAdamW`` (and of the single-process trainer):

- Gradients are summed, not averaged: the loss is already divided by the global batch's label tokens
  (a divide factor of 1, and sum-only collectives, which gloo supports).
- Each backward (each micro-batch, in any pipeline order) reduce-scatters its gradients into the
  sharded ones, which accumulate: the sum of reduce-scatters is the reduce-scatter of the sum.
- Stage 2 keeps the gathered parameters from the first forward of a step to the optimizer step
  (neither forward nor backward reshards) and reshards after the update, so the next forward gathers
  the updated values: one gather per unit and step, as ZeRO-1.
- The embedding shared by the first and last pipeline stage is sharded identically on both (same
  stage size and shape), so summing the sharded gradients over ``embed`` after the reduce-scatter
  gives the same sum as ``ZeroAdamW``'s pre-reduce.
- The global norm counts every distinct element once (``norm_share``); clipping and AdamW are
  ``ZeroAdamW``'s, on the local shards (AdamW is elementwise).
Buffers (the routers' score biases) are not sharded and not touched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from moetrain.config import TrainingConfig
from moetrain.distributed.grad_groups import MOMENTS, clip_and_set_lr, kind_rules, param_kind, world_norm
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.parallelize import last_stage_holds_embedding
from moetrain.distributed.tp import ParamKind
from moetrain.distributed.trace import span
from moetrain.errors import UserError


def executor_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules the pipeline executor calls on their own, each nested block before its parent
    (an MTP module's final norm runs after the module, so it cannot be part of the module's unit)."""
    blocks: list[nn.Module] = [model.embed] if hasattr(model, "embed") else []
    blocks += list(model.layers.values())
    for module in model.mtp:
        blocks += [module.final_norm, module]
    blocks += [getattr(model, name) for name in ("final_norm", "head") if hasattr(model, name)]
    return blocks


def plan_units(block: nn.Module, axis_of: dict[nn.Parameter, str],
               skip: set[nn.Module]) -> list[tuple[nn.Module, str]]:
    """(module, axis) for each FSDP unit of ``block``, innermost first, the block itself last. The
    block's home axis is ``stage`` when it holds any stage-reduced parameter, else (the final norm and
    head under tensor parallelism) the axis of its parameters; the largest submodules all of whose
    parameters reduce over another axis become units of their own. ``skip``: submodules that are units
    elsewhere (nested executor blocks). Each unit must be run through ``__call__``, and its parameters
    read only inside its forward: FSDP gathers them in its forward pre-hook."""

    def axes(module: nn.Module) -> set[str]:
        found = {axis_of[p] for p in module.parameters(recurse=False)}
        for child in module.children():
            if child not in skip:
                found |= axes(child)
        return found

    block_axes = axes(block)
    home = "stage" if "stage" in block_axes or not block_axes else min(block_axes)
    units: list[tuple[nn.Module, str]] = []

    def visit(module: nn.Module) -> None:
        own = {axis_of[p] for p in module.parameters(recurse=False)}
        if own - {home}:
            raise AssertionError(f"{type(module).__name__} holds parameters of groups {sorted(own)} itself; "
                                 "it cannot be split into FSDP units")
        for child in module.children():
            found = set() if child in skip else axes(child)
            if not found or found == {home}:
                continue
            if len(found) == 1:
                units.append((child, found.pop()))
            else:
                visit(child)

    visit(block)
    return units + [(block, home)]


def _local_chunk(value: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's dim-0 shard of the whole ``value`` as FSDP2 lays it out (``torch.chunk``, empty
    chunks for the last ranks when the dim is short)."""
    mesh = like.device_mesh
    size, rank = mesh.size(), mesh.get_local_rank()
    chunks = torch.chunk(value, size, dim=0)
    local = chunks[rank] if rank < len(chunks) else value.new_empty((0, *value.shape[1:]))
    assert local.shape == like.to_local().shape, f"shard {tuple(local.shape)} ≠ {tuple(like.to_local().shape)}"
    return local


def _whole(value: DTensor) -> torch.Tensor:
    """The gathered tensor, never a view of the shard: on a one-rank mesh ``full_tensor`` returns the
    local tensor itself, which the next update would change under the caller."""
    whole = value.full_tensor()
    shared = whole.untyped_storage().data_ptr() == value.to_local().untyped_storage().data_ptr()
    return whole.clone() if shared else whole


class FullyShardedAdamW:
    """ZeRO stage 2 or 3 AdamW over FSDP2-sharded parameters; ``ZeroAdamW``'s interface."""

    def __init__(self, model: nn.Module, dims: ParallelDims, cfg: TrainingConfig,
                 tp_kinds: dict[str, ParamKind] | None = None, stage: int = 3) -> None:
        if stage not in (2, 3):
            raise ValueError(f"FullyShardedAdamW runs ZeRO stage 2 or 3, not {stage}")
        if model.cfg.tie_embeddings:
            raise UserError("ZeRO-2/3 do not run with tied embeddings (the head reads the embedding's weight "
                            "outside its module); use zero 1")
        self.model, self.dims, self.cfg, self.stage = model, dims, cfg, stage
        rules = kind_rules(dims)
        shared = last_stage_holds_embedding(model.cfg)
        kinds = {name: param_kind(name, dims, tp_kinds, shared) for name, _ in model.named_parameters()}
        axis_of = {p: rules[kinds[name]][0] for name, p in model.named_parameters()}
        device = next(model.parameters()).device
        meshes = {axis: DeviceMesh.from_group(dims.get_group(axis), device.type, mesh_dim_names=(axis,))
                  for axis in sorted({"stage", *axis_of.values()})}
        self.units = self._shard(model, axis_of, meshes)
        # Sharding replaced every parameter by a DTensor: collect them again, by name.
        self.named = list(model.named_parameters())
        assert all(isinstance(p, DTensor) for _, p in self.named), "a parameter was left out of every FSDP unit"
        self.norm_share = {name: 1.0 / rules[kinds[name]][2] for name, _ in self.named}
        self.embed_params = [p for name, p in self.named if kinds[name] == "embed"]
        groups: dict[tuple[str, bool], list[nn.Parameter]] = {}
        for name, p in self.named:
            # one optimizer group per kind: a foreach update never mixes DTensors of different meshes
            groups.setdefault((kinds[name], p.ndim >= 2), []).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": params, "weight_decay": cfg.weight_decay if decay else 0.0}
             for (_, decay), params in sorted(groups.items())],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)

    def _shard(self, model: nn.Module, axis_of: dict[nn.Parameter, str],
               meshes: dict[str, DeviceMesh]) -> list[FSDPModule]:
        blocks = executor_blocks(model)
        units: list[FSDPModule] = []
        for block in blocks:
            for module, axis in plan_units(block, axis_of, set(blocks) - {block}):
                unit = fully_shard(module, mesh=meshes[axis], reshard_after_forward=self.stage == 3)
                # Sum (the loss is already normalised). A divide factor of 1 alone would reduce with
                # NCCL's PREMUL_SUM, which gloo lacks; forcing sum-only collectives makes it a plain sum.
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)
                unit.set_reshard_after_backward(self.stage == 3, recurse=False)
                units.append(unit)
        root = fully_shard(model, mesh=meshes["stage"], reshard_after_forward=self.stage == 3)
        # The executor calls the blocks, never model.forward, and FSDP2 makes the first module to run
        # forward the root: initialise the whole model's root now, so all units share one state (one
        # end-of-backward callback that reduces every unit still holding gradients).
        root._get_fsdp_state()._lazy_init()
        return units

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None

    def _reshard(self) -> None:
        """Free gathered parameters (stage 2 keeps them through the step's backward): the next forward
        gathers the sharded values, which are the only ones the update changes."""
        for unit in self.units:
            unit.reshard()

    @torch.no_grad()
    def step(self, lr: float, norm_sq_correction: torch.Tensor | None = None) -> torch.Tensor:
        """``reduce_gradients`` then ``apply_update``; returns the global gradient norm."""
        grad_norm = self.reduce_gradients(norm_sq_correction)
        self.apply_update(lr, grad_norm)
        return grad_norm

    @torch.no_grad()
    def reduce_gradients(self, norm_sq_correction: torch.Tensor | None = None) -> torch.Tensor:
        """Sum the shared embedding over ``embed`` (the rest was reduce-scattered in each backward) and
        return the global gradient norm (the same on every rank). ``norm_sq_correction``: as
        ``ZeroAdamW.reduce_gradients``."""
        for _, p in self.named:
            if p.grad is None:  # as ZeroAdamW: a parameter without gradient gets a zero one
                p.grad = torch.zeros_like(p)
        with span("grad_allreduce", "comm"):
            for p in self.embed_params:
                dist.all_reduce(p.grad.to_local(), group=self.dims.get_group("embed"))
        grads = [p.grad.to_local() for _, p in self.named]
        squares = [g.double().pow(2).sum() * self.norm_share[name] for (name, _), g in zip(self.named, grads)]
        return world_norm(squares, norm_sq_correction, self.dims.get_group("world"))

    @torch.no_grad()
    def apply_update(self, lr: float, grad_norm: torch.Tensor) -> None:
        """Clip by the global norm and update this rank's shards (AdamW is elementwise)."""
        grads = [p.grad.to_local() for _, p in self.named]
        clip_and_set_lr(self.optimizer, grads, grad_norm, self.cfg.grad_clip, lr)
        self.optimizer.step()
        if self.stage == 2:
            self._reshard()

    def discard_update(self) -> None:
        """Instead of ``apply_update``: leave parameters and moments as they were, and reshard as an
        update would (stage 2), so that the next step starts from the same state either way."""
        if self.stage == 2:
            self._reshard()

    @torch.no_grad()
    def moments_by_name(self) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor]:
        """The AdamW moments of every local parameter in its local (TP/EP-sharded) shape, gathered over
        its FSDP group, and the step count: what a checkpoint saves."""
        moments: dict[str, dict[str, torch.Tensor]] = {}
        step = torch.zeros(())
        for name, p in self.named:
            state = self.optimizer.state.get(p, {})
            if "step" in state:
                step = state["step"].detach().cpu().float()
            moments[name] = {k: _whole(state[k]) if k in state else torch.zeros(p.shape, device=p.device)
                             for k in MOMENTS}
        return moments, step

    @torch.no_grad()
    def load_moments(self, moments: dict[str, dict[str, torch.Tensor]], step: float) -> None:
        """Set every parameter's AdamW state from the moments in local shape (each rank keeps its shard)."""
        for name, p in self.named:
            state = {"step": torch.tensor(float(step))}
            for key in MOMENTS:
                state[key] = torch.zeros_like(p)
                state[key].to_local().copy_(_local_chunk(moments[name][key].to(p.to_local()), p))
            self.optimizer.state[p] = state

    @torch.no_grad()
    def params_by_name(self) -> dict[str, torch.Tensor]:
        """Every local parameter's value in its local (TP/EP-sharded) shape, gathered over its FSDP
        group: what a checkpoint saves."""
        self._reshard()  # the registered parameters are the sharded ones only when resharded
        return {name: _whole(p) for name, p in self.named}

    @torch.no_grad()
    def load_params(self, values: dict[str, torch.Tensor]) -> None:
        """Set every parameter from its value in local shape (the inverse of ``params_by_name``)."""
        self._reshard()
        for name, p in self.named:
            p.to_local().copy_(_local_chunk(values[name].to(p.to_local()), p))
