"""The replicated experts' gradient rings run under the backward (``moetrain.distributed.replica_gradients``)
and give the same bits as run after it: 4 gloo ranks, EP4, tiny-pangu with its hot experts 0-2 replicated on
ranks 1-3 in every MoE layer, 2 micro-batches per rank (a layer is ready only after the second backward
pass), the balancer observing only (the placement stays the replicated one). Both runs start from the same
weights and read the same batches; the only difference is when each layer's rings start. Both schedules: the
plain one (the expert weight gradients accumulate in autograd, whose hooks start the rings) and ``--overlap``
(they accumulate outside autograd, in ``SplitGradExperts``' deferred weight gradients, whose own hook starts
them).

The sums are bitwise equal, not only close: every chunk is summed by the same replica with the same
additions in the same order; only the time at which they are made moves."""

from __future__ import annotations

import math
import time

import pytest
import torch
from test_balancing import EP, replicated_start, skewed_model, skewed_model_config

from moetrain.config import ParallelConfig, TrainingConfig, load_cluster_config
from moetrain.data.synthetic import SyntheticDataset
from moetrain.distributed.balancing import BalancedRunSetup, BalancerTuning, build_balanced_run, moe_layers
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.step import train_step
from moetrain.distributed.world import spawn

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 3
TRAINING = TrainingConfig(steps=STEPS, global_batch=16, micro_batch=2, seq_len=32, warmup_steps=1)
"""16 sequences over 4 data-parallel ranks in micro-batches of 2: two backward passes per rank and step."""


def _run(rank: int, overlap: bool, schedule_overlap: bool) -> dict:
    dims = ParallelDims.build(ParallelConfig(dp=EP, ep=EP, overlap=schedule_overlap), rank, EP)
    setup = BalancedRunSetup(model=skewed_model(), placement=replicated_start(),
                             tuning=BalancerTuning(trigger_margin=math.inf))
    run, balancer = build_balanced_run(dims, skewed_model_config(), TRAINING, "cpu", load_cluster_config("cpu"), setup)
    # the runtime switch alone: the cost model (which also re-shares the replicas' tokens) is the same
    balancer.replicas.overlap = overlap
    if overlap:
        # each ring starts late: the backward is over before the last ones finish, so an optimizer that read
        # the gradients without waiting for them would read unsummed ones
        ring = balancer.replicas._ring
        balancer.replicas._ring = lambda *args: (time.sleep(0.05), ring(*args))[1]
    data = SyntheticDataset(run.model_cfg.vocab_size, TRAINING.seq_len, TRAINING.seed)
    out: dict = {"loss": [], "grad_norm": [], "started": [], "grads": []}
    for step in range(STEPS):
        batch = data.step_batch(step, TRAINING.global_batch, TRAINING.micro_batch, dims.local_rank("dp"), EP)
        result = train_step(run, step, batch)
        balancer.after_step(step)
        out["loss"].append(result.loss)
        out["grad_norm"].append(result.grad_norm)
        out["started"].append(list(balancer.replicas.last_started_in_backward))
        # the summed gradients the update used (kept until the next step's zero_grad)
        out["grads"].append([getattr(block.experts, name).grad.clone()
                             for _, block in moe_layers(run.stage.model)
                             for name in ("w_gate_EDF", "w_up_EDF", "w_down_EFD")])
    out["weights"] = {name: p.detach().clone() for name, p in run.stage.model.named_parameters()}
    out["placements"] = [p.slot_expert.tolist() for p in balancer.placements]
    out["num_layers"] = len(moe_layers(run.stage.model))
    return out


def _worker(rank: int, world_size: int, schedule_overlap: bool) -> dict:
    torch.set_num_threads(1)
    return {"after": _run(rank, False, schedule_overlap), "under": _run(rank, True, schedule_overlap)}


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "overlap"])
def runs(request) -> list[dict]:
    return spawn(_worker, EP, request.param)


def test_rings_under_the_backward_give_the_same_bits(runs: list[dict]) -> None:
    for rank, run in enumerate(runs):
        after, under = run["after"], run["under"]
        assert after["placements"] == under["placements"] == [replicated_start().slot_expert.tolist()] * len(
            after["placements"])  # observe only: the replicas stay (their shares may change, alike in both)
        assert under["loss"] == after["loss"] and under["grad_norm"] == after["grad_norm"], rank
        for step in range(STEPS):
            for got, want in zip(under["grads"][step], after["grads"][step]):
                assert torch.equal(got, want), (rank, step)
        for name, value in after["weights"].items():
            assert torch.equal(under["weights"][name], value), (rank, name)
    # the replicas' gradients really were summed: replica slots of one expert hold the same bits
    table = replicated_start()
    for expert in (0, 1, 2):
        holders = table.replicas(expert)
        for k in range(len(runs[0]["under"]["grads"][0])):
            first = runs[holders[0][0]]["under"]["grads"][-1][k][holders[0][1]]
            assert all(torch.equal(runs[r]["under"]["grads"][-1][k][s], first) for r, s in holders[1:])


def test_every_layer_starts_its_rings_under_the_backward(runs: list[dict]) -> None:
    for run in runs:
        layers = run["under"]["num_layers"]
        # every step, every replicated layer was started from its hook, the last layer first
        assert run["under"]["started"] == [list(reversed(range(layers)))] * STEPS
        assert run["after"]["started"] == [[]] * STEPS
