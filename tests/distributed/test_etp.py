"""Expert tensor parallelism: the split experts equal the whole ones (values and gradients); EP×ETP
layouts train like the single process on the loop and step ``moetrain train`` runs (tiny-pangu, fp32,
gloo, the real data pipeline: per-step loss, its parts and the gradient norm within 1e-4); an EP2×ETP2
checkpoint resumes under layouts without ETP or with ETP and TP on the same curve; each MoE layer pass
reads the host once.

The layouts run side by side on disjoint ranks of one 8-process world (one start-up for all, as in
``test_layout_parity``), on micro-batches of one sequence so that every replica has at least two
micro-batches for the overlapped schedule to pair.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _parity import (
    LOSS_FIELDS,
    assert_parity,
    losses_by_layout,
    run_spec,
    side_by_side,
)
from rich.console import Console

from moetrain.balance.placement import ExpertPlacement
from moetrain.config import ParallelConfig, TrainingConfig, load_model_config
from moetrain.distributed.ep import AllToAllDispatcher, ExpertTable, shard_experts
from moetrain.distributed.etp import ExpertTensorParallelDispatcher
from moetrain.distributed.layout import ParallelDims, validate_layout
from moetrain.distributed.overlap import SplitGradExperts, flush_weight_grads, set_split_grads
from moetrain.distributed.world import spawn
from moetrain.errors import UserError
from moetrain.models.dispatch import LocalDispatcher
from moetrain.models.experts import GroupedExperts
from moetrain.models.router import Routing, count_tokens_per_expert
from moetrain.runtime_base.checkpoint_files import checkpoint_dir
from moetrain.train import SuppliedParts, Trainer

TINY = load_model_config("tiny-pangu")

# ---- the experts alone: ETP == unsharded ------------------------------------------------------------

NUM_EXPERTS, TOP_K, HIDDEN, FFN, TOKENS = 8, 3, 6, 10, 12
EP, ETP = 2, 2


def _inputs(rank: int) -> tuple[torch.Tensor, Routing]:
    gen = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    if rank == 1:
        ids[:] = ids[0]  # a skewed rank: its ETP peer receives other counts than it does
    weights = torch.rand(TOKENS, TOP_K, generator=gen)
    return x, Routing(ids, weights, count_tokens_per_expert(ids, NUM_EXPERTS), torch.zeros(()))


def _full_experts() -> GroupedExperts:
    torch.manual_seed(0)
    full = GroupedExperts(NUM_EXPERTS, HIDDEN, FFN)
    for weight in (full.w_gate_EDF, full.w_up_EDF, full.w_down_EFD):
        torch.nn.init.normal_(weight)
    return full


def _run(dispatcher, experts: GroupedExperts, rank: int) -> dict[str, torch.Tensor]:
    x, routing = _inputs(rank)
    x.requires_grad_(True)
    weights = routing.weights_TK.clone().requires_grad_(True)
    routing = Routing(routing.expert_ids_TK, weights, routing.tokens_per_expert_E, routing.aux_loss)
    tokens, per_expert, meta = dispatcher.start_dispatch(x, routing).finish()
    y = dispatcher.combine(experts(tokens, per_expert), meta)
    y.pow(2).sum().backward()
    flush_weight_grads()
    return {"y": y.detach(), "x_grad": x.grad, "w_grad": weights.grad}


def _experts_worker(rank: int, world_size: int) -> dict:
    # Expert grid [ep, etp] = [2, 2]: rank = ep_rank · 2 + etp_rank.
    ep_rank, etp_rank = divmod(rank, ETP)
    ep_groups = [dist.new_group([e * ETP + t for e in range(EP)]) for t in range(ETP)]
    etp_groups = [dist.new_group([e * ETP + t for t in range(ETP)]) for e in range(EP)]
    slots = np.random.default_rng(1).permutation(NUM_EXPERTS).reshape(EP, -1)  # a non-contiguous home
    table = ExpertTable.from_placement(ExpertPlacement.from_slot_experts(NUM_EXPERTS, slots))
    out: dict = {}
    for split_grads in (False, True):
        experts = shard_experts(_full_experts(), table, ep_rank, etp_rank, ETP)
        if split_grads:
            SplitGradExperts.adopt(experts)
        set_split_grads(split_grads)
        dispatcher = ExpertTensorParallelDispatcher(AllToAllDispatcher(ep_groups[etp_rank], table),
                                                    etp_groups[ep_rank], table)
        result = _run(dispatcher, experts, rank)
        result["weights"] = {n: p.detach().clone() for n, p in experts.named_parameters()}
        result["grads"] = {n: p.grad.clone() for n, p in experts.named_parameters()}
        out[split_grads] = result
    set_split_grads(False)
    # The whole experts in one process, on every rank's tokens: the reference.
    full = _full_experts()
    out["reference"] = [_run(LocalDispatcher(), full, source) for source in range(world_size)]
    out["reference_grads"] = {n: p.grad.clone() for n, p in full.named_parameters()}
    out["held"] = table.experts_by_rank[ep_rank]
    return out


@pytest.fixture(scope="module")
def experts_results() -> list[dict]:
    return spawn(_experts_worker, EP * ETP)


@pytest.mark.dist
@pytest.mark.parametrize("split_grads", [False, True])
def test_etp_experts_equal_the_whole_experts(experts_results: list[dict], split_grads: bool) -> None:
    width = FFN // ETP
    for rank, res in enumerate(experts_results):
        ep_rank, etp_rank = divmod(rank, ETP)
        got, want = res[split_grads], res["reference"][rank]
        for key in ("y", "x_grad", "w_grad"):
            # Summed in another order than the whole experts (the ETP slices' partial outputs, then the
            # reduce-scatter), so an element near a cancellation can differ in its fourth digit: compare
            # whole tensors by relative distance, where a misplaced or missing contribution gives about 1.
            distance = float((got[key] - want[key]).norm() / want[key].norm())
            assert distance < 1e-5, f"rank {rank} {key}: relative distance {distance:.1e}"
        # Each slot holds its expert's FFN slice, and its gradient is that slice of the whole gradient
        # over every rank's tokens (edp = 1 here: no other replica to sum with).
        held = list(res["held"])
        columns = slice(etp_rank * width, (etp_rank + 1) * width)
        full_grads = res["reference_grads"]
        for name in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"):
            index = (held, slice(None), columns) if name != "w_down_EFD" else (held, columns)
            assert got["weights"][name].shape[1:] == full_grads[name][index].shape[1:]
            want_grad = full_grads[name][index]
            # Summed in another order than the whole matmul: relative distance, where a misplaced or
            # missing contribution gives about 1.
            distance = float((got["grads"][name] - want_grad).norm() / want_grad.norm())
            assert distance < 1e-5, f"rank {rank} {name}: relative distance {distance:.1e}"


# ---- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("parallel", "ffn", "message"), [
    (ParallelConfig(dp=4, etp=4), 66, "expert FFN width 66 does not divide by etp=4"),
    (ParallelConfig(dp=4, ep=2, etp=2, a2a="hierarchical"), 64,
     "hierarchical all-to-all does not run with expert tensor parallelism (etp > 1)"),
])
def test_etp_layouts_refused_before_start(parallel: ParallelConfig, ffn: int, message: str) -> None:
    model = TINY.model_copy(update={"moe": TINY.moe.model_copy(update={"expert_ffn_hidden": ffn})})
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_layout(parallel, model, 4, ranks_per_node=2)


def test_etp_layout_accepted() -> None:
    validate_layout(ParallelConfig(tp=2, sp=True, dp=2, ep=2, etp=2), TINY, 4, global_batch=8, micro_batch=1)


# ---- training: per-step loss parity, resharding, host reads -----------------------------------------

STEPS, SAVED_AT = 3, 1  # two steps after the resume: the last shows the restored moments
TRAINING = TrainingConfig(steps=STEPS, global_batch=8, micro_batch=1, seq_len=32, warmup_steps=2)
SAVE_LAYOUT = "ep2_etp2"
"""Saves every ``SAVED_AT`` steps while it trains; also counts its host reads."""
BASE_ROUND = {
    "ep2_etp2": ParallelConfig(dp=4, ep=2, etp=2),
    "tp2_sp_ep2_etp2": ParallelConfig(tp=2, sp=True, dp=2, ep=2, etp=2),
}
ROUNDS: list[dict[str, ParallelConfig]] = [
    BASE_ROUND,
    {f"{name}_overlap": parallel.model_copy(update={"overlap": True}) for name, parallel in BASE_ROUND.items()},
    {  # ETP without EP (the local dispatcher inside) under an overlapped pipeline; ETP across CP ranks
        "pp2_etp2_dp2_overlap": ParallelConfig(pp=2, dp=2, etp=2, overlap=True),
        "cp2_dp2_ep2_etp2": ParallelConfig(cp=2, dp=2, ep=2, etp=2),
    },
]
LOAD_LAYOUTS = {
    "ep4_resumed": ParallelConfig(dp=4, ep=4),
    "tp2_etp2_overlap_resumed": ParallelConfig(tp=2, sp=True, dp=2, etp=2, overlap=True),
}
"""Resumed from the EP2×ETP2 checkpoint at step ``SAVED_AT``, side by side."""


def _trained(name: str, parallel: ParallelConfig, dims: ParallelDims, data: Path, root: Path) -> dict:
    """The layout's metrics rows; the save layout also saves and counts its MoE passes and host reads."""
    from moetrain.distributed.balancing import moe_layers

    if name in LOAD_LAYOUTS:
        spec = run_spec(TRAINING, parallel, data, save_dir=str(root / name), resume=True)
    elif name == SAVE_LAYOUT:
        spec = run_spec(TRAINING, parallel, data, save_dir=str(root / name), save_every=SAVED_AT)
    else:
        spec = run_spec(TRAINING, parallel, data)
    trainer = Trainer(spec, SuppliedParts(dims=dims, console=Console(file=io.StringIO())))
    passes = [0]
    for _, block in moe_layers(trainer.run.stage.model):
        block.register_forward_hook(lambda *args: passes.__setitem__(0, passes[0] + 1))
    out = {name: trainer.train()}
    if name == SAVE_LAYOUT:
        names = [s.name for s in trainer.tracer.spans]
        out["host_reads"] = [{"moe_passes": passes[0], "ep_reads": names.count("counts_d2h"),
                              "etp_reads": names.count("etp_counts_d2h")}]
        if dims.rank == dims.group_ranks["world"][0]:  # the step-SAVED_AT checkpoint alone, for each resumed layout
            for load in LOAD_LAYOUTS:
                shutil.copytree(checkpoint_dir(root / name, SAVED_AT), checkpoint_dir(root / load, SAVED_AT))
    return out


def _worker(rank: int, world_size: int, data: Path, root: Path) -> dict[str, list]:
    results: dict[str, list] = {}
    for layouts in [*ROUNDS, LOAD_LAYOUTS]:
        if layouts is LOAD_LAYOUTS:
            dist.barrier()  # the saved checkpoint is in place before any rank resumes it
        for name, parallel, dims in side_by_side(layouts, rank):
            results.update(_trained(name, parallel, dims, data, root))
    return results


@pytest.fixture(scope="module")
def reference(references) -> list[dict]:
    return references.rows(TRAINING)


@pytest.fixture(scope="module")
def layout_rows(corpus, reference, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    # after the reference: it has built the data cache the ranks then read
    return losses_by_layout(spawn(_worker, 8, corpus, tmp_path_factory.mktemp("etp_checkpoints")))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", [name for layouts in ROUNDS for name in layouts])
def test_etp_layout_matches_single_process(layout: str, layout_rows: dict, reference: list[dict]) -> None:
    parallel = next(p for layouts in ROUNDS for n, p in layouts.items() if n == layout)
    assert len(reference) == STEPS
    assert_parity(layout, layout_rows[layout], reference, parallel.world_size, fields=LOSS_FIELDS)
    assert reference[-1]["loss"] < reference[0]["loss"]  # the run trains
    for got, want in zip(layout_rows[layout][0], reference):
        assert got["expert_load_max_over_mean"] == pytest.approx(want["expert_load_max_over_mean"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", LOAD_LAYOUTS)
def test_etp_checkpoint_reshards(layout: str, layout_rows: dict, reference: list[dict]) -> None:
    resumed = layout_rows[layout]
    assert [r["step"] for r in resumed[0]] == list(range(SAVED_AT + 1, STEPS + 1))
    assert_parity(layout, resumed, reference[SAVED_AT:], LOAD_LAYOUTS[layout].world_size, fields=LOSS_FIELDS)


@pytest.mark.slow
@pytest.mark.dist
def test_etp_dispatch_reads_the_host_once_per_moe_layer(layout_rows: dict) -> None:
    """EP2×ETP2: one count exchange over the EP×ETP ranks gives both the all-to-all splits and the ETP
    gather's member counts, so each MoE layer pass reads device values on the host once."""
    counts = [rank_counts[0] for rank_counts in layout_rows["host_reads"]]
    assert len(counts) == BASE_ROUND[SAVE_LAYOUT].world_size
    for rank_counts in counts:
        assert rank_counts["moe_passes"] > 0
        assert rank_counts["ep_reads"] == rank_counts["moe_passes"] and rank_counts["etp_reads"] == 0, rank_counts
