"""DCP checkpoints reshard: a run stopped under one layout (``stop_at``, or the single-process run) and
resumed under another continues the uninterrupted single-process curve (per-step loss, its parts and the
gradient norm within 1e-4), on the loop and step ``moetrain train`` runs and the real data pipeline; a
checkpoint written by a parallel layout resumes in the single process, where it loads the single-process
checkpoint's weights and AdamW moments."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _parity import (
    LOSS_FIELDS,
    assert_parity,
    losses_by_layout,
    run_spec,
    single_process_rows,
    train_rows,
)
from rich.console import Console

from moetrain.config import ParallelConfig, TrainingConfig
from moetrain.distributed.checkpoint import load_checkpoint
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.world import spawn
from moetrain.runtime_base.checkpoint_files import checkpoint_dir
from moetrain.train import SuppliedParts, Trainer

STEPS, SAVED_AT = 4, 2
TRAINING = TrainingConfig(steps=STEPS, global_batch=8, micro_batch=2, seq_len=32, warmup_steps=2)
SAVE_LAYOUT = ParallelConfig(tp=2, sp=True, dp=2, ep=2)
"""Stops after ``SAVED_AT`` steps (``stop_at``), saving."""
LOAD_LAYOUTS = {
    "pp2_ep2_overlap": ParallelConfig(pp=2, dp=2, ep=2, overlap=True),
    "ep4_from_single_process": ParallelConfig(dp=4, ep=4),
}
"""Resumed from the TP2×EP2 checkpoint, or from the single-process run's (``_from_single_process``)."""


def _worker(rank: int, world_size: int, data: Path, root: Path) -> dict[str, list[dict]]:
    dims = {name: ParallelDims.build(parallel, rank) for name, parallel in
            [("save", SAVE_LAYOUT), *LOAD_LAYOUTS.items()]}
    rows = {"tp2_ep2_save": train_rows(run_spec(TRAINING, SAVE_LAYOUT, data, save_dir=str(root / "parallel"),
                                                stop_at=SAVED_AT), dims["save"])}
    if rank == 0:  # each resumed run reads (and writes) a folder of its own
        for name in LOAD_LAYOUTS:
            source = "single" if name.endswith("single_process") else "parallel"
            shutil.copytree(checkpoint_dir(root / source, SAVED_AT), checkpoint_dir(root / name, SAVED_AT))
        shutil.copytree(checkpoint_dir(root / "parallel", SAVED_AT), checkpoint_dir(root / "to_single", SAVED_AT))
    dist.barrier()
    for name, parallel in LOAD_LAYOUTS.items():
        rows[name] = train_rows(run_spec(TRAINING, parallel, data, save_dir=str(root / name), resume=True), dims[name])
    return rows


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("checkpoints")
    # The uninterrupted single-process run, saving after SAVED_AT steps on its way (and at the end).
    reference = single_process_rows(run_spec(TRAINING, ParallelConfig(), corpus, save_dir=str(root / "single"),
                                             save_every=SAVED_AT))
    ranks = losses_by_layout(spawn(_worker, 4, corpus, root))
    return {"reference": reference, "ranks": ranks, "root": root, "corpus": corpus}


@pytest.mark.slow
@pytest.mark.dist
def test_stopped_layout_follows_the_reference(runs: dict) -> None:
    saved = runs["ranks"]["tp2_ep2_save"]
    assert [r["step"] for r in saved[0]] == list(range(1, SAVED_AT + 1))
    assert_parity("tp2_ep2 (stop_at)", saved, runs["reference"][:SAVED_AT], SAVE_LAYOUT.world_size, fields=LOSS_FIELDS)
    assert runs["reference"][-1]["loss"] < runs["reference"][0]["loss"]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", LOAD_LAYOUTS)
def test_resumed_layout_continues_the_reference(runs: dict, layout: str) -> None:
    resumed = runs["ranks"][layout]
    assert [r["step"] for r in resumed[0]] == list(range(SAVED_AT + 1, STEPS + 1))
    assert_parity(layout, resumed, runs["reference"][SAVED_AT:], LOAD_LAYOUTS[layout].world_size, fields=LOSS_FIELDS)


def _loaded_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The weights and AdamW moments the trainer holds, by single-process name."""
    state = {f"model.{name}": value.detach().clone() for name, value in trainer.run.stage.model.state_dict().items()}
    moments, step_count = trainer.run.optimizer.moments_by_name()
    for name, by_kind in moments.items():
        state.update({f"{kind}.{name}": value.clone() for kind, value in by_kind.items()})
    state["step_count"] = torch.as_tensor(float(step_count))
    return state


@pytest.mark.slow
@pytest.mark.dist
def test_parallel_checkpoint_resumes_in_the_single_process(runs: dict) -> None:
    root, corpus = runs["root"], runs["corpus"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        console = Console(file=io.StringIO())
        # The single-process run's own checkpoint, loaded in one process: what the parallel one must match.
        own = Trainer(run_spec(TRAINING, ParallelConfig(), corpus), SuppliedParts(console=console))
        try:
            step = load_checkpoint(checkpoint_dir(root / "single", SAVED_AT), own.run, own.model_cfg, own.identity())
            assert step == SAVED_AT
            want = _loaded_state(own)
        finally:
            own.close()
        trainer = Trainer(run_spec(TRAINING, ParallelConfig(), corpus, save_dir=str(root / "to_single"), resume=True),
                          SuppliedParts(console=console))
        load, loaded = trainer.load, {}

        def load_and_keep() -> bool:  # the state the resumed run starts from
            found = load()
            loaded.update(step=trainer.step, state=_loaded_state(trainer))
            return found

        trainer.load = load_and_keep
        rows = trainer.train()
    finally:
        torch.set_num_threads(threads)
    assert loaded["step"] == SAVED_AT
    got = loaded["state"]
    assert got.keys() == want.keys()
    assert float(got["step_count"]) == SAVED_AT
    for name, value in want.items():
        _assert_near(got[name], value, name)
    assert [r["step"] for r in rows] == list(range(SAVED_AT + 1, STEPS + 1))
    assert_parity("single process from tp2_ep2", [rows], runs["reference"][SAVED_AT:], 1, fields=LOSS_FIELDS)


def _assert_near(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to fp32 reduction order (the layouts sum gradients in another order): relative
    distance under 1e-3, where a missing or misplaced value gives about 1."""
    assert got.shape == want.shape, what
    distance = float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))
    assert distance < 1e-3, f"{what}: relative distance {distance:.2e}"
