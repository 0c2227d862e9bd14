"""Online expert balancing on 4 gloo ranks (tiny-pangu, EP4, skewed router): a forced migration after
the first of 5 steps changes the placement, evens the per-rank load, and leaves the losses those of the run
without migration. Also replicated experts in the dispatcher: same result as one replica each."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moetrain.balance.placement import ExpertPlacement
from moetrain.config import ModelConfig, ParallelConfig, TrainingConfig, load_cluster_config, load_model_config
from moetrain.distributed.balancing import build_balanced_run, moe_layers
from moetrain.distributed.checkpoint import load_checkpoint, read_expert_placement, save_checkpoint
from moetrain.distributed.ep import AllToAllDispatcher, ExpertTable, HierarchicalDispatcher, shard_experts
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.step import build_layout, train_step
from moetrain.distributed.world import spawn
from moetrain.models.experts import GroupedExperts
from moetrain.models.router import Routing, count_tokens_per_expert
from moetrain.models.transformer import build_model

STEPS = 5
EP = 4
SAVE_AT = 3
"""The balanced run saves after 3 steps: past its first migration (after step 0, its first check)."""
TRAINING = TrainingConfig(steps=STEPS, global_batch=8, micro_batch=2, seq_len=32, warmup_steps=2)
HOT_BIAS = {0: 0.5, 1: 0.4, 2: 0.3, 3: 0.2}
"""Router score bias: experts 0-3 (all on EP rank 0 in the contiguous layout) take most tokens."""


def skewed_model_config() -> ModelConfig:
    cfg = load_model_config("tiny-pangu")
    router = cfg.moe.router.model_copy(update={"score_bias": True, "bias_update_rate": 0.0})
    return cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"router": router})})


def replicated_start() -> ExpertPlacement:
    """The contiguous layout with the hot experts 0, 1, 2 also in the spare slots of ranks 1, 2, 3."""
    table = ExpertPlacement.contiguous(16, EP, 5).slot_expert.reshape(EP, 5).copy()
    table[1:, 4] = [0, 1, 2]
    return ExpertPlacement.from_slot_experts(16, table)


def skewed_model() -> torch.nn.Module:
    model = build_model(skewed_model_config(), "cpu", seed=TRAINING.seed)
    for _, block in moe_layers(model):
        for expert, bias in HOT_BIAS.items():
            block.router.score_bias[expert] = bias
    return model


def _balanced_run(dims: ParallelDims, balance: bool, placement: ExpertPlacement | None = None):
    # one spare slot per rank by default, so that the solver may replicate hot experts
    return build_balanced_run(dims, skewed_model_config(), TRAINING, "cpu", load_cluster_config("cpu"),
                              model=skewed_model(), placement=placement, interval=2, horizon=10,
                              trigger_margin=0.0 if balance else float("inf"))


def _run(dims: ParallelDims, balance: bool, placement: ExpertPlacement | None = None,
         save_dir: Path | None = None) -> dict:
    run, balancer = _balanced_run(dims, balance, placement)
    losses = []
    for step in range(STEPS):
        losses.append(train_step(run, step, TRAINING, torch.device("cpu")))
        balancer.after_step(step)
        if save_dir is not None and step + 1 == SAVE_AT:
            save_checkpoint(save_dir, SAVE_AT, run, skewed_model_config(), TRAINING,
                            expert_placement=balancer.state_dict())
    balancer.finish_migration()
    rows = torch.tensor([sum(h.local_rows) for h in balancer.history], dtype=torch.float64)
    per_rank_rows = [torch.empty_like(rows) for _ in range(EP)]
    dist.all_gather(per_rank_rows, rows, group=dims.get_group("ep"))
    return {
        "losses": losses,
        "rows": torch.stack(per_rank_rows).t().numpy(),  # [step, rank] measured expert rows
        "decisions": [d.as_dict() for d in balancer.decisions],
        "placements": [p.slot_expert.tolist() for p in balancer.placements],
        "replicas": [int(p.num_replicas().max()) for p in balancer.placements],
        "migrations": balancer.migrations,
    }


def _resume(dims: ParallelDims, path: Path) -> dict:
    """Resume the balanced run from its checkpoint, with its saved placement, to the end."""
    run, balancer = _balanced_run(dims, balance=True)
    restored = balancer.load_state_dict(read_expert_placement(path))
    restored_placements = [p.slot_expert.tolist() for p in balancer.placements]
    start = load_checkpoint(path, run, skewed_model_config())
    losses = []
    for step in range(start, STEPS):
        losses.append(train_step(run, step, TRAINING, torch.device("cpu")))
        balancer.after_step(step)
    balancer.finish_migration()
    return {"restored": restored, "restored_placements": restored_placements, "losses": losses,
            "placements": [p.slot_expert.tolist() for p in balancer.placements]}


def _load_without_balancing(rank: int, path: Path) -> float:
    """The same checkpoint under EP2 with the contiguous layout and no balancer: the next step's loss."""
    dims = ParallelDims.build(ParallelConfig(dp=EP, ep=2), rank, EP)
    run = build_layout(dims, skewed_model_config(), TRAINING, torch.device("cpu"))
    step = load_checkpoint(path, run, skewed_model_config())
    return train_step(run, step, TRAINING, torch.device("cpu"))


def _worker(rank: int, world_size: int, save_dir: Path) -> dict:
    dims = ParallelDims.build(ParallelConfig(dp=EP, ep=EP), rank, EP)
    out = {"plain": _run(dims, balance=False), "balanced": _run(dims, balance=True, save_dir=save_dir),
           "replicated": _run(dims, balance=True, placement=replicated_start())}
    path = save_dir / f"step-{SAVE_AT:06d}"
    out["resumed"] = _resume(dims, path)
    out["ep2_next_loss"] = _load_without_balancing(rank, path)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn(_worker, EP, tmp_path_factory.mktemp("balanced_checkpoints"))


@pytest.mark.slow
@pytest.mark.dist
def test_migration_keeps_losses_and_evens_load(runs: list[dict]) -> None:
    plain, balanced = runs[0]["plain"], runs[0]["balanced"]
    for rank_runs in runs:
        assert rank_runs["balanced"]["losses"] == balanced["losses"], "ranks disagree on the loss"
        assert rank_runs["balanced"]["placements"] == balanced["placements"], "ranks disagree on the placement"
    for step, (got, want) in enumerate(zip(balanced["losses"], plain["losses"])):
        assert abs(got - want) <= 1e-6 * abs(want), f"step {step}: {got} vs {want}"
    assert plain["losses"][-1] < plain["losses"][0]
    # the placement changed after step 0 (the first check plans in full), not in the observe-only run
    assert balanced["migrations"] >= 1 and plain["migrations"] == 0
    assert any(d["migrate"] and not d["early"] for d in balanced["decisions"] if d["step"] == 0)
    start = ExpertPlacement.contiguous(16, EP, 5).slot_expert.tolist()
    assert all(p == start for p in plain["placements"])
    assert any(p != start for p in balanced["placements"])
    # measured rows per EP rank: skewed before, more even after the first migration
    def imbalance(rows: np.ndarray) -> np.ndarray:
        return rows.max(axis=1) / rows.mean(axis=1)
    before, after = imbalance(balanced["rows"][:1]), imbalance(balanced["rows"][1:])
    assert before.min() > 1.5, before
    assert after.max() < before.min() - 0.3, (before, after)
    assert imbalance(plain["rows"][2:]).min() > 1.5


@pytest.mark.slow
@pytest.mark.dist
def test_replicated_experts_train_like_single_replicas(runs: list[dict]) -> None:
    """Starting with hot experts replicated (their tokens split, gradients summed, norm counted once),
    then migrating away from that layout: the losses are still those of the plain run."""
    plain, replicated = runs[0]["plain"], runs[0]["replicated"]
    for step, (got, want) in enumerate(zip(replicated["losses"], plain["losses"])):
        assert abs(got - want) <= 1e-6 * abs(want), f"step {step}: {got} vs {want}"
    assert replicated["migrations"] >= 1
    # rank 0 computes fewer rows than in the plain run from the first step: replicas took a share
    assert replicated["rows"][0, 0] < plain["rows"][0, 0]
    assert replicated["rows"][0, 1:].min() > plain["rows"][0, 1:].max()


@pytest.mark.slow
@pytest.mark.dist
def test_checkpoint_after_migration_resumes_and_loads_without_balancing(runs: list[dict]) -> None:
    """Saved after a migration: resumed with its placement, the run goes on exactly as the
    uninterrupted one; loaded under EP2 with the contiguous layout, the next loss is the same."""
    balanced = runs[0]["balanced"]
    start = ExpertPlacement.contiguous(16, EP, 5).slot_expert.tolist()
    for rank_runs in runs:
        resumed = rank_runs["resumed"]
        assert resumed["restored"]
        # the checkpoint holds a migrated placement, and the resumed run adopted it
        assert any(p != start for p in resumed["restored_placements"])
        assert resumed["losses"] == balanced["losses"][SAVE_AT:], (resumed["losses"], balanced["losses"])
        assert resumed["placements"] == balanced["placements"]
        got, want = rank_runs["ep2_next_loss"], balanced["losses"][SAVE_AT]
        assert abs(got - want) <= 1e-6 * abs(want), (got, want)


def _replica_worker(rank: int, world_size: int) -> dict:
    """Flat dispatch of the same tokens with and without a replicated hot expert: same outputs."""
    num_experts, hidden, tokens = 8, 6, 12
    group = dist.new_group(list(range(world_size)))
    intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    inter = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    torch.manual_seed(0)
    full = GroupedExperts(num_experts, hidden, 5)
    for w in (full.w_gate_EDF, full.w_up_EDF, full.w_down_EFD):
        torch.nn.init.normal_(w)
    single = ExpertPlacement.contiguous(num_experts, world_size, 3)
    table = single.slot_expert.reshape(world_size, 3).copy()
    table[1, 2], table[2, 2], table[3, 2] = 0, 0, 1  # expert 0 on ranks 0, 1, 2; expert 1 on 0 and 3
    replicated = ExpertPlacement.from_slot_experts(num_experts, table)
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:2] for _ in range(tokens)])
    ids[:, 0] = torch.arange(tokens) % 2  # every token to expert 0 or 1
    weights = torch.rand(tokens, 2, generator=gen)
    out = {}
    cases = (("single", single, False), ("replicated", replicated, False), ("replicated_hier", replicated, True))
    for name, placement, hierarchical in cases:
        expert_table = ExpertTable.from_placement(placement)
        dispatcher = (HierarchicalDispatcher(group, intra, inter, expert_table) if hierarchical
                      else AllToAllDispatcher(group, expert_table))
        routing = Routing(ids, weights, count_tokens_per_expert(ids, num_experts), torch.zeros(()))
        tokens_PD, per_slot, meta = dispatcher.dispatch(x, routing)
        out[name] = (dispatcher.combine(shard_experts(full, expert_table, rank)(tokens_PD, per_slot), meta),
                     per_slot)
    return out


@pytest.mark.dist
def test_replicated_experts_dispatch_same_outputs() -> None:
    results = spawn(_replica_worker, 4)
    for rank_out in results:
        torch.testing.assert_close(rank_out["replicated"][0], rank_out["single"][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rank_out["replicated_hier"][0], rank_out["single"][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rank_out["replicated_hier"][1], rank_out["replicated"][1])
    # the replicas share the hot experts' rows: rank 0 computes fewer rows, the replica holders more
    single_rows = [int(r["single"][1].sum()) for r in results]
    replicated_rows = [int(r["replicated"][1].sum()) for r in results]
    assert sum(single_rows) == sum(replicated_rows)
    assert replicated_rows[0] < single_rows[0]
    assert all(replicated_rows[rank] > single_rows[rank] for rank in (1, 2, 3))


def test_physical_slots_split_tokens_by_replica_share() -> None:
    # expert 0 on rank 0 slot 0 (share 0.75) and rank 1 slot 1 (share 0.25); expert 1 alone
    table = np.array([[0, 2], [1, 0]])
    share = np.array([[0.75, 1.0], [1.0, 0.25]])
    expert_table = ExpertTable.from_placement(ExpertPlacement.from_slot_experts(3, table, share))
    ids = torch.zeros(400, 1, dtype=torch.int64)
    slots = expert_table.physical_slots(ids)
    assert set(slots.unique().tolist()) == {0, 3}
    assert abs(int((slots == 0).sum()) - 300) <= 2
    assert expert_table.physical_slots(torch.tensor([[1], [2]])).tolist() == [[2], [1]]
    # a deterministic split: the same tokens go to the same replicas on every call
    assert torch.equal(expert_table.physical_slots(ids), slots)
    # without replicas the table is the plain lookup
    plain = ExpertTable.from_placement(ExpertPlacement.contiguous(4, 2))
    assert plain.replica_slots is None
    assert plain.physical_slots(torch.tensor([[3, 0]])).tolist() == [[3, 0]]


@pytest.mark.parametrize(("argv", "message"), [
    (["--nproc", "2", "--online-balance"],
     "--online-balance moves experts between expert-parallel ranks; give --ep > 1"),
    (["--nproc", "4", "--ep", "4", "--online-balance", "--slots-per-rank", "3"],
     "--slots-per-rank 3 cannot hold 16 experts on 4 ranks; give at least 4 (default 5: one spare slot for replicas)"),
    (["--nproc", "4", "--ep", "4", "--online-balance", "--balance-interval", "0"],
     "--balance-interval 0 and --balance-horizon 50 must be >= 1"),
    (["--nproc", "4", "--ep", "4", "--slots-per-rank", "5"],
     "--slots-per-rank, --balance-interval and --balance-horizon tune --online-balance; "
     "add --online-balance or drop them"),
])
def test_online_balance_flag_is_refused_where_it_cannot_run(argv: list[str], message: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from moetrain.distributed import launch
    from moetrain.errors import UserError

    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    args = parser.parse_args(argv)
    monkeypatch.setattr("moetrain.distributed.launch.subprocess.call", lambda *a, **k: pytest.fail("started"))
    with pytest.raises(UserError) as excinfo:
        launch.launch(args.nproc, args)
    assert str(excinfo.value) == message


def _sharded_state_worker(rank: int, world_size: int, save_dir: Path) -> dict:
    """EP2 × EDP2: the moved experts' optimizer state is ZeRO-sharded over two ranks and moves piece by
    piece between shards, in flight during the next step. EP2 × ETP2: each rank moves its FFN slice of
    the moved experts; a checkpoint saved after the migration loads without ETP and without balancing."""
    out = {}
    for layout, parallel in (("edp2", ParallelConfig(dp=4, ep=2)), ("etp2", ParallelConfig(dp=4, ep=2, etp=2))):
        dims = ParallelDims.build(parallel, rank, 4)
        for name, balance in (("plain", False), ("balanced", True)):
            run, balancer = _balanced_run(dims, balance)
            losses = []
            for step in range(STEPS):
                losses.append(train_step(run, step, TRAINING, torch.device("cpu")))
                balancer.after_step(step)
                if balance and layout == "etp2" and step + 1 == SAVE_AT:
                    save_checkpoint(save_dir, SAVE_AT, run, skewed_model_config(), TRAINING,
                                    expert_placement=balancer.state_dict())
            balancer.finish_migration()
            out[f"{layout}_{name}"] = {"losses": losses, "migrations": balancer.migrations,
                                       "moved_slots": sum(d.num_moves for d in balancer.decisions if d.migrate)}
    dims = ParallelDims.build(ParallelConfig(dp=4, ep=2), rank, 4)
    run = build_layout(dims, skewed_model_config(), TRAINING, torch.device("cpu"))
    step = load_checkpoint(save_dir / f"step-{SAVE_AT:06d}", run, skewed_model_config())
    out["etp2_checkpoint_next_loss_without_etp"] = train_step(run, step, TRAINING, torch.device("cpu"))
    return out


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn(_sharded_state_worker, 4, tmp_path_factory.mktemp("etp_balanced_checkpoints"))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", ["edp2", "etp2"])
def test_migration_with_sharded_experts_or_state_keeps_losses(sharded_runs: list[dict], layout: str) -> None:
    plain, balanced = sharded_runs[0][f"{layout}_plain"], sharded_runs[0][f"{layout}_balanced"]
    assert all(r[f"{layout}_balanced"]["losses"] == balanced["losses"] for r in sharded_runs), "ranks disagree"
    assert balanced["migrations"] >= 1 and balanced["moved_slots"] >= 1 and plain["migrations"] == 0
    for step, (got, want) in enumerate(zip(balanced["losses"], plain["losses"])):
        assert abs(got - want) <= 1e-6 * abs(want), f"step {step}: {got} vs {want}"


@pytest.mark.slow
@pytest.mark.dist
def test_checkpoint_after_migration_under_etp_loads_without_it(sharded_runs: list[dict]) -> None:
    want = sharded_runs[0]["etp2_balanced"]["losses"][SAVE_AT]
    for rank_runs in sharded_runs:
        got = rank_runs["etp2_checkpoint_next_loss_without_etp"]
        assert abs(got - want) <= 1e-6 * abs(want), (got, want)
