"""StaleSync beyond two ranks: rollout replicas and a trainer group in its own layout (``roles``), the
weight sync from the trainer's layout to every replica, partial rollouts, and the spec and CLI that
size the run.

Each run here is a few steps of a 4-layer tiny-pangu on 3 or 4 gloo ranks."""

import copy
import functools
import io
import shutil
from dataclasses import replace

import pytest
import torch
from rich.console import Console
from rl_models import small_model
from test_rl_stalesync import COMPARED, SEQ_LEN, _setup, _synchronous

from moetrain.config import ParallelConfig
from moetrain.config.run import RunSpec
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.weight_sync import SyncFault
from moetrain.distributed.world import spawn
from moetrain.models.transformer import build_model
from moetrain.rl import stalesync
from moetrain.rl.admission import StalenessGate
from moetrain.rl.config import StaleSyncOptions
from moetrain.rl.generate import RolloutEngine
from moetrain.rl.loop import GRPO
from moetrain.rl.partial_rollout import generate_with_resume, interrupt_point
from moetrain.rl.roles import Roles
from moetrain.rl.spec import resolve_rl_spec
from moetrain.rl.stalesync import RolloutWorker, Schedule, StaleSyncJob, run_stalesync
from moetrain.rl.tokenizer import CharTokenizer
from moetrain.train.trainer import SuppliedParts, Trainer
from refusals import refused

TP2 = {"tp": 2}
EP2 = {"dp": 2, "ep": 2}
DP2 = {"dp": 2}


def _layout_spec(steps: int, parallel: dict) -> RunSpec:
    _, _, spec = _setup(steps)
    seq_len = -(-SEQ_LEN // 2) * 2  # a multiple of tp
    return RunSpec(training=spec.training.model_copy(update={"seq_len": seq_len}), parallel=parallel, run=spec.run)


def _synchronous_in_layout(rank: int, world_size: int, steps: int, parallel: dict, kl: float = 0.0):
    """The synchronous loop in the trainer's layout (RL Fusion: each rank generates its share); with ``kl``,
    a KL term against the starting weights."""
    model, options, _ = _setup(steps)
    reference = None
    if kl:
        options = options.model_copy(update={"grpo": options.grpo.model_copy(update={"kl_coef": kl})})
        reference = build_model(model.cfg, "cpu")
        reference.load_state_dict(model.state_dict())
    spec = _layout_spec(steps, parallel)
    dims = ParallelDims.build(ParallelConfig(**parallel), rank)
    hooks = GRPO(spec, options, reference=reference)
    trainer = Trainer(spec, SuppliedParts(dims=dims, model_cfg=model.cfg, model=model,
                                          console=Console(file=io.StringIO()), hooks=hooks))
    samples = []
    original = hooks.rollout

    def recording(trainer, step):
        rollouts = original(trainer, step)
        samples.append(rollouts.generation.tokens_BN.clone())
        return rollouts

    hooks.rollout = recording
    rows = trainer.train()
    state = {k: v.detach().clone() for k, v in trainer.run.stage.model.state_dict().items()}
    return rows, samples, state


def _synchronous_in_layout_rows(steps: int, parallel: dict) -> list:
    """``spawn(_synchronous_in_layout, 2, steps, parallel)``: a copy of the module's one run of these arguments
    (the tests of one-rank and of two-rank replicas compare with the same loop)."""
    return copy.deepcopy(_synchronous_in_layout_once(steps, tuple(sorted(parallel.items()))))


@functools.cache
def _synchronous_in_layout_once(steps: int, parallel: tuple) -> list:
    return spawn(_synchronous_in_layout, 2, steps, dict(parallel))


def _job(steps: int, staleness: int, parallel: dict | None, replicas: int, partial: bool = False,
         ranks_per_replica: int = 1, **hooks):
    model, options, spec = _setup(steps)
    if parallel:
        spec = _layout_spec(steps, parallel)
    stale = StaleSyncOptions(staleness=staleness, partial_rollouts=partial)
    return StaleSyncJob(spec, options, stale, model.cfg, model.state_dict(), replicas=replicas,
                        ranks_per_replica=ranks_per_replica, **hooks)


def _run(job: StaleSyncJob):
    """(every rollout rank's report, every trainer rank's)."""
    reports = spawn(run_stalesync, job.roles.world_size, job)
    rollout = job.roles.rollout_ranks
    return reports[:rollout], reports[rollout:]


def _trainers_weights(trainers, version: int) -> dict[str, torch.Tensor]:
    """The whole model of ``version``, assembled from the slices each trainer rank held when it pushed; every
    element covered."""
    shapes = {name: value.shape for name, value in small_model().state_dict().items()}
    whole = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
    for trainer in trainers:
        for name, offsets, piece in trainer.pushed_slices[version]:
            whole[name][tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))] = piece
    assert not any(bool(value.isnan().any()) for value in whole.values()), version
    return whole


def _assert_replicas_hold_the_trainers_weights(replicas, trainers, pushed: list[int]):
    """After every sync, each rollout rank's weights are the trainer group's slices it holds, bit for bit:
    a one-rank replica the whole model, a rank of a replica of G ranks its experts and the dense tensors."""
    dense = {name for name in small_model().state_dict() if ".moe.experts." not in f".{name}"}
    for version in pushed:
        whole = _trainers_weights(trainers, version)
        for replica in replicas:
            held = replica.synced_pieces[version]
            assert dense <= {name for name, _, _ in held}, version  # every dense tensor, whole
            for name, offsets, piece in held:
                box = tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))
                if name in dense:
                    assert piece.shape == whole[name].shape, name
                assert torch.equal(whole[name][box], piece), (version, name, offsets)


def _experts_held(report, version: int) -> dict[str, set[int]]:
    """Expert indices a rollout rank holds, per expert tensor (the first offset of each piece)."""
    held: dict[str, set[int]] = {}
    for name, offsets, piece in report.synced_pieces[version]:
        if ".moe.experts." in f".{name}":
            held.setdefault(name, set()).update(range(offsets[0], offsets[0] + piece.shape[0]))
    return held


def _share_bytes(ranks_per_replica: int, state: dict[str, torch.Tensor] | None = None) -> int:
    """A rollout rank's share of the weights (``state``: the tests' small model's), computed here: dense
    tensors whole, 1/G of every expert tensor."""
    state = state if state is not None else small_model().state_dict()
    return sum(v.numel() * v.element_size() // (ranks_per_replica if ".moe.experts." in f".{k}" else 1)
               for k, v in state.items())


def _assert_bytes_are_each_ranks_share(replicas, trainers, ranks_per_replica: int = 1):
    """Each rollout rank receives its share of the weights per sync (within 10 %: exactly, here); the
    trainer ranks share the sending, each within 10 % of an even split."""
    share = _share_bytes(ranks_per_replica)
    for replica in replicas:
        assert replica.ideal_sync_bytes == share
        assert all(abs(sync.bytes_received - share) <= 0.1 * share for sync in replica.syncs)
        assert all(sync.bytes_received == share for sync in replica.syncs)
    if len(trainers) == 1 and len(replicas) == ranks_per_replica:
        # one trainer rank, one replica: a bucket every rollout rank needs is one broadcast, an expert goes
        # to its one holder, so the whole model is sent once
        ideal_sent = _share_bytes(1)
    else:  # one-rank replicas beside one trainer rank: broadcasts; else point to point, once per receiver
        copies = 1 if len(trainers) == 1 and ranks_per_replica == 1 else len(replicas)
        ideal_sent = copies * share / len(trainers)
    for trainer in trainers:
        for push in trainer.push_reports:
            assert abs(push.bytes_sent - ideal_sent) <= 0.1 * ideal_sent, (push.bytes_sent, ideal_sent)
    row = next(r for r in trainers[0].rows if "sync_received_mib" in r)
    assert row["sync_received_mib"] == [share / 2**20] * len(replicas)
    assert row["sync_replica_share_mib"] == share / 2**20


@pytest.mark.dist
@pytest.mark.parametrize("parallel", [TP2, EP2], ids=["tp2", "ep2"])
def test_k0_with_two_replicas_and_a_two_rank_trainer_is_the_synchronous_loop_bit_for_bit(parallel):
    """Bit for bit against the synchronous loop in the trainer's layout (RL Fusion on its ranks); against
    the one-process loop the samples are bit for bit too, the losses equal to the layout's rounding."""
    steps = 2  # the steps of the next test: both read the same runs of the synchronous loop
    expected = _synchronous_in_layout_rows(steps, parallel)
    replicas, trainers = _run(_job(steps, 0, parallel, replicas=2, record_weights=True))
    assert [r.versions for r in replicas] == [[0, 1]] * 2
    for (rows, samples, state), trainer in zip(expected, trainers, strict=True):
        assert trainer.trained == [(0, 0), (1, 1)]
        for want, got in zip(samples, trainer.samples, strict=True):
            assert torch.equal(want, got)  # same samples
        for want, got in zip(rows, trainer.rows, strict=True):
            assert {k: got.get(k) for k in COMPARED} == {k: want.get(k) for k in COMPARED}  # same losses
        assert state.keys() == trainer.final_state.keys()
        for name, value in state.items():
            assert torch.equal(value, trainer.final_state[name]), name  # same weights, shard by shard
    _assert_replicas_hold_the_trainers_weights(replicas, trainers, [0, 1])
    _assert_bytes_are_each_ranks_share(replicas, trainers)
    # against one process: the same samples bit for bit; the losses differ by the layout's reductions only
    one_rows, one_samples, _ = _synchronous(steps)
    assert all(torch.equal(a, b) for a, b in zip(one_samples, trainers[0].samples, strict=True))
    for want, got in zip(one_rows, trainers[0].rows, strict=True):
        if "loss" in want:
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)


BEHAVIOUR = ("is_weight_mean", "logp_gap_max")
"""Fields of the rollout log-probs μ: an EP2 replica sums its experts' outputs in another order than a
whole model does, so μ (not the samples) differs in the last bits, as under RL Fusion's EP generation."""
EXACT = tuple(k for k in COMPARED if k not in BEHAVIOUR)


@pytest.mark.dist
@pytest.mark.parametrize("parallel", [TP2, pytest.param(EP2, marks=pytest.mark.slow)], ids=["tp2", "ep2"])
def test_k0_with_two_replicas_of_two_ep_ranks_beside_a_two_rank_trainer_is_the_synchronous_loop(parallel):
    """Replicas of 2 ranks (EP2: 8 of the 16 experts each, the dense tensors whole) beside a TP2 (or EP2) trainer:
    the samples of the one-process loop bit for bit, the losses and weights of that layout's loop bit for bit
    (the rollout log-probs' statistics to EP's rounding; the one process's losses to the layout's); every
    rank holds its experts, synced from the trainer's slices."""
    steps = 2
    expected = _synchronous_in_layout_rows(steps, parallel)
    replicas, trainers = _run(_job(steps, 0, parallel, replicas=2, ranks_per_replica=2, record_weights=True))
    assert len(replicas) == 4 and [r.versions for r in replicas] == [[0, 1]] * 4
    one_rows, one_samples, _ = _synchronous(steps)
    for (rows, _, state), trainer in zip(expected, trainers, strict=True):
        assert trainer.trained == [(0, 0), (1, 1)]
        assert all(torch.equal(a, b) for a, b in zip(one_samples, trainer.samples, strict=True))  # same samples
        for want, got in zip(rows, trainer.rows, strict=True):
            assert {k: got.get(k) for k in EXACT} == {k: want.get(k) for k in EXACT}  # same losses
            if "is_weight_mean" in want:
                assert got["is_weight_mean"] == pytest.approx(want["is_weight_mean"], rel=1e-6)
            if "logp_gap_max" in want:  # a gap of rounding: both below 1e-5
                assert max(got["logp_gap_max"], want["logp_gap_max"]) < 1e-5
        for name, value in state.items():
            assert torch.equal(value, trainer.final_state[name]), name
    for want, got in zip(one_rows, trainers[0].rows, strict=True):
        if "loss" in want:
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    for version in (0, 1):
        held = [_experts_held(r, version) for r in replicas]
        for first, second in (held[0:2], held[2:4]):  # each replica's two ranks: the 16 experts, 8 each
            assert first.keys() == second.keys() and len(first) > 0
            for name in first:
                assert len(first[name]) == len(second[name]) == 8 and first[name] | second[name] == set(range(16))
        assert held[0] == held[2] and held[1] == held[3]  # the same layout in every replica
    _assert_replicas_hold_the_trainers_weights(replicas, trainers, [0, 1])
    _assert_bytes_are_each_ranks_share(replicas, trainers, ranks_per_replica=2)


@pytest.mark.dist
def test_k1_one_replica_of_two_ep_ranks_beside_one_trainer_rank_holds_its_experts_after_every_sync():
    replicas, trainers = _run(_job(3, 1, None, replicas=1, ranks_per_replica=2, record_weights=True))
    assert [r.versions for r in replicas] == [[0, 0, 1]] * 2 and trainers[0].trained == [(0, 0), (1, 0), (2, 1)]
    held = [_experts_held(r, 1) for r in replicas]
    assert all(a | b == set(range(16)) and not a & b for a, b in zip(held[0].values(), held[1].values()))
    _assert_replicas_hold_the_trainers_weights(replicas, trainers, [0, 1])
    _assert_bytes_are_each_ranks_share(replicas, trainers, ranks_per_replica=2)
    row = next(r for r in trainers[0].rows if "sync_received_mib" in r)
    assert row["sync_sent_mib"] == [_share_bytes(1) / 2**20]


@pytest.mark.dist
def test_a_skipped_bucket_on_a_rank_of_a_two_rank_replica_is_one_error_naming_the_replica_and_rank(
        fault_at_receive):
    fault_at_receive(1, 1, lambda worker: SyncFault(rank=1, drop=worker.sync.buckets[-1].index))
    with pytest.raises(Exception, match=r"StaleSync rollout replica 0 \(rank 1\) failed: WeightSyncError: .*bucket "
                                        r"\d+ .*not written at version 1"):
        _run(_job(2, 0, None, replicas=1, ranks_per_replica=2))


@pytest.mark.slow
@pytest.mark.dist
def test_resumed_from_a_checkpoint_two_replicas_and_a_tp2_trainer_continue_the_uninterrupted_run(tmp_path):
    def job(**run):
        plain = _job(4, 2, TP2, replicas=2)
        return replace(plain, spec=plain.spec.model_copy(update={"run": plain.spec.run.model_copy(update=run)}))

    save = tmp_path / "ckpt"
    replicas, full = _run(job(save_dir=str(save), save_every=2))
    assert [r.versions for r in replicas] == [[0, 0, 2, 2]] * 2  # the batch after a checkpoint: its weights
    shutil.rmtree(save)
    _run(job(save_dir=str(save), save_every=2, stop_at=2))
    replicas, resumed = _run(job(save_dir=str(save), save_every=2, resume=True))
    assert [r.versions for r in replicas] == [[2, 2]] * 2
    for whole, part in zip(full, resumed, strict=True):  # each trainer rank
        assert part.trained == [(2, 2), (3, 2)]
        for want, got in zip([r for r in whole.rows if r["step"] > 2], part.rows, strict=True):
            assert {k: got.get(k) for k in COMPARED} == {k: want.get(k) for k in COMPARED}
        for name, value in whole.final_state.items():
            assert torch.equal(value, part.final_state[name]), name


@pytest.mark.dist
def test_k2_two_replicas_drop_a_batch_exactly_k_plus_1_old_and_train_none_older():
    # batch 0 sent again by both replicas after batch 2: it reaches the trainer at version 3 = k + 1
    replicas, trainers = _run(_job(5, 2, None, replicas=2, resend_first_after=2, record_weights=True))
    (trainer,) = trainers
    assert trainer.dropped_batches == 1 and trainer.dropped_samples == 16  # both replicas' shares, as one batch
    assert trainer.trained == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 2)]
    steps = [r for r in trainer.rows if "loss" in r]
    assert [r["staleness_max"] for r in steps] == [0, 1, 2, 2, 2]
    assert trainer.admission.staleness_counts[-1] > 0 and len(trainer.admission.staleness_counts) == 3
    _assert_replicas_hold_the_trainers_weights(replicas, trainers, [0, 1, 2])
    _assert_bytes_are_each_ranks_share(replicas, trainers)


@pytest.mark.dist
def test_k2_with_partial_rollouts_tokens_span_two_versions_and_none_is_older_than_k():
    replicas, trainers = _run(_job(5, 2, DP2, replicas=1, partial=True, record_weights=True))
    # batch b starts on version b − 2 and is resumed on b − 1 (batch 0 and 1 start on 0, resume on 0 / 1)
    assert Schedule(2, 5, partial=True).pushed() == [1, 2, 3]
    assert [Schedule(2, 5, partial=True).resume_version(b) for b in range(5)] == [None, None, 1, 2, 3]
    for trainer in trainers:
        steps = [r for r in trainer.rows if "loss" in r]
        assert [r["staleness_max"] for r in steps] == [0, 1, 2, 2, 2]  # by the oldest token
        # batches 2-4 were resumed one version later: their newest tokens are 1 version old
        assert [r.get("newest_token_version") for r in steps[2:]] == [1, 2, 3]
        assert trainer.admission.run_staleness_max <= 2 and trainer.dropped_batches == 0
    _assert_replicas_hold_the_trainers_weights(replicas, trainers, [0, 1, 2, 3])
    _assert_bytes_are_each_ranks_share(replicas, trainers)


def test_a_partial_rollout_resumes_on_the_new_weights_and_is_judged_by_its_oldest_token():
    model = small_model()
    tokenizer = CharTokenizer()
    engine = RolloutEngine(model, tokenizer.pad_id, tokenizer.decode)
    from moetrain.rl.stalesync import sampling_params

    params = sampling_params(_setup(1)[1], 8, eos_id=-1)  # no stop id: every sample runs to its budget
    prompts = [[5, 6, 7], [8, 9]]
    generators = lambda: [torch.Generator().manual_seed(i) for i in range(2)]
    whole = engine.generate(prompts, params, generators(), weight_version=3)
    newer = small_model(seed=1).state_dict()

    def resume():
        model.load_state_dict(newer)
        return 4

    partial = generate_with_resume(engine, prompts, params, generators(), 3, resume)
    half = interrupt_point(8)
    assert partial.token_versions_BN.tolist() == [[3] * half + [4] * (8 - half)] * 2
    assert torch.equal(partial.tokens_BN[:, :half], whole.tokens_BN[:, :half])  # the first part: the old weights
    assert partial.sample_versions == [3, 3] and partial.weight_version == 3
    # the oldest token decides: at version 6, k = 2, these samples are 3 versions old
    gate = StalenessGate(2)
    assert not gate.admit(6, partial.sample_versions) and gate.admit(5, partial.sample_versions)


@pytest.mark.dist
def test_a_skipped_bucket_on_a_replica_is_one_error_naming_the_replica_and_the_bucket(fault_at_receive):
    fault_at_receive(1, 1, lambda worker: SyncFault(rank=1, drop=0))  # replica 1 is rank 1: one rank each
    with pytest.raises(Exception, match=r"StaleSync rollout replica 1 \(rank 1\) failed: WeightSyncError: .*bucket 0 "
                                        r".*not written at version 1"):
        _run(_job(3, 0, None, replicas=2))


@pytest.mark.dist
def test_a_lost_replica_is_one_error_naming_it(monkeypatch):
    import os

    def vanish(self, batch, *rest):
        if batch == 1 and self.replica == 1:
            os._exit(0)  # gone without a word: its peers must name it
        return original(self, batch, *rest)

    original = RolloutWorker.generate
    monkeypatch.setattr(RolloutWorker, "generate", vanish)
    monkeypatch.setattr(stalesync, "PEER_GRACE_S", 0.2)
    with pytest.raises(Exception, match=r"StaleSync rollout replica 1 \(rank 1\) died: the trainer \(rank 2\) lost it"):
        _run(_job(3, 0, None, replicas=2))


def test_roles_place_replicas_then_the_trainer_group():
    roles = Roles(replicas=3, trainer_ranks=4)
    assert list(roles.replica_ranks) == [0, 1, 2] and list(roles.trainer_group) == [3, 4, 5, 6]
    assert roles.world_size == 7 and roles.next_rank("rollout worker") == 3
    assert [roles.stage(r) for r in (0, 2, 3, 6)] == ["rollout worker", "rollout worker", "trainer", "trainer"]
    assert roles.worker_name(2) == "StaleSync rollout replica 2 (rank 2)"
    assert roles.worker_name(5) == "StaleSync trainer (rank 5)"


def test_roles_place_replicas_of_several_ranks_then_the_trainer_group():
    roles = Roles(replicas=2, trainer_ranks=2, ranks_per_replica=3)
    assert list(roles.replica_ranks) == [0, 1, 2, 3, 4, 5] and list(roles.replica_leaders) == [0, 3]
    assert list(roles.trainer_group) == [6, 7] and roles.world_size == 8 and roles.first_trainer == 6
    assert [roles.replica_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert roles.worker_name(4) == "StaleSync rollout replica 1 (rank 4)"
    assert Roles(ranks_per_replica=2).worker_name(1) == "StaleSync rollout replica 0 (rank 1)"
    stages = Roles(reward=True, reference=True, replicas=2, trainer_ranks=2, ranks_per_replica=2)
    assert [stages.rank(s) for s in stages.order] == [0, 6, 7, 4] and stages.world_size == 8
    assert stages.next_rank("rollout worker") == 6 and stages.next_rank("reference worker") == 4
    assert stages.worker_name(7) == "StaleSync reference worker (rank 7)"


def test_the_first_console_line_names_each_group_its_ranks_and_the_replica_layout():
    assert Roles().describe() == "rollout worker (rank 0) → trainer (rank 1)"
    assert (Roles(replicas=2, trainer_ranks=2, ranks_per_replica=2, replica_tp=2).describe()
            == "2 rollout replicas of 2 TP ranks (ranks 0–3) → trainer (ranks 4–5)")
    assert (Roles(reward=True, reference=True, replicas=2, trainer_ranks=2, ranks_per_replica=2).describe()
            == "2 rollout replicas of 2 EP ranks (ranks 0–3) → reward worker (rank 6) → reference worker (rank 7)"
               " → trainer (ranks 4–5)")
    assert Roles(replicas=3).describe() == "3 rollout replicas (ranks 0–2) → trainer (rank 3)"


def test_nproc_counts_the_replicas_ranks_per_replica():
    spec = resolve_rl_spec([{"stalesync": {"staleness": 1}, "rollout": {"replicas": 2}, "generation": {"gen_ep": 2},
                             "trainer": {"parallel": {"tp": 2}}}], ["flags"], world_size=6)
    assert spec.rollout.ranks_per_replica == 2 and spec.trainer.world_size == 2
    assert spec.roles.world_size == 6 and list(spec.roles.trainer_group) == [4, 5]
    by_pool = resolve_rl_spec([{"stalesync": {"staleness": 1}, "rollout": {"ranks_per_replica": 4}}], ["rl.yaml"],
                              world_size=5)
    assert by_pool.generation.gen_ep == 4 and by_pool.roles.replica_leaders == range(0, 4, 4)


def test_nproc_is_the_replicas_ranks_and_the_trainers_layout():
    spec = resolve_rl_spec([{"stalesync": {"staleness": 1}, "rollout": {"replicas": 2},
                             "trainer": {"parallel": {"tp": 2}}}], ["flags"], world_size=6)
    assert spec.trainer.parallel.dp == 2 and spec.trainer.world_size == 4
    assert spec.roles.world_size == 6 and list(spec.roles.trainer_group) == [2, 3, 4, 5]


@pytest.mark.parametrize("argv, expected", [
    (["--nproc", "2", "--rollout-replicas", "2"], ("leaves no trainer rank",)),
    (["--rollout-replicas", "3"], ("rollout.replicas 3", "do not split")),
    (["--nproc", "4", "--gen-ep", "3"], ("rollout.ranks_per_replica 3: tiny-pangu's 16 experts do not split",)),
    (["--nproc", "4", "--rollout-replicas", "2", "--gen-ep", "2"], ("leaves no trainer rank",)),
    (["--nproc", "3", "--rollout-replicas", "2", "--kl-coef", "0.1"], ("leaves no trainer rank",)),
    (["--nproc", "5", "--rollout-replicas", "2", "--tp", "2"], ("not a multiple of tp",)),
    (["--partial-rollouts", "--placement", "colocated"], ("--partial-rollouts",)),
    (["--staleness", "-2"], ("--staleness -2",)),
])
def test_cli_refuses_a_pool_that_cannot_run_in_one_line_exit_2(capsys, argv, expected):
    base = ["rl", "--prompts", "4"] + ([] if "--staleness" in argv else ["--staleness", "1"])
    refused(capsys, [*base, *argv], *expected)


@pytest.mark.slow
def test_cli_runs_two_replicas_of_two_ep_ranks_beside_a_tp2_trainer(tmp_path, capsys):
    """One launch for both of the CLI's pool axes: replicas beside a TP2 trainer group, and EP ranks inside
    a replica (replicas of one rank through the CLI: test_rl_nodes' one-node run)."""
    steps = _cli_steps(tmp_path, capsys, "--nproc", "6", "--rollout-replicas", "2", "--gen-ep", "2", "--tp", "2")
    assert [r["weight_version"] for r in steps] == [0, 0, 1] and [r["staleness_max"] for r in steps] == [0, 1, 1]
    pushed = [r for r in steps if "sync_received_mib" in r]
    # each of a replica's two ranks receives its half of the experts and the dense tensors
    from moetrain.config import load_model_config
    from moetrain.models.transformer import build_model
    from moetrain.rl.loop import policy_config

    share = _share_bytes(2, build_model(policy_config(load_model_config("tiny-pangu")), "meta").state_dict())
    assert pushed and all(r["sync_received_mib"] == [share / 2**20] * 4 for r in pushed)
    assert all(r["sync_replica_share_mib"] == share / 2**20 for r in pushed)


def _cli_steps(tmp_path, capsys, *flags: str) -> list[dict]:
    """The step rows of ``moetrain rl`` (tiny, k = 1, one torch thread a rank) with ``flags``; exit 0 asserted.
    The launcher builds, checks and writes the spec as ever; its ranks are forked from this process, each
    reading the spec file back (``forked_ranks``): a torchrun start costs about 5 CPU-seconds a rank, and
    torchrun starting this pipeline's ranks stays under test in test_rl_nodes.py and test_rl_restart.py."""
    import json

    from test_rl_stalesync import TINY

    from forked_ranks import forked_rl_ranks
    from moetrain.cli import main

    metrics = tmp_path / "rl.jsonl"
    argv = ["rl", *TINY, "--staleness", "1", "--threads", "1", *flags, "--metrics-out", str(metrics),
            "--log-dir", str(tmp_path / "log")]
    with forked_rl_ranks():
        assert main(argv) == 0, capsys.readouterr().err
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
