"""StaleSync, colocated (``moetrain.rl.colocated``): the next batch generates during each update. Held to
the disaggregated pipeline at k = 1 (the same schedule on other ranks) bit for bit, across ranks to the
one process, through a checkpoint to the uninterrupted run; the admission guard and the refusals."""

import copy
import dataclasses
import functools
import io
import json
import shutil

import pytest
import torch
from rich.console import Console
from test_rl_stalesync import COMPARED, _plain_stalesync, _setup, _stalesync

from moetrain.cli import main
from moetrain.config import ParallelConfig
from moetrain.config.run import RunSpec
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.world import spawn
from moetrain.rl.colocated import ColocatedStaleSync, fits_beside_update
from moetrain.rl.config import StaleSyncOptions
from moetrain.train.trainer import SuppliedParts, Trainer
from refusals import refused


def _colocated(steps: int, staleness: int = 1, decoupled: bool = False, spec_update: dict | None = None,
               hooks_cls=ColocatedStaleSync, micro_batch: int | None = None):
    """(the run's hooks, its rows, its final weights)."""
    model, options, spec = _setup(steps)
    if spec_update:
        spec = spec.model_copy(update={"run": spec.run.model_copy(update=spec_update)})
    if micro_batch:
        spec = spec.model_copy(update={"training": spec.training.model_copy(update={"micro_batch": micro_batch})})
    stale = StaleSyncOptions(staleness=staleness, placement="colocated", loss="decoupled" if decoupled else "tis")
    hooks = hooks_cls(spec, options, stale)
    trainer = Trainer(spec, SuppliedParts(model_cfg=model.cfg, model=model, console=Console(file=io.StringIO()),
                                          hooks=hooks))
    rows = trainer.train()
    return hooks, rows, {k: v.detach().clone() for k, v in trainer.run.stage.model.state_dict().items()}


def _plain_colocated(steps: int, decoupled: bool = False):
    """``_colocated(steps, decoupled=decoupled)`` at k = 1, nothing planted: a copy of the module's one run
    of these arguments (two tests read the same computation); the rows and weights copied, the hooks shared
    (the tests read their counters only)."""
    hooks, rows, state = _plain_colocated_once(steps, decoupled)
    return hooks, copy.deepcopy(rows), copy.deepcopy(state)


@functools.cache
def _plain_colocated_once(steps: int, decoupled: bool):
    return _colocated(steps, decoupled=decoupled)


def _steps(rows):
    return [r for r in rows if "loss" in r]


def _assert_same_run(rows, state, other_rows, other_state):
    for expected, got in zip(other_rows, rows, strict=True):
        assert {k: got.get(k) for k in COMPARED} == {k: expected.get(k) for k in COMPARED}
    assert state.keys() == other_state.keys()
    for name, value in other_state.items():
        assert torch.equal(value, state[name]), name


@pytest.mark.dist
@pytest.mark.parametrize("decoupled", [False, True], ids=["tis", "decoupled"])
def test_colocated_k1_is_the_disaggregated_pipeline_at_k1_bit_for_bit(decoupled):
    # both generate batch b with version max(0, b − 1): same samples, same losses, same weights
    steps = 4
    trainer, rows, state = _plain_colocated(steps, decoupled)
    rollout, disaggregated = _plain_stalesync(steps, staleness=1, decoupled=decoupled)
    assert rollout.versions == [0, 0, 1, 2]
    _assert_same_run(rows, state, disaggregated.rows, disaggregated.final_state)
    steps_rows = _steps(rows)
    assert [r["weight_version"] for r in steps_rows] == [0, 0, 1, 2]
    assert [r["staleness_max"] for r in steps_rows] == [0, 1, 1, 1]
    # step 1 generates its own batch; every later batch was generated during the update before it
    assert [r["overlapped"] for r in steps_rows] == [False, True, True, True]
    assert all("overlap_wait_s" in r for r in steps_rows[:-1]) and trainer.dropped_samples == 0


@pytest.mark.dist
def test_with_checkpoints_both_placements_keep_the_same_synchronisation_points(tmp_path):
    # a checkpoint after step 2: batch 2 is generated with the saved weights in both placements
    run = {"save_dir": str(tmp_path / "colocated"), "save_every": 2}
    _, rows, state = _colocated(4, spec_update=run)
    rollout, disaggregated = _stalesync(4, staleness=1, run_update={**run, "save_dir": str(tmp_path / "pipeline")})
    assert rollout.versions == [0, 0, 2, 2]
    _assert_same_run(rows, state, disaggregated.rows, disaggregated.final_state)


def test_a_larger_bound_runs_the_same_one_batch_ahead_schedule():
    # the devices that would generate two batches ahead are busy with the next one: k = 3 is k = 1
    _, rows1, state1 = _colocated(3, staleness=1)
    _, rows3, state3 = _colocated(3, staleness=3)
    _assert_same_run(rows3, state3, rows1, state1)


class _Tampered(ColocatedStaleSync):
    """Marks the batch generated ahead for step 2 as three versions old."""

    def rollout(self, trainer, step):
        if step == 2 and self._ready is not None:
            self._ready = dataclasses.replace(self._ready, weight_version=self._ready.weight_version - 3)
        return super().rollout(trainer, step)


def test_a_batch_older_than_k_is_dropped_counted_and_generated_again():
    _, rows, state = _colocated(4, hooks_cls=_Tampered)
    _, reference_rows, _ = _plain_colocated(4)
    steps = _steps(rows)
    assert [r["overlapped"] for r in steps] == [False, True, False, True]
    assert steps[2]["staleness_max"] == 0 and steps[2]["dropped_samples"] == 16 and steps[-1]["dropped_batches"] == 1
    # the regenerated batch is step 2's prompts with the current weights: not the tampered one's samples
    assert steps[2]["weight_version"] == 2 and _steps(reference_rows)[2]["weight_version"] == 1


def test_resumed_from_a_checkpoint_the_run_continues_the_uninterrupted_one_bit_for_bit(tmp_path):
    save = tmp_path / "ckpt"
    _, rows, state = _colocated(4, spec_update={"save_dir": str(save), "save_every": 2})
    # the batch after each checkpoint step is generated after the save, with the saved weights
    assert [r["overlapped"] for r in _steps(rows)] == [False, True, False, True]
    shutil.rmtree(save)
    _colocated(4, spec_update={"save_dir": str(save), "save_every": 2, "stop_at": 2})
    _, resumed, resumed_state = _colocated(4, spec_update={"save_dir": str(save), "save_every": 2, "resume": True})
    _assert_same_run(resumed, resumed_state, [r for r in rows if r["step"] > 2], state)


def _two_ranks(rank: int, world_size: int):
    model, options, spec = _setup(3)
    spec = RunSpec(training=spec.training.model_copy(update={"micro_batch": 4}), parallel={"dp": 2, "ep": 2},
                   run=spec.run)
    dims = ParallelDims.build(ParallelConfig(dp=2, ep=2), rank)
    stale = StaleSyncOptions(staleness=1, placement="colocated")
    trainer = Trainer(spec, SuppliedParts(dims=dims, model_cfg=model.cfg, model=model,
                                          console=Console(file=io.StringIO()),
                                          hooks=ColocatedStaleSync(spec, options, stale)))
    return trainer.train()


@pytest.mark.dist
def test_on_two_ranks_ep2_with_two_generation_replicas_it_is_the_one_process_run():
    _, expected, _ = _colocated(3, micro_batch=4)  # the micro-batches of each of the two ranks
    got = spawn(_two_ranks, 2)
    for rows in got:  # every rank logs the same row
        assert [r.get("overlapped") for r in _steps(rows)] == [False, True, True]
        for e, g in zip(expected, rows, strict=True):
            for key in ("reward", "accuracy", "completion_len", "weight_version", "heldout_accuracy"):
                assert g.get(key) == e.get(key), key  # same samples: sampling does not depend on the rank
            for key in ("loss", "grad_norm"):
                if key in e:
                    assert g[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), key


def test_generation_runs_beside_the_update_only_where_both_fit():
    gib = 2**30
    # 10 GiB free, 90 % usable: a 3 GiB cache beside a 6 GiB update fits, beside 6.5 GiB it does not
    assert fits_beside_update(3 * gib, 6 * gib, 10 * gib)
    assert not fits_beside_update(3 * gib, int(6.5 * gib), 10 * gib)


@pytest.mark.parametrize("argv, expected", [
    (["rl", "--staleness", "1", "--placement", "colocated", "--nproc", "2", "--gen-ep", "2"], ("--gen-ep 1",)),
    (["rl", "--staleness", "1", "--placement", "colocated", "--offload", "always"], ("--offload always",)),
])
def test_cli_refuses_what_cannot_overlap_in_one_line_exit_2(capsys, argv, expected):
    refused(capsys, argv, *expected)


@pytest.mark.slow
def test_cli_runs_the_colocated_pipeline_in_one_process(tmp_path, capsys):
    metrics = tmp_path / "rl.jsonl"
    argv = ["rl", "--sft-steps", "2", "--sft-batch", "8", "--steps", "3", "--prompts", "2", "--group-size", "2",
            "--eval-size", "4", "--device", "cpu", "--quiet", "--staleness", "2", "--placement", "colocated",
            "--metrics-out", str(metrics)]
    assert main(argv) == 0, capsys.readouterr().err
    steps = _steps([json.loads(line) for line in metrics.read_text().splitlines()])
    assert [r["weight_version"] for r in steps] == [0, 0, 1]
    assert [r["overlapped"] for r in steps] == [False, True, True]
