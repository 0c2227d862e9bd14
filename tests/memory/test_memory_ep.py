"""Memory policies under expert parallelism change no number: through the loop ``moetrain train`` runs
(``Trainer`` with ``memory.policy``), ``selective`` (norms, MLA up-projections, activations, router and
the ``permute`` recompute) gives, on 2 gloo ranks (tiny-pangu, EP2, flat and hierarchical all-to-all, the
real data pipeline), bit for bit the losses, gradient norms and last gradients of no policy, which are
the single-process run's within 1e-4. The ``permute`` recompute alone discards the MoE block's staged
dispatch (``start_dispatch`` … ``finish``) and dispatches again in backward: every MoE layer exchanges
its counts twice per micro-batch, with the same gradients."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest
import torch
from rich.console import Console

from moetrain.config import ParallelConfig, TrainingConfig
from moetrain.config.run import RunSpec
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.world import spawn
from moetrain.memory import MemoryPlan
from moetrain.memory.policy import num_blocks
from moetrain.memory.runtime import apply_memory_policy
from moetrain.train import SuppliedParts, Trainer

EP = 2
TRAINING = TrainingConfig(steps=2, global_batch=4, micro_batch=2, seq_len=32, warmup_steps=1)
POLICIES = ("none", "selective")
LOSS_FIELDS = ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm")
RANKS_PER_NODE = {"flat": EP, "hierarchical": 1}
"""The hierarchical all-to-all on nodes of one rank: both of its hops run."""


def _spec(data: Path, policy: str = "none", a2a: str | None = None) -> RunSpec:
    """The run of ``moetrain train --data DATA [--nproc 2 --ep 2] --policy POLICY`` (one process when ``a2a``
    is None)."""
    source = {"model": "tiny-pangu", "training": TRAINING.model_dump(), "memory": {"policy": policy},
              "run": {"device": "cpu", "cluster": "cpu", "quiet": True, "data": str(data)}}
    if a2a is not None:
        source["parallel"] = {"dp": EP, "ep": EP, "a2a": a2a}
        source["run"]["ranks_per_node"] = RANKS_PER_NODE[a2a]
    return RunSpec(**source)


def _train(rank: int, a2a: str, data, policy: str) -> dict:
    """Both steps' metrics rows, the last step's gradients (before the next step zeroes them) and the
    number of count exchanges (one per dispatch) the run made."""
    parallel = ParallelConfig(dp=EP, ep=EP, a2a=a2a)
    dims = ParallelDims.build(parallel, rank, RANKS_PER_NODE[a2a])
    trainer = Trainer(_spec(data, "none" if policy == "permute" else policy, a2a),
                      SuppliedParts(dims=dims, console=Console(file=io.StringIO())))
    model = trainer.run.stage.model
    if policy == "permute":  # the one option alone, on every layer (after the EP dispatcher is installed)
        apply_memory_policy(model, MemoryPlan.uniform(("permute",), num_blocks(trainer.model_cfg)))
    rows = trainer.train()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    dispatches = [s.name for s in trainer.tracer.spans].count("counts_d2h")
    return {"rows": rows, "grads": grads, "dispatches": dispatches}


def _worker(rank: int, world_size: int, data) -> dict:
    torch.use_deterministic_algorithms(True)
    return {a2a: {policy: _train(rank, a2a, data, policy) for policy in (*POLICIES, "permute")}
            for a2a in RANKS_PER_NODE}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory):
    """Short documents (several inside each sequence: attention is recomputed with document masks)."""
    root = tmp_path_factory.mktemp("memory_ep")
    rng = random.Random(5)
    words = ["the", "king", "queen", "sword", "crown", "night", "ghost", "love", "of", "and", "my", "lord"]
    data = root / "text.txt"
    data.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(80)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOETRAIN_CACHE", str(root / "cache"))
        yield data


@pytest.fixture(scope="module")
def reference(corpus) -> list[dict]:
    """The single-process run without a policy, on one torch thread (as each gloo rank runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Trainer(_spec(corpus), SuppliedParts(console=Console(file=io.StringIO()))).train()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(corpus, reference) -> list[dict]:
    # after the reference: it has built the data cache the ranks then read
    return spawn(_worker, EP, corpus)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("a2a", RANKS_PER_NODE)
def test_memory_policy_under_ep_keeps_losses_and_gradients(runs: list[dict], reference: list[dict], a2a: str) -> None:
    for rank_runs in runs:
        plain = rank_runs[a2a]["none"]
        assert len(plain["grads"]) > 0 and plain["dispatches"] > 0
        for policy in (*POLICIES[1:], "permute"):
            run = rank_runs[a2a][policy]
            for got, want in zip(run["rows"], plain["rows"], strict=True):
                for key in LOSS_FIELDS:
                    assert got[key] == want[key], (a2a, policy, got["step"], key, got[key], want[key])
            assert run["grads"].keys() == plain["grads"].keys()
            mismatched = [k for k in plain["grads"] if not torch.equal(plain["grads"][k], run["grads"][k])]
            assert mismatched == [], (a2a, policy, mismatched)
            # every MoE layer dispatched once more, in backward: the tokens were rebuilt, not kept
            assert run["dispatches"] == 2 * plain["dispatches"], (a2a, policy, run["dispatches"], plain["dispatches"])
    assert reference[-1]["loss"] < reference[0]["loss"]
    for got, want in zip(runs[0][a2a]["none"]["rows"], reference, strict=True):
        for key in LOSS_FIELDS:
            assert got[key] == pytest.approx(want[key], rel=1e-4), (a2a, got["step"], key)
