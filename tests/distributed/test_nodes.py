"""``moetrain train`` on several nodes: the same command on two "nodes" of this machine (two torchrun agents
of two ranks each, joined by c10d rendezvous) trains exactly as the same layout on one node of four ranks:
the same metrics rows, the same final weights and optimizer state, bit for bit (the one-node run on ranks
forked from the test process: ``forked_ranks``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoint_tensors import checkpoint_tensors
from forked_ranks import train_forked
from several_nodes import run_as_nodes

SHAPE = ["train", "--synthetic-data", "--steps", "2", "--seq-len", "16", "--global-batch", "4", "--micro-batch", "2",
         "--tp", "2", "--ep", "2", "--device", "cpu", "--threads", "1", "--quiet", "--save-dir"]
TIMINGS = ("step_time_s", "tokens_per_s", "mfu", "batch_time_s", "train_step_time_s", "after_step_time_s",
           "save_stall_s")


def _rows(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.dist
def test_two_nodes_of_two_ranks_train_as_one_node_of_four_bit_for_bit(tmp_path):
    one = tmp_path / "one"  # the one-node run of 4 ranks: the reference, on forked ranks (forked_ranks)
    train_forked([*SHAPE[1:], str(one / "ckpt"), "--nproc", "4", "--metrics-out", str(one / "m.jsonl")])
    two = tmp_path / "two"
    run_as_nodes([*SHAPE, str(two / "ckpt"), "--nproc", "2", "--metrics-out", str(two / "m.jsonl")], 2, two)
    single, several = _rows(one / "m.jsonl"), _rows(two / "m.jsonl")
    assert [r["step"] for r in several] == [1, 2] and several[0]["layout"]["tp"] == 2
    assert several == single  # losses, gradient norms, expert loads: every field but the timings
    want = checkpoint_tensors(one / "ckpt" / "step-000002", tmp_path / "one.pt")
    got = checkpoint_tensors(two / "ckpt" / "step-000002", tmp_path / "two.pt")
    assert got.keys() == want.keys() and any(".experts." in k for k in want)
    for name, value in want.items():
        if name.startswith("rng."):
            continue  # the process's generator, which no step draws from: the copy of whichever rank DCP kept
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


@pytest.mark.slow
@pytest.mark.dist
def test_a_node_started_with_other_flags_stops_the_run_in_one_line(tmp_path):
    """Node 1 given another learning rate: every node's run ends with exit 2 and the line naming the rank
    (and node) whose spec differs from rank 0's."""
    errors = run_as_nodes([*SHAPE, str(tmp_path / "ckpt"), "--nproc", "2"], 2, tmp_path,
                          node_argv={1: ["--lr", "1e-4"]}, expect=2)
    for err in errors:
        assert ("rank 2 (node 1) built another run spec than rank 0 (node 0): start every node with the same moetrain "
                "train flags, the same --config and paths that every node reads") in err, err
