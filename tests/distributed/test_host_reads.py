"""Host reads inside the step users run: the counter sees each kind of read, and the step of every
layout makes only the reads it declares (one metrics read per step; under expert parallelism one
count exchange per MoE layer and micro-batch)."""

from __future__ import annotations

import io

import pytest
import torch
from _parity import run_spec, side_by_side
from rich.console import Console

from moetrain.config import ParallelConfig, TrainingConfig, load_model_config
from moetrain.config.model import moe_layer_indices
from moetrain.distributed.host_reads import HostReadCounter, host_read
from moetrain.distributed.step import train_step
from moetrain.distributed.world import spawn
from moetrain.models import experts

TRAINING = TrainingConfig(steps=2, global_batch=4, micro_batch=2, seq_len=32, warmup_steps=1)


def test_the_counter_sees_every_kind_of_read_and_files_declared_ones_apart():
    t = torch.arange(6.0)
    with HostReadCounter() as reads:
        t[0].item()
        t.tolist()
        t.cpu()
        bool(t[1] > 0)
        t.nonzero()
        t[t > 2]
        t.sum()  # no read
        with host_read("metrics"):
            t.tolist()
            t[0].item()
    kinds = [entry.split(" at ")[0] for entry in reads.undeclared]
    assert kinds == ["item", ".tolist()", ".cpu()", "item", "nonzero", "boolean index"]
    assert dict(reads.declared) == {"metrics": 1}


def _step_reads(spec, dims=None) -> tuple[dict, list[str]]:
    from moetrain.train import SuppliedParts, Trainer

    trainer = Trainer(spec, SuppliedParts(dims=dims, console=Console(file=io.StringIO())))
    batch = trainer.next_batch()
    with HostReadCounter() as reads:
        train_step(trainer.run, 0, batch)
    trainer.close()
    return dict(reads.declared), reads.undeclared


@pytest.mark.parametrize("model", ["tiny-pangu", "tiny-qwen3", "tiny-mixtral"])
def test_one_process_step_reads_only_its_metrics(model):
    spec = run_spec(TRAINING, ParallelConfig(), None).model_copy(update={"model": model})
    declared, undeclared = _step_reads(spec)
    assert undeclared == []
    assert declared == {"step metrics": 1}


def test_the_per_expert_loop_would_be_caught(monkeypatch):
    """Without the device-side grouped GEMM (torch without the kernel) each expert GEMM reads its
    group sizes: the counter names them, so a regression to host-side splits cannot pass unseen."""
    monkeypatch.setattr(experts, "native_grouped_mm_ok", lambda *a, **k: False)
    _, undeclared = _step_reads(run_spec(TRAINING, ParallelConfig(), None))
    assert undeclared and all(entry.startswith(".tolist() at models/experts.py") for entry in undeclared)


LAYOUTS = {"dp2": ParallelConfig(dp=2), "tp2": ParallelConfig(tp=2, sp=True), "pp2": ParallelConfig(pp=2),
           "ep2": ParallelConfig(dp=2, ep=2)}


def _worker(rank: int, world_size: int) -> dict[str, tuple[dict, list[str]]]:
    torch.set_num_threads(1)
    return {name: _step_reads(run_spec(TRAINING, parallel, None), dims)
            for name, parallel, dims in side_by_side(LAYOUTS, rank)}


@pytest.mark.dist
def test_every_layout_makes_only_its_declared_reads():
    per_rank = spawn(_worker, 8)
    seen = set()
    for rank_out in per_rank:
        for name, (declared, undeclared) in rank_out.items():
            seen.add(name)
            assert undeclared == [], f"{name}: {undeclared}"
            assert declared.get("step metrics") == 1, f"{name}: {declared}"
            if name == "ep2":
                # one exchange per MoE layer (tiny-pangu: 6, and its MTP module's) and micro-batch (1 per replica)
                moe_layers = len(moe_layer_indices(load_model_config("tiny-pangu")))
                micro_batches = TRAINING.global_batch // LAYOUTS[name].dp // TRAINING.micro_batch
                assert (moe_layers, micro_batches) == (7, 1)
                assert declared == {"step metrics": 1, "expert counts": moe_layers * micro_batches}
            else:
                assert set(declared) == {"step metrics"}, f"{name}: {declared}"
    assert seen == set(LAYOUTS)
