"""Helper for tests that compare a ``moetrain train`` run through torchrun (several nodes, a restart) with the
same run uninterrupted on one node: that reference trains on ranks forked from the test process.

The reference is the spec ``moetrain train`` builds and checks from the same flags, trained by the loop its
ranks run (``Trainer``), on as many ranks; only the start-up differs: a forked rank inherits the imported
torch, where each torchrun rank and its agent start Python and import torch (about 5 CPU-seconds a rank).
The torchrun path itself stays under test in the run the reference is compared with.
"""

from __future__ import annotations

import argparse

from moetrain.cli.train import add_arguments, checked_spec
from moetrain.config.run import RunSpec
from moetrain.distributed.world import spawn
from moetrain.train.trainer import Trainer  # imported here, once: the forked ranks inherit it


def _rank(rank: int, world_size: int, spec: RunSpec) -> None:
    Trainer(spec).train()


def train_forked(argv: list[str]) -> RunSpec:
    """Train ``moetrain train *argv`` (``--nproc N``: N forked ranks, one torch thread each); its spec."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = checked_spec(parser.parse_args(argv))
    spawn(_rank, spec.world_size, spec)
    return spec
