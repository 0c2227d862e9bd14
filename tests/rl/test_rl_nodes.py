"""``moetrain rl`` on several nodes: where the groups land on nodes (refused before launch when a replica or a
trainer TP group would span two), and the disaggregated StaleSync pipeline started as two "nodes" of this
machine (two torchrun agents of two ranks each) equal to the same run on one node of four ranks (ranks forked
from the test process: ``forked_ranks``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoint_tensors import checkpoint_tensors
from forked_ranks import forked_rl_ranks
from moetrain.cli import main
from moetrain.config.nodes import crossing
from moetrain.distributed.nodes import Nodes
from moetrain.errors import UserError
from moetrain.rl.node_placement import node_problems
from moetrain.rl.spec import resolve_rl_spec
from refusals import refused
from several_nodes import run_as_nodes


def _spec(world: int, replicas: int = 1, gen_ep: int = 1, tp: int = 1, staleness: int | None = 0,
          reward_worker: bool = False):
    source: dict = {"trainer": {"parallel": {"tp": tp}}, "rl": {"prompts_per_step": 6}}  # 48 samples: any dp here
    if staleness is not None:
        source |= {"stalesync": {"staleness": staleness, "placement": "disaggregated", "reward_worker": reward_worker},
                   "rollout": {"replicas": replicas, "ranks_per_replica": gen_ep}}
    else:
        source["generation"] = {"gen_ep": gen_ep}
    return resolve_rl_spec([source], ["rl.yaml"], world_size=world)


def test_a_group_crosses_nodes_when_it_fits_one_but_spans_two_or_does_not_fill_whole_nodes():
    assert not crossing(range(0, 2), 2) and not crossing(range(2, 4), 2) and not crossing(range(4, 6), 4)
    assert crossing(range(1, 3), 2) and crossing(range(3, 5), 4)
    assert not crossing(range(0, 8), 4) and not crossing(range(4, 12), 4)
    assert crossing(range(2, 10), 4) and crossing(range(0, 6), 4)


def test_replicas_and_trainer_tp_groups_stay_inside_nodes():
    # 2 replicas of 1 rank on node 0, the TP2 trainer on node 1
    assert node_problems(_spec(4, replicas=2, tp=2), 2) == []
    # replicas of 2 EP ranks on nodes of 4: two per node, the trainer on its own node
    assert node_problems(_spec(8, replicas=2, gen_ep=2, tp=2), 4) == []
    # one replica of 8 ranks fills two nodes of 4
    assert node_problems(_spec(12, replicas=1, gen_ep=8, tp=2), 4) == []
    # replicas of 2 on nodes of 3: replica 1 (ranks 2–3) spans nodes 0 and 1
    problem, = node_problems(_spec(6, replicas=2, gen_ep=2), 3)
    assert problem == ("rollout replica 1 (ranks 2–3) would span nodes of 3 ranks: give each node (--nproc) a "
                       "multiple of the group's 2 ranks")
    # one rollout rank, the TP2 trainer on ranks 1–2 across nodes of 2, then the reward worker
    problem, = node_problems(_spec(4, replicas=1, tp=2, reward_worker=True), 2)
    assert problem.startswith("the trainer's tp 2 group of ranks 1–2 would span nodes of 2 ranks")
    # colocated: generation replicas of gen_ep 4 and a TP4 trainer on nodes of 2 fill whole nodes
    assert node_problems(_spec(8, gen_ep=4, tp=4, staleness=None), 2) == []
    problem, = node_problems(_spec(6, gen_ep=2, staleness=None), 3)
    assert problem == ("generation replica 1 (ranks 2–3) would span nodes of 3 ranks: give each node (--nproc) a "
                       "multiple of the group's 2 ranks")
    replica, tp = node_problems(_spec(12, gen_ep=4, tp=4, staleness=None), 3)
    assert replica.startswith("generation replica 0 (ranks 0–3) would span nodes of 3 ranks: a group larger than a "
                              "node fills whole nodes")
    assert tp.startswith("the trainer's tp 4 group of ranks 0–3 would span nodes of 3 ranks")


def test_nodes_refuse_what_torchrun_cannot_join():
    for nodes, expected in ((dict(count=0), "--nnodes 0 must be ≥ 1"),
                            (dict(count=2), "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
                            (dict(count=1, endpoint="h:1"), "--rdzv-endpoint h:1 joins several nodes"),
                            (dict(count=2, endpoint="node0"), "--rdzv-endpoint node0: give HOST:PORT")):
        with pytest.raises(UserError, match=expected):
            Nodes(**nodes)
    assert Nodes(2, "node0:29400").torchrun_args(4) == [
        "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400", "--rdzv-id=moetrain"]
    assert Nodes().torchrun_args(4) == ["--standalone", "--nproc-per-node=4"]


@pytest.mark.parametrize("argv, expected", [
    (["--nnodes", "2", "--rdzv-endpoint", "h:1"], ("--nnodes 2 needs --nproc N",)),
    (["--nnodes", "2", "--nproc", "2"], ("--nnodes 2 needs --rdzv-endpoint",)),
    (["--nproc", "2", "--rdzv-endpoint", "h:1"], ("joins several nodes: give --nnodes M",)),
    (["--nnodes", "2", "--nproc", "3", "--rdzv-endpoint", "h:1", "--staleness", "0", "--placement", "disaggregated",
      "--rollout-replicas", "2", "--gen-ep", "2"], ("rollout replica 1 (ranks 2–3) would span nodes of 3 ranks",)),
    (["--nnodes", "2", "--nproc", "2", "--rdzv-endpoint", "h:1", "--staleness", "0", "--placement", "disaggregated",
      "--rollout-replicas", "2", "--engine", "ray"], ("a Ray run spans the nodes of its Ray cluster",)),
])
def test_cli_refuses_a_bad_node_layout_in_one_line_exit_2(capsys, argv, expected):
    refused(capsys, ["rl", "--prompts", "4", *argv], *expected)


def test_train_refuses_several_nodes_without_ranks_per_node(capsys):
    refused(capsys, ["train", "--nnodes", "2", "--rdzv-endpoint", "h:1"], "--nnodes 2 needs --nproc N")


RUN = ["rl", "--sft-steps", "2", "--sft-batch", "8", "--steps", "2", "--prompts", "2", "--group-size", "2",
       "--eval-size", "4", "--eval-every", "0", "--device", "cpu", "--threads", "1", "--quiet",
       "--staleness", "0", "--placement", "disaggregated", "--rollout-replicas", "2", "--tp", "2"]
TIMED = ("_s", "_per_s", "time", "mfu")
"""Row fields that are timings (by their name's end; MFU is one too): the rest must be equal."""


def _rows(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.endswith(TIMED)}
            for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.dist
def test_stalesync_on_two_nodes_of_two_ranks_is_the_one_node_run_bit_for_bit(tmp_path, monkeypatch):
    """2 rollout replicas beside a TP2 trainer group at k = 0: node 0 holds the replicas, node 1 the trainer;
    the rows (rewards, lengths, losses of the same samples) and the final weights equal the one-node run's."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one, two = tmp_path / "one", tmp_path / "two"
    with forked_rl_ranks():  # the one-node run, the reference: its 4 ranks forked from this process
        assert main([*RUN, "--nproc", "4", "--metrics-out", str(one / "m.jsonl"), "--save-dir", str(one / "ckpt"),
                     "--log-dir", str(one / "log")]) == 0
    run_as_nodes([*RUN, "--nproc", "2", "--metrics-out", str(two / "m.jsonl"), "--save-dir", str(two / "ckpt")], 2, two)
    single, several = _rows(one / "m.jsonl"), _rows(two / "m.jsonl")
    steps = [r for r in several if "loss" in r]
    assert [r["weight_version"] for r in steps] == [0, 1] and [r["staleness_max"] for r in steps] == [0, 0]
    assert several == single
    want = checkpoint_tensors(one / "ckpt" / "rl" / "step-000002", tmp_path / "one.pt")
    got = checkpoint_tensors(two / "ckpt" / "rl" / "step-000002", tmp_path / "two.pt")
    assert got.keys() == want.keys() and any(".experts." in k for k in want)
    for name, value in want.items():
        if name.startswith("rng."):
            continue  # the process's generator, which no step draws from: the copy of whichever rank DCP kept
        assert torch.equal(got[name], value) if isinstance(value, torch.Tensor) else got[name] == value, name
