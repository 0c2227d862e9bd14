"""RL Fusion: the weight sync reshards training layouts into generation layouts bit for bit, refuses a lost
or damaged bucket, and the switch runs its phases in order; offload restores the optimizer bit for bit.

The 4-rank cases share one gloo world (``world`` fixture: one spawn for the module)."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console
from rl_models import small_model

from moetrain.config import ParallelConfig, TrainingConfig
from moetrain.config.run import RunSpec
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.step import build_layout
from moetrain.distributed.weight_sync import SyncFault, WeightSync, WeightSyncError
from moetrain.distributed.world import spawn
from moetrain.rl.config import FusionOptions, GRPOConfig, RLOptions
from moetrain.rl.fusion import generation_model, generation_views, global_shapes, training_views
from moetrain.rl.loop import GRPO
from moetrain.rl.offload import HostOffload, offload_decision
from moetrain.rl.sft import sequence_len_for
from moetrain.rl.switch import PHASES, Switch, SwitchOrderError
from moetrain.rl.tasks import get_task
from moetrain.train.trainer import SuppliedParts, Trainer

SEED = 3
"""The trained weights' seed; generation models start from seed 0, so an unsynced tensor shows."""
BUCKET_BYTES = 256 * 1024
TRAIN_LAYOUTS = {"tp2_ep2": ParallelConfig(tp=2, dp=2, ep=2), "pp2_ep2": ParallelConfig(pp=2, dp=2, ep=2),
                 "ep2_etp2": ParallelConfig(dp=4, ep=2, etp=2)}
PAIRS = [("tp2_ep2", 1), ("pp2_ep2", 1), ("pp2_ep2", 4), ("ep2_etp2", 1)]
"""(training layout, generation EP degree): gen_ep 1 is 4 data-parallel replicas, 4 is EP4."""


def _reference() -> dict[str, torch.Tensor]:
    return small_model(seed=SEED).state_dict()


def _generation_state(model, stage, ep_rank: int) -> dict[str, torch.Tensor]:
    """The generation tensors as single-process ones: whole, or (EP) keyed per expert held."""
    state = {name: value.clone() for name, value in model.state_dict().items()}
    if stage is None:
        return state
    held = stage.expert_table.experts_by_rank[ep_rank]
    out = {}
    for name, value in state.items():
        if ".moe.experts." in name:
            out.update({f"{name}#{expert}": value[slot].clone() for slot, expert in enumerate(held)})
        else:
            out[name] = value
    return out


def _sync_case(rank: int, world_size: int, dims: dict, train: str, gen_ep: int) -> dict:
    model = small_model(seed=SEED)
    cfg = TrainingConfig(steps=1, global_batch=8, micro_batch=2, seq_len=32, seed=SEED)
    run = build_layout(dims[train], model.cfg, cfg, torch.device("cpu"), model=model)
    shapes = global_shapes(model.cfg)
    gen, stage = generation_model(model.cfg, FusionOptions(gen_ep=gen_ep), rank, world_size, torch.device("cpu"))
    sync = WeightSync.plan(training_views(run, shapes), generation_views(gen, stage, shapes), BUCKET_BYTES)
    ep_rank = stage.dims.local_rank("ep") if stage is not None else 0
    before = _generation_state(gen, stage, ep_rank)
    first = sync.run(version=0)
    after_first = _generation_state(gen, stage, ep_rank)
    with torch.no_grad():  # a "training step": every trained tensor changes (elementwise, so layout-free)
        for value in run.stage.model.state_dict().values():
            value.mul_(2)
    second = sync.run(version=1)
    owned = all(item.owner == bucket.owner for bucket in sync.buckets for item in bucket.items)
    return {"before": before, "first": after_first, "second": _generation_state(gen, stage, ep_rank),
            "reports": (first, second), "owned": owned, "buckets": len(sync.buckets)}


def _fault_case(rank: int, dims: dict, fault_rank: int, kind: str) -> tuple[int, str]:
    """A sync with one bucket lost (``drop``) or damaged (``corrupt``) on ``fault_rank``: (bucket, error)."""
    model = small_model(seed=SEED)
    cfg = TrainingConfig(steps=1, global_batch=8, micro_batch=2, seq_len=32, seed=SEED)
    run = build_layout(dims["tp2_ep2"], model.cfg, cfg, torch.device("cpu"), model=model)
    shapes = global_shapes(model.cfg)
    gen, _ = generation_model(model.cfg, FusionOptions(), rank, 4, torch.device("cpu"))
    sync = WeightSync.plan(training_views(run, shapes), generation_views(gen, None, shapes), BUCKET_BYTES)
    received = [b.index for b in sync.buckets if fault_rank in b.receivers and not b.is_local]
    bucket = received[len(received) // 2]  # one that travels to the faulty rank
    sync.fault = SyncFault(rank=fault_rank, **{kind: bucket})
    try:
        sync.run(version=5)
    except WeightSyncError as exc:
        return bucket, str(exc)
    return bucket, "no error"


RL_STEPS = 2
TASK = get_task("addition")
RL_SEQ_LEN = -(-sequence_len_for(TASK, TASK.max_answer_chars + 2) // 2) * 2  # sequence parallelism: tp | seq_len
SAME = ("reward", "accuracy", "completion_len", "stopped_frac", "uniform_groups", "heldout_accuracy")
CLOSE = ("loss", "nll", "grad_norm", "logp_gap_mean", "is_weight_mean")


class _ParityScore:
    """The addition task scored by the parity of a completion's text length (ids outside the character set
    decode to nothing): an untrained policy never answers right, this gives its groups mixed rewards
    (non-zero advantages, a real policy gradient)."""

    def __init__(self, task) -> None:
        self.task = task

    def __getattr__(self, name: str):
        return getattr(self.task, name)

    def score(self, problem, completion: str) -> float:
        return float(len(completion) % 2 == 0)


def _rl_trainer(parallel: ParallelConfig, dims: ParallelDims | None = None,
                fusion: FusionOptions | None = None) -> Trainer:
    model = small_model(seed=SEED)
    options = RLOptions(task="addition", prompts_per_step=4, grpo=GRPOConfig(group_size=4), eval_every=0,
                        eval_size=8)
    cfg = TrainingConfig(steps=RL_STEPS, global_batch=16, micro_batch=4, seq_len=RL_SEQ_LEN, lr=1e-3,
                         warmup_steps=0, seed=SEED)
    spec = RunSpec(training=cfg, parallel=parallel.model_dump(exclude={"sp", "micro_batch"}),
                   run={"device": "cpu", "cluster": "cpu", "quiet": True, "threads": 1})
    hooks = GRPO(spec, options, fusion=fusion)
    hooks.task = _ParityScore(hooks.task)
    return Trainer(spec, SuppliedParts(dims=dims, model_cfg=model.cfg, model=model, console=Console(file=io.StringIO()),
                                       hooks=hooks))


def _worker(rank: int, world_size: int) -> dict:
    dims = {name: ParallelDims.build(parallel, rank) for name, parallel in TRAIN_LAYOUTS.items()}
    out: dict = {"sync": {pair: _sync_case(rank, world_size, dims, *pair) for pair in PAIRS}}
    out["drop"] = _fault_case(rank, dims, 1, "drop")
    out["corrupt"] = _fault_case(rank, dims, 2, "corrupt")
    trainer = _rl_trainer(TRAIN_LAYOUTS["tp2_ep2"], dims["tp2_ep2"], FusionOptions(offload="always", bucket_mib=0.5))
    out["rl"] = trainer.train()
    out["phases"] = [r.name for r in trainer.hooks.fusion.switch.records]
    try:  # the trained weights moved on (a step after the last sync): generating now is refused
        trainer.hooks.fusion.generate([[1, 2]] * 4, trainer.hooks.sampling, None, version=trainer.step + 1)
        out["missed"] = "no error"
    except WeightSyncError as exc:
        out["missed"] = str(exc)
    out["rl_gen_ep2"] = _rl_trainer(TRAIN_LAYOUTS["pp2_ep2"], dims["pp2_ep2"], FusionOptions(gen_ep=2)).train()
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return spawn(_worker, 4)


@pytest.mark.dist
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{t}_to_{'replicas' if e == 1 else f'ep{e}'}" for t, e in PAIRS])
def test_generation_weights_equal_the_trained_ones_bit_for_bit(world, pair):
    reference = _reference()
    for rank, result in enumerate(world):
        case = result["sync"][pair]
        for when, factor in (("first", 1), ("second", 2)):
            got = case[when]
            assert len(got) >= len(reference)
            for key, value in got.items():
                name, _, expert = key.partition("#")
                expected = reference[name][int(expert)] if expert else reference[name]
                assert torch.equal(value, expected * factor), f"rank {rank} {when} sync: {key} differs"
        changed = [k for k, v in case["before"].items() if not torch.equal(v, case["first"][k])]
        assert len(changed) > len(case["before"]) // 2, "the generation model did not start from other weights"
        first, second = case["reports"]
        assert first.version == 0 and second.version == 1 and case["owned"]
        assert first.checksums_verified == second.checksums_verified > 0


@pytest.mark.dist
def test_replicas_receive_every_byte_once_and_owners_share_the_sending(world):
    reference_bytes = sum(v.numel() * v.element_size() for v in _reference().values())
    reports = [result["sync"][("tp2_ep2", 1)]["reports"][0] for result in world]
    for report in reports:  # every rank holds the whole model after the sync
        assert report.bytes_received + report.bytes_local == reference_bytes
    sent = [r.bytes_sent for r in reports]
    assert all(s > 0 for s in sent) and max(sent) < 0.6 * sum(sent), sent


@pytest.mark.dist
def test_a_dropped_bucket_is_an_error_on_every_rank(world):
    bucket = world[1]["drop"][0]
    messages = [result["drop"][1] for result in world]
    assert f"bucket {bucket} from rank" in messages[1] and "not written at version 5" in messages[1], messages[1]
    assert all(m == f"weight sync failed on rank 1 (see its error): {messages[1].split(': ', 1)[1]}"
               for i, m in enumerate(messages) if i != 1), messages


@pytest.mark.dist
def test_a_damaged_bucket_fails_its_checksum(world):
    bucket, message = world[2]["corrupt"]
    assert all(result["corrupt"][1].startswith("weight sync failed on rank 2") for result in world)
    assert f"bucket {bucket} from rank" in message and "checksum" in message and "of the generation weights" in message


def test_switch_phases_run_in_order_and_refuse_another():
    switch = Switch(torch.device("cpu"))
    with pytest.raises(SwitchOrderError, match="'reshard' out of order: 'offload' comes next"), \
            switch.phase("reshard"):
        pass
    for name in PHASES:
        with switch.phase(name, skipped=name in ("offload", "restore")):
            pass
        if name == "reshard":
            with pytest.raises(SwitchOrderError, match="'restore' out of order: 'generate' comes next"), \
                    switch.phase("restore"):
                pass
    assert [r.name for r in switch.records] == list(PHASES)
    assert all(r.seconds >= 0 and r.peak_bytes > 0 for r in switch.records)
    row = switch.metrics()
    assert row["offloaded"] is False and set(f"switch_{p}_s" for p in PHASES) <= set(row)
    assert switch.expected == "offload"  # the next step's cycle


def test_offload_restores_optimizer_state_and_gradients_bit_for_bit():
    model = small_model().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randint(0, 100, (2, 8))).logits.float().pow(2).mean().backward()
        optimizer.step()
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    grads = {id(p): p.grad.clone() for p in model.parameters() if p.grad is not None}
    offload = HostOffload(optimizer, list(model.parameters()))
    moved = offload.offload()
    assert moved > 0 and all(p.grad is None for p in model.parameters())
    assert offload.restore(torch.device("cpu")) == moved
    for p, s in optimizer.state.items():
        assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())
    assert {id(p): p.grad for p in model.parameters() if p.grad is not None}.keys() == grads.keys()
    assert all(torch.equal(p.grad, grads[id(p)]) for p in model.parameters() if p.grad is not None)


def test_offload_is_skipped_when_generation_fits():
    cuda = torch.device("cuda")
    assert not offload_decision("auto", torch.device("cpu"), 10**15).offload
    assert not offload_decision("auto", cuda, 2**30, free_bytes=8 * 2**30).offload
    assert offload_decision("auto", cuda, 8 * 2**30, free_bytes=2**30).offload
    assert offload_decision("always", torch.device("cpu"), 0).offload
    assert not offload_decision("never", cuda, 8 * 2**30, free_bytes=0).offload


@pytest.fixture(scope="module")
def single_process_rl() -> list[dict]:
    return _rl_trainer(ParallelConfig()).train()


@pytest.mark.dist
@pytest.mark.parametrize("case", ["rl", "rl_gen_ep2"])
def test_the_4_rank_rl_step_follows_the_one_process_step(world, single_process_rl, case):
    """TP2×EP2 training, 4 generation replicas, optimizer offloaded and restored around every generation
    (``rl``), or PP2×EP2 training and 2 EP2 generation groups (``rl_gen_ep2``): the same samples
    (per-sample generators) and the same losses as the one-process trainer."""
    single, fused = single_process_rl, world[0][case]
    assert [r["step"] for r in fused] == [r["step"] for r in single] == list(range(RL_STEPS + 1))
    assert 0 < single[-1]["reward"] < 1 and single[-1]["uniform_groups"] < 1  # a real policy gradient
    for got, expected in zip(fused, single, strict=True):
        assert {k: got.get(k) for k in SAME} == {k: expected.get(k) for k in SAME}, got["step"]
        for key in CLOSE:
            if key in expected:
                assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), (key, got["step"])
    for row in fused[1:]:
        assert row["offloaded"] is (case == "rl") and row["sync_checksums_verified"] > 0 and row["sync_mib"] > 0
        assert row["switch_s"] >= row["switch_reshard_s"] > 0 and row["weight_version"] == row["step"] - 1
    assert world[1]["phases"] == ["offload", "reshard", "generate", "free", "restore"]


@pytest.mark.dist
def test_generating_on_weights_that_missed_a_sync_is_refused(world):
    assert world[3]["missed"] == (f"generation weights are at version {RL_STEPS}, training at {RL_STEPS + 1}: "
                                  "a sync was missed")
