"""Online expert balancing through the loop ``moetrain train --online-balance`` runs (``Trainer`` with
``balance.enabled``), on 4 gloo ranks with tiny-pangu's router skewed at init (a fixed score bias sends
most tokens to experts 0-3, all on EP rank 0 in the contiguous layout):

* under EP4 the first full re-plan (after step 0) migrates experts, evens the per-rank load, and the run
  keeps the losses, loss parts and gradient norms of the single-process run of the same model (1e-4);
  so does a run started with the hot experts replicated;
* a checkpoint saved after the migration resumes with its placement exactly on the uninterrupted curve,
  and loads under EP2 without balancing on the same curve;
* with the moved experts' optimizer state ZeRO-sharded (EP2 × EDP2) or their FFN split (EP2 × ETP2)
  the losses are still the single-process ones, and the ETP checkpoint loads without ETP;
* with the layers traced by ``torch.compile`` the balanced run keeps those losses and counts, its hooks
  shared by every MoE layer's graphs instead of a graph per layer;
* each step's due solves are split over the EP ranks, and every rank takes the decisions it takes when it
  runs every solve itself;
* replicated experts in the dispatcher give the outputs of single replicas; flags that cannot run are
  refused before any process starts.

Routing skew is the point here, not the text: the runs read the synthetic counting batches
(``run.synthetic_data``), the single-process reference too.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _parity import LOSS_FIELDS, assert_parity, losses_by_layout, run_spec, single_process_rows
from rich.console import Console

from moetrain.balance.placement import ExpertPlacement
from moetrain.config import ModelConfig, ParallelConfig, TrainingConfig, load_model_config
from moetrain.config.run import BalanceOptions, RunSpec
from moetrain.distributed.balancing import (
    BalancedRunSetup,
    BalancerTuning,
    SplitSearches,
    build_balanced_run,
    moe_layers,
)
from moetrain.distributed.checkpoint import read_expert_placement
from moetrain.distributed.ep import AllToAllDispatcher, ExpertTable, HierarchicalDispatcher, shard_experts
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.parallelize import apply_compile
from moetrain.distributed.world import spawn
from moetrain.errors import UserError
from moetrain.models.dispatch import LocalDispatcher
from moetrain.models.experts import GroupedExperts
from moetrain.models.router import Routing, count_tokens_per_expert
from moetrain.models.transformer import build_model
from moetrain.runtime_base.checkpoint_files import checkpoint_dir
from moetrain.train import SuppliedParts, Trainer

STEPS = 5
EP = 4
SAVE_AT = 3
"""The balanced runs save after 3 steps: past their first migration (after step 0, the first full re-plan)."""
TRAINING = TrainingConfig(steps=STEPS, global_batch=8, micro_batch=2, seq_len=32, warmup_steps=2)
BALANCE = BalanceOptions(enabled=True, interval=2, horizon=10)
HOT_BIAS = {0: 0.5, 1: 0.4, 2: 0.3, 3: 0.2}
"""Router score bias: experts 0-3 (all on EP rank 0 in the contiguous layout) take most tokens."""
EP4 = ParallelConfig(dp=EP, ep=EP)
SHARDED = {"edp2": ParallelConfig(dp=4, ep=2), "etp2": ParallelConfig(dp=4, ep=2, etp=2)}
"""Balanced layouts whose moved experts' state is sharded over two ranks, or whose experts are split."""


def skewed_model_config() -> ModelConfig:
    cfg = load_model_config("tiny-pangu")
    router = cfg.moe.router.model_copy(update={"score_bias": True, "bias_update_rate": 0.0})
    return cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"router": router})})


def skewed_model() -> torch.nn.Module:
    model = build_model(skewed_model_config(), "cpu", seed=TRAINING.seed)
    for _, block in moe_layers(model):
        for expert, bias in HOT_BIAS.items():
            block.router.score_bias[expert] = bias
    return model


def contiguous_start() -> list[int]:
    """``moetrain train --online-balance``'s starting table under EP4: experts/ep + 1 slots per rank."""
    return ExpertPlacement.contiguous(16, EP, 5).slot_expert.tolist()


def replicated_start() -> ExpertPlacement:
    """The contiguous layout with the hot experts 0, 1, 2 also in the spare slots of ranks 1, 2, 3."""
    table = ExpertPlacement.contiguous(16, EP, 5).slot_expert.reshape(EP, 5).copy()
    table[1:, 4] = [0, 1, 2]
    return ExpertPlacement.from_slot_experts(16, table)


def spec(parallel: ParallelConfig, balance: bool = True, **run) -> RunSpec:
    base = run_spec(TRAINING, parallel, None, ranks_per_node=EP, **run)
    return RunSpec(**{**base.model_dump(), "balance": BALANCE if balance else BalanceOptions()})


class ReplicatedStartTrainer(Trainer):
    """The balanced run of ``moetrain train --online-balance``, its table starting with replicas."""

    def build_run(self, model):
        balance = self.spec.balance
        setup = BalancedRunSetup(model=model, placement=replicated_start(),
                                 tuning=BalancerTuning(interval=balance.interval, horizon=balance.horizon))
        run, self.balancer = build_balanced_run(self.dims, self.model_cfg, self.cfg, self.device, self.cluster, setup)
        return run


class EveryRankSolvesTrainer(Trainer):
    """The balanced run of ``moetrain train --online-balance`` with every EP rank running every due solve, as
    before the solves were split over the ranks."""

    def build_run(self, model):
        balance = self.spec.balance
        setup = BalancedRunSetup(model=model, tuning=BalancerTuning(interval=balance.interval, horizon=balance.horizon,
                                                                    split_searches=False))
        run, self.balancer = build_balanced_run(self.dims, self.model_cfg, self.cfg, self.device, self.cluster, setup)
        return run


class TracedLayersTrainer(Trainer):
    """The balanced run with its layers under ``torch.compile``'s tracing, run by the ``eager`` backend: Dynamo
    decides how many graphs the balancer's hooks cost whatever the backend, and Inductor's compile time is
    not this test's business (``tests/distributed/test_compile.py``). Code that needs more graphs than
    Dynamo's recompile limit, and would run eager past it, fails the run instead. The limit is 6 here, not 8,
    so that a graph per MoE layer exceeds it with tiny-pangu's 7 (the large presets have 58 to 94), while the
    MoE code after dispatch needs up to 5 (static and dynamic rows, Dynamo's own for 0 and 1 rows, and with
    the hook that lands migrated weights)."""

    def apply_compile(self) -> int:
        torch._dynamo.reset()
        torch._dynamo.config.recompile_limit = 6  # this rank's process only
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        return apply_compile(self.run.stage.model, backend="eager")


def _train(the_spec: RunSpec, dims: ParallelDims, trainer_class: type[Trainer] = Trainer) -> dict:
    """The run's metrics rows, and what its balancer saw and did (this rank's view; ``rows`` per EP rank)."""
    console = Console(file=io.StringIO())
    trainer = trainer_class(the_spec, SuppliedParts(dims=dims, model_cfg=skewed_model_config(), model=skewed_model(),
                                                    console=console))
    out = {"metrics": trainer.train(), "log": console.file.getvalue()}
    balancer = trainer.balancer
    if balancer is None:
        return out
    rows = torch.tensor([sum(h.local_rows) for h in balancer.history], dtype=torch.float64)
    per_rank_rows = [torch.empty_like(rows) for _ in range(dims.size("ep"))]
    dist.all_gather(per_rank_rows, rows, group=dims.get_group("ep"))
    out.update({
        "rows": torch.stack(per_rank_rows).t().numpy(),  # [step, EP rank] measured expert rows
        "tokens_per_expert": [h.tokens_per_expert for h in balancer.history],  # [step][layer, expert]
        "decisions": [d.as_dict() for d in balancer.decisions],
        "placements": [p.slot_expert.tolist() for p in balancer.placements],
        "migrations": balancer.migrations,
        "moved_slots": sum(d.num_moves for d in balancer.decisions if d.migrate),
        "searched": None if balancer.searches is None else balancer.searches.searched,
    })
    return out


def _copy_checkpoint(dims: ParallelDims, source: Path, target: Path) -> None:
    """The step-``SAVE_AT`` checkpoint alone in a folder of its own: what an interrupted run leaves."""
    if dims.rank == dims.group_ranks["world"][0]:
        shutil.copytree(checkpoint_dir(source, SAVE_AT), checkpoint_dir(target, SAVE_AT))
    dist.barrier(group=dims.get_group("world"))


def _worker(rank: int, world_size: int, root: Path) -> dict:
    ep4 = ParallelDims.build(EP4, rank, EP)
    ep2 = ParallelDims.build(ParallelConfig(dp=EP, ep=2), rank, EP)
    sharded = {name: ParallelDims.build(parallel, rank, EP) for name, parallel in SHARDED.items()}
    out = {"balanced": _train(spec(EP4, save_dir=str(root / "balanced"), save_every=SAVE_AT), ep4),
           "replicated": _train(spec(EP4), ep4, ReplicatedStartTrainer),
           "every_rank_solves": _train(spec(EP4), ep4, EveryRankSolvesTrainer),
           "traced": _train(spec(EP4), ep4, TracedLayersTrainer)}
    out["saved_placement"] = read_expert_placement(checkpoint_dir(root / "balanced", SAVE_AT))
    _copy_checkpoint(ep4, root / "balanced", root / "resumed")
    out["resumed"] = _train(spec(EP4, save_dir=str(root / "resumed"), resume=True), ep4)
    _copy_checkpoint(ep4, root / "balanced", root / "ep2")
    out["ep2_from_balanced"] = _train(spec(ep2.parallel, balance=False, save_dir=str(root / "ep2"), resume=True), ep2)
    out["edp2"] = _train(spec(SHARDED["edp2"]), sharded["edp2"])
    out["etp2"] = _train(spec(SHARDED["etp2"], save_dir=str(root / "etp2"), save_every=SAVE_AT), sharded["etp2"])
    _copy_checkpoint(ep2, root / "etp2", root / "etp2_to_ep2")
    out["ep2_from_etp2"] = _train(spec(ep2.parallel, balance=False, save_dir=str(root / "etp2_to_ep2"),
                                       resume=True), ep2)
    return out


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    """The single-process run of the same skewed model on the same batches (no balancing: one rank)."""
    return single_process_rows(spec(ParallelConfig(), balance=False), model_cfg=skewed_model_config(),
                               model=skewed_model())


@pytest.fixture(scope="module")
def runs(reference, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn(_worker, EP, tmp_path_factory.mktemp("balanced_checkpoints"))


def _imbalance(rows: np.ndarray) -> np.ndarray:
    return rows.max(axis=-1) / rows.mean(axis=-1)


def _metrics(runs: list[dict], name: str) -> list[list[dict]]:
    return losses_by_layout([{name: rank_runs[name]["metrics"]} for rank_runs in runs])[name]


@pytest.mark.slow
@pytest.mark.dist
def test_migration_keeps_the_single_process_losses_and_evens_load(runs: list[dict], reference: list[dict]) -> None:
    balanced = runs[0]["balanced"]
    assert len(reference) == STEPS and reference[-1]["loss"] < reference[0]["loss"]
    assert_parity("ep4 balanced", _metrics(runs, "balanced"), reference, EP, fields=LOSS_FIELDS)
    assert all(r["balanced"]["placements"] == balanced["placements"] for r in runs), "ranks disagree on the placement"
    # the first full re-plan (after step 0) migrated, and the placement is no longer the contiguous one
    assert balanced["migrations"] >= 1
    assert any(d["migrate"] and not d["early"] for d in balanced["decisions"] if d["step"] == 0)
    assert any(p != contiguous_start() for p in balanced["placements"])
    assert balanced["metrics"][0]["migrated"] > 0  # the metrics row reports it
    # measured rows per EP rank: skewed at step 0 (contiguous), more even after the first migration ...
    before, after = _imbalance(balanced["rows"][:1]), _imbalance(balanced["rows"][1:])
    assert before.min() > 1.5, before
    assert after.max() < before.min() - 0.3, (before, after)
    # ... while the same steps' tokens would have stayed skewed on the contiguous table (the router's
    # bias does not move): the evening is the migration's
    contiguous = ExpertPlacement.contiguous(16, EP, 5)
    kept = np.array([[contiguous.apply_to_tokens_per_expert(layer) for layer in step]
                     for step in balanced["tokens_per_expert"][1:]]).sum(axis=1)  # [step, EP rank]
    assert _imbalance(kept).min() > 1.5, _imbalance(kept)


@pytest.mark.slow
@pytest.mark.dist
def test_the_ranks_split_the_solves_and_decide_as_each_would_alone(runs: list[dict]) -> None:
    """Each due solve runs on one EP rank and its result reaches all: every rank holds the same decisions (its
    peers' solve times included) and placements as when every rank runs every solve, and each solve ran once."""
    def untimed(decisions: list[dict]) -> list[dict]:
        return [{k: v for k, v in d.items() if k not in ("solve_ms", "solve_cpu_ms")} for d in decisions]

    split, alone = [r["balanced"] for r in runs], [r["every_rank_solves"] for r in runs]
    solves = len(split[0]["decisions"])
    assert solves >= EP  # full re-plans of every MoE layer after steps 0, 2 and 4
    assert all(r["decisions"] == split[0]["decisions"] for r in split)
    for ours, theirs in zip(split, alone):
        assert untimed(ours["decisions"]) == untimed(theirs["decisions"])
        assert ours["placements"] == theirs["placements"]
    assert sum(r["searched"] for r in split) == solves
    assert max(r["searched"] for r in split) == -(-solves // EP)  # round robin over the run: 30 solves, 8/8/7/7
    assert all(r["searched"] is None for r in alone)


@pytest.mark.slow
@pytest.mark.dist
def test_replicated_experts_train_like_the_single_process(runs: list[dict], reference: list[dict]) -> None:
    """Starting with hot experts replicated (their tokens split, gradients summed, norm counted once),
    then migrating away from that layout: still the single-process losses and gradient norms."""
    replicated, balanced = runs[0]["replicated"], runs[0]["balanced"]
    assert_parity("ep4 replicated start", _metrics(runs, "replicated"), reference, EP, fields=LOSS_FIELDS)
    assert replicated["migrations"] >= 1
    # step 0: rank 0 computes fewer rows than under the contiguous table (the balanced run's step 0),
    # the replica holders more: the replicas took a share
    assert replicated["rows"][0, 0] < balanced["rows"][0, 0]
    assert replicated["rows"][0, 1:].min() > balanced["rows"][0, 1:].max()


@pytest.mark.slow
@pytest.mark.dist
def test_compiled_layers_balance_without_a_graph_per_layer(runs: list[dict], reference: list[dict]) -> None:
    """The balancer's hooks (token counts, expert rows, weights landing after a migration) are the same for
    every MoE layer, so tiny-pangu's 7 compiled MoE layers share their graphs: hooks closing over a layer's
    index built a graph per layer, and the layers past Dynamo's recompile limit ran eager. The run counts
    what the eager one counts and migrates as it does."""
    traced, balanced = runs[0]["traced"], runs[0]["balanced"]
    assert_parity("ep4 balanced, traced layers", _metrics(runs, "traced"), reference, EP, fields=LOSS_FIELDS)
    assert traced["migrations"] == balanced["migrations"] >= 1
    assert np.array_equal(traced["rows"], balanced["rows"])
    assert all(np.array_equal(a, b) for a, b in zip(traced["tokens_per_expert"], balanced["tokens_per_expert"]))


@pytest.mark.slow
@pytest.mark.dist
def test_checkpoint_after_migration_resumes_and_loads_without_balancing(runs: list[dict],
                                                                        reference: list[dict]) -> None:
    """Saved after a migration: resumed with its placement, the run goes on exactly as the
    uninterrupted one; loaded under EP2 with the contiguous layout and no balancer, on the same curve."""
    balanced = runs[0]["balanced"]
    saved = runs[0]["saved_placement"]
    assert saved is not None
    assert any(layer["slot_expert"] != contiguous_start() for layer in saved["layers"].values())
    for rank_runs in runs:
        resumed = rank_runs["resumed"]
        assert "restored the saved expert placement" in resumed["log"]
        assert [r["step"] for r in resumed["metrics"]] == list(range(SAVE_AT + 1, STEPS + 1))
        for got, want in zip(resumed["metrics"], rank_runs["balanced"]["metrics"][SAVE_AT:]):
            for key in LOSS_FIELDS:
                assert got[key] == pytest.approx(want[key], rel=1e-6), f"step {got['step']} {key}"
        assert resumed["placements"] == balanced["placements"]
    assert_parity("ep2 from the balanced ep4 checkpoint", _metrics(runs, "ep2_from_balanced"), reference[SAVE_AT:],
                  EP, fields=LOSS_FIELDS)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", SHARDED)
def test_migration_with_sharded_experts_or_state_keeps_losses(runs: list[dict], reference: list[dict],
                                                              layout: str) -> None:
    run = runs[0][layout]
    assert run["migrations"] >= 1 and run["moved_slots"] >= 1
    assert_parity(f"{layout} balanced", _metrics(runs, layout), reference, EP, fields=LOSS_FIELDS)


@pytest.mark.slow
@pytest.mark.dist
def test_checkpoint_after_migration_under_etp_loads_without_it(runs: list[dict], reference: list[dict]) -> None:
    assert runs[0]["etp2"]["migrations"] >= 1
    assert_parity("ep2 from the balanced etp2 checkpoint", _metrics(runs, "ep2_from_etp2"), reference[SAVE_AT:], EP,
                  fields=LOSS_FIELDS)


def _replica_worker(rank: int, world_size: int) -> dict:
    """Flat and hierarchical dispatch of the same tokens with and without a replicated hot expert, and
    the single-process MoE (local dispatcher, all experts on this rank) on the rank's tokens."""
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
    routing = Routing(ids, weights, count_tokens_per_expert(ids, num_experts), torch.zeros(()))
    local = LocalDispatcher()
    tokens_PD, per_expert, meta = local.dispatch(x, routing)
    out = {"one_process": (local.combine(full(tokens_PD, per_expert), meta), per_expert)}
    cases = (("single", single, False), ("replicated", replicated, False), ("replicated_hier", replicated, True))
    for name, placement, hierarchical in cases:
        expert_table = ExpertTable.from_placement(placement)
        dispatcher = (HierarchicalDispatcher(group, intra, inter, expert_table) if hierarchical
                      else AllToAllDispatcher(group, expert_table))
        tokens_PD, per_slot, meta = dispatcher.dispatch(x, routing)
        out[name] = (dispatcher.combine(shard_experts(full, expert_table, rank)(tokens_PD, per_slot), meta),
                     per_slot)
    return out


@pytest.mark.dist
def test_replicated_experts_dispatch_same_outputs() -> None:
    results = spawn(_replica_worker, 4)
    for rank_out in results:
        # every expert-parallel dispatch gives what one process computes with all experts at hand
        for case in ("single", "replicated", "replicated_hier"):
            torch.testing.assert_close(rank_out[case][0], rank_out["one_process"][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rank_out["replicated_hier"][1], rank_out["replicated"][1])
    # the replicas share the hot experts' rows: rank 0 computes fewer rows, the replica holders more
    single_rows = [int(r["single"][1].sum()) for r in results]
    replicated_rows = [int(r["replicated"][1].sum()) for r in results]
    assert sum(single_rows) == sum(replicated_rows)
    assert replicated_rows[0] < single_rows[0]
    assert all(replicated_rows[rank] > single_rows[rank] for rank in (1, 2, 3))


class _EchoRule:
    """A rule whose search names the job it found, and fails on the job ``"bad"``."""

    def search(self, job: str) -> str:
        if job == "bad":
            raise UserError("no placement for this layer")
        return f"found {job}"


def _split_worker(rank: int, world_size: int) -> tuple[list[str], str | None, int]:
    searches = SplitSearches(dist.group.WORLD)
    first = searches(_EchoRule(), ["a", "b", "c"])
    raised = None
    try:
        searches(_EchoRule(), ["d", "bad"])
    except UserError as error:
        raised = str(error)
    return first, raised, searches.searched


@pytest.mark.dist
def test_split_searches_reach_every_rank_and_so_does_a_failure() -> None:
    """Round robin over the run: a, c then "bad" on rank 0; b then d on rank 1. Every rank gets every result,
    and the solve that fails on rank 0 fails on rank 1 too, instead of leaving it waiting at the gather."""
    results = spawn(_split_worker, 2)
    assert [r[0] for r in results] == [["found a", "found b", "found c"]] * 2
    assert [r[1] for r in results] == ["no placement for this layer"] * 2
    assert [r[2] for r in results] == [3, 2]


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
     "--balance-interval: Input should be greater than 0, got 0"),
    (["--nproc", "4", "--ep", "4", "--slots-per-rank", "5"],
     "run spec: balance: slots_per_rank (--slots-per-rank) tunes online balancing, which is off; add "
     "--online-balance (enabled: true) or drop it"),
    (["--nproc", "4", "--ep", "4", "--online-balance", "--zero", "2"],
     "--online-balance moves ZeRO-1 optimizer shards; it does not run with zero 2 yet: use zero 1"),
])
def test_online_balance_flag_is_refused_where_it_cannot_run(argv: list[str], message: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    from moetrain.cli import main

    monkeypatch.setattr("moetrain.distributed.launch.subprocess.call", lambda *a, **k: pytest.fail("started"))
    code = main(["train", *argv, "--synthetic-data", "--log-dir", str(tmp_path / "logs")])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"moetrain train: error: {message}"]
    assert not (tmp_path / "logs").exists()
