"""Helper for tests that compare a run through torchrun (several nodes, a restart) with the same run
uninterrupted on one node: that reference runs on ranks forked from the test process.

The reference is the spec the CLI builds and checks from the same flags, run by the code each rank runs
(``Trainer``; ``moetrain.rl.worker.run_rank``), on as many ranks; only the start-up differs: a forked rank
inherits the imported torch and runtime, where each torchrun rank and its agent start Python and import
them (about 5 CPU-seconds a rank). The torchrun path stays under test in the run the reference is compared
with. Tests of what a command does on its ranks (not of how they start) fork them too: ``forked_rl_ranks`` and
``forked_train_ranks`` replace only the launcher's start of the ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import moetrain.distributed.launch
import moetrain.rl.fusion  # noqa: F401 (imported here, once, as the RL ranks' runtimes: the forked ranks inherit them)
import moetrain.rl.stalesync  # noqa: F401
from moetrain.cli.train import add_arguments, checked_spec
from moetrain.config.run import RunSpec
from moetrain.distributed.launch import Entry
from moetrain.distributed.nodes import Nodes
from moetrain.distributed.world import spawn
from moetrain.rl.spec import read_spec
from moetrain.rl.worker import run_rank
from moetrain.train.trainer import Trainer  # as moetrain.rl.stalesync: inherited by the forked ranks


def _train_rank(rank: int, world_size: int, spec: RunSpec) -> None:
    Trainer(spec).train()


def train_forked(argv: list[str]) -> RunSpec:
    """Train ``moetrain train *argv`` (``--nproc N``: N forked ranks, one torch thread each); its spec."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = checked_spec(parser.parse_args(argv))
    spawn(_train_rank, spec.world_size, spec)
    return spec


def _train_rank_from_file(rank: int, world_size: int, spec_file: Path) -> None:
    Trainer(RunSpec.model_validate_json(spec_file.read_text(encoding="utf-8"))).train()


@contextlib.contextmanager
def forked_train_ranks() -> Iterator[None]:
    """Within this, ``moetrain train`` on several ranks of one node starts them forked, not under torchrun:
    the CLI builds and checks the spec as ever, and each rank reads it back from the JSON file the launcher
    writes (as ``moetrain.cli.worker`` does), then trains it. One torch thread a rank (``--threads 1`` or
    ``OMP_NUM_THREADS=1``): a forked child must not use the parent's OpenMP pool."""
    def launch(spec: RunSpec, log_dir: Path | None = None, entry: Entry | None = None,
               nodes: Nodes | None = None) -> int:
        assert entry is None and (nodes is None or nodes.count == 1), "forked ranks are one node's train ranks"
        assert (spec.run.threads or int(os.environ.get("OMP_NUM_THREADS", "0"))) == 1, "one thread a rank"
        assert log_dir is not None, "the spec file goes to the run's --log-dir"
        log_dir.mkdir(parents=True, exist_ok=True)
        spec_file = log_dir / "run_spec.json"
        spec_file.write_text(spec.to_json(), encoding="utf-8")
        spawn(_train_rank_from_file, spec.world_size, spec_file)
        return 0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moetrain.distributed.launch, "launch", launch)
        yield


def _rl_rank(rank: int, world_size: int, spec_file: Path) -> None:
    run_rank(read_spec(spec_file), rank)


@contextlib.contextmanager
def forked_rl_ranks() -> Iterator[None]:
    """Within this, ``moetrain rl`` on one node starts its ranks forked, not under torchrun: the launcher's
    own work (the spec, the warm-up, the spec file) is unchanged. Each rank runs one torch thread
    (``--threads 1`` or ``OMP_NUM_THREADS=1``): a forked child must not use the parent's OpenMP pool."""
    def launch(spec: RunSpec, log_dir: Path | None = None, entry: Entry | None = None,
               nodes: Nodes | None = None) -> int:
        assert entry is not None and entry.module == "moetrain.rl.worker" and entry.spec_file is not None
        assert nodes is None or nodes.count == 1, "forked ranks are one node's"
        assert (spec.run.threads or int(os.environ.get("OMP_NUM_THREADS", "0"))) == 1, "one thread a rank"
        spawn(_rl_rank, entry.nproc or spec.world_size, entry.spec_file.path)
        return 0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moetrain.distributed.launch, "launch", launch)
        yield
