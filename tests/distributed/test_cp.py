"""Context parallelism: the load-balanced split, CP attention == full-sequence attention (MLA and GQA,
documents, forward and gradients), per-step loss parity of CP layouts with the single-process
reference (tiny-pangu, fp32, gloo), a CP2 checkpoint resumed under DP2, ``moetrain train --cp 2`` on a
packed corpus (documents inside sequences, MTP) == ``moetrain train`` in one process, and the
launcher's checks."""

from __future__ import annotations

import json
import random
from argparse import Namespace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _parity import assert_parity, losses_by_layout, single_thread_reference

from moetrain.cli import main
from moetrain.config import GQAConfig, ParallelConfig, TrainingConfig, load_model_config
from moetrain.distributed.checkpoint import load_checkpoint, save_checkpoint
from moetrain.distributed.cp import ContextParallel, load_balanced_index
from moetrain.distributed.launch import check_seq_len, launch
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.step import build_layout, train_step
from moetrain.distributed.world import spawn
from moetrain.errors import UserError
from moetrain.models.attention import GQA, MLA, build_attention_context
from moetrain.train import checkpoint as single

STEPS, SAVED_AT = 6, 3
TRAINING = TrainingConfig(steps=STEPS, global_batch=8, micro_batch=2, seq_len=32, warmup_steps=2)
ROUNDS: list[dict[str, ParallelConfig]] = [
    {"cp2": ParallelConfig(cp=2), "cp2_ep2_overlap": ParallelConfig(cp=2, ep=2, overlap=True)},
    {"cp2_tp2": ParallelConfig(cp=2, tp=2, sp=True)},
    {"cp2_pp2_overlap": ParallelConfig(cp=2, pp=2, overlap=True)},
    {"cp2_dp2_ep4": ParallelConfig(cp=2, dp=2, ep=4)},
    {"cp2_overlap": ParallelConfig(cp=2, overlap=True), "cp2_ep2": ParallelConfig(cp=2, ep=2)},
]
RESUME_LAYOUT = ParallelConfig(dp=2)
"""Loads the checkpoint the ``cp2`` layout saves after ``SAVED_AT`` steps (on the same two ranks)."""


def test_load_balanced_split_covers_the_sequence_and_evens_causal_work() -> None:
    assert load_balanced_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    held = [load_balanced_index(24, 3, r) for r in range(3)]
    assert sorted(torch.cat(held).tolist()) == list(range(24))
    # Causal work of a query is (its index + 1) keys: equal on every rank.
    assert len({int((index + 1).sum()) for index in held}) == 1
    with pytest.raises(ValueError, match="does not split into 2·cp = 4 chunks"):
        load_balanced_index(10, 2, 0)


def _attention_modules(seed: int) -> dict[str, torch.nn.Module]:
    cfg = load_model_config("tiny-pangu")
    modules: dict[str, torch.nn.Module] = {}
    for backend in ("eager", "sdpa"):
        torch.manual_seed(seed)
        modules[f"mla_{backend}"] = MLA(cfg.hidden_size, cfg.attention, cfg.norm_eps, cfg.rope_theta, backend)
        modules[f"gqa_{backend}"] = GQA(cfg.hidden_size, GQAConfig(num_heads=4, num_kv_heads=2, head_dim=16,
                                                                   qk_norm=True), cfg.norm_eps, cfg.rope_theta, backend)
    for module in modules.values():
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.1)
    return modules


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))


def _attention_worker(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    """Largest |CP − full| relative to the largest |full| per quantity and module (outputs and input
    gradients of this rank's tokens, parameter gradients summed over the CP ranks, worst tensor)."""
    cp = ContextParallel(dist.group.WORLD, world_size, rank)
    errors: dict[str, dict[str, float]] = {}
    for name, module in _attention_modules(seed=7).items():
        gen = torch.Generator().manual_seed(11)
        batch, seq, hidden = 2, 16, module.o_proj.out_features
        x = torch.randn(batch, seq, hidden, generator=gen)
        grad_out = torch.randn(batch, seq, hidden, generator=gen)
        ids = torch.zeros(batch, seq, dtype=torch.long)
        # Documents that straddle the chunk boundaries (chunks of 4 tokens on 2 ranks).
        documents = torch.tensor([[0] * 3 + [1] * 7 + [2] * 6, [0] * 9 + [1] * 2 + [2] * 5])

        full_x = x.clone().requires_grad_(True)
        full = module(full_x, build_attention_context(ids, documents))
        full.backward(grad_out)
        full_grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        module.zero_grad()

        local_x = cp.local_tokens(x).clone().requires_grad_(True)
        local = module(local_x, cp.attention_context(ids, documents))
        local.backward(cp.local_tokens(grad_out))
        worst_param = 0.0
        for n, p in module.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad)
            worst_param = max(worst_param, _relative(grad, full_grads[n]))
        errors[name] = {
            "out": _relative(local.detach(), cp.local_tokens(full.detach())),
            "input_grad": _relative(local_x.grad, cp.local_tokens(full_x.grad)),
            "param_grad": worst_param,
            "scale": float(full.detach().abs().max()),
        }
    return errors


@pytest.mark.dist
def test_cp_attention_equals_full_sequence_attention_forward_and_backward() -> None:
    for rank_errors in spawn(_attention_worker, 2):
        assert set(rank_errors) == {"mla_eager", "mla_sdpa", "gqa_eager", "gqa_sdpa"}
        for name, errors in rank_errors.items():
            assert errors["scale"] > 0.1, f"{name}: degenerate output"
            for quantity in ("out", "input_grad", "param_grad"):
                assert errors[quantity] < 1e-5, f"{name} {quantity}: {errors[quantity]}"


def _parity_worker(rank: int, world_size: int, root: str) -> dict[str, list[float]]:
    model_cfg = load_model_config("tiny-pangu")
    cpu = torch.device("cpu")
    losses: dict[str, list[float]] = {}
    for index, layouts in enumerate(ROUNDS):
        offset, members = 0, []
        for name, parallel in layouts.items():
            members.append((name, ParallelDims.build(parallel, rank, rank_offset=offset)))
            offset += parallel.world_size
        resume = ParallelDims.build(RESUME_LAYOUT, rank) if index == 0 else None
        for name, dims in members:
            if not dims.is_member:
                continue
            run = build_layout(dims, model_cfg, TRAINING, cpu)
            losses[name] = []
            for step in range(STEPS):
                losses[name].append(train_step(run, step, TRAINING, cpu))
                if name == "cp2" and step + 1 == SAVED_AT:
                    save_checkpoint(Path(root), SAVED_AT, run, model_cfg, TRAINING, config_hash="test")
            if name == "cp2":
                assert resume is not None and resume.is_member
                run = build_layout(resume, model_cfg, TRAINING, cpu)
                start = load_checkpoint(single.checkpoint_dir(Path(root), SAVED_AT), run, model_cfg)
                losses["dp2_from_cp2"] = [train_step(run, step, TRAINING, cpu) for step in range(start, STEPS)]
    return losses


@pytest.fixture(scope="module")
def layout_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[float]]]:
    return losses_by_layout(spawn(_parity_worker, 4, str(tmp_path_factory.mktemp("cp_checkpoint"))))


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return single_thread_reference(load_model_config("tiny-pangu"), TRAINING, STEPS)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", [name for layouts in ROUNDS for name in layouts])
def test_cp_layout_matches_single_process(layout: str, layout_losses: dict, reference: list[float]) -> None:
    ranks = next(p.world_size for layouts in ROUNDS for n, p in layouts.items() if n == layout)
    assert_parity(layout, layout_losses[layout], reference, ranks)
    assert reference[-1] < reference[0]


@pytest.mark.slow
@pytest.mark.dist
def test_cp2_checkpoint_resumes_under_dp2(layout_losses: dict, reference: list[float]) -> None:
    assert_parity("dp2 resumed from cp2", layout_losses["dp2_from_cp2"], reference[SAVED_AT:], RESUME_LAYOUT.world_size)


@pytest.mark.parametrize(
    ("seq_len", "parallel", "message"),
    [
        (30, ParallelConfig(cp=2), "--seq-len 30 does not split into 2·cp = 4 context-parallel chunks; "
                                   "make it a multiple of 4"),
        (36, ParallelConfig(cp=2, tp=4, sp=True),
         "--seq-len 36 does not split over tp=4 sequence shards of each cp=2 share (18 tokens)"),
        (30, ParallelConfig(tp=4, sp=True), "--seq-len 30 does not split over tp=4 sequence shards"),
    ],
)
def test_launcher_refuses_a_sequence_that_does_not_split(seq_len: int, parallel: ParallelConfig,
                                                         message: str) -> None:
    with pytest.raises(UserError) as info:
        check_seq_len(seq_len, parallel)
    assert str(info.value) == message
    check_seq_len(32, parallel)


def test_launch_refuses_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> int:
        raise AssertionError("a process was started")

    monkeypatch.setattr("moetrain.distributed.launch.subprocess.call", refuse)
    args = Namespace(model="tiny-pangu", tp=1, pp=1, vpp=1, ep=1, etp=1, cp=2, hierarchical_a2a=False,
                     ranks_per_node=None, overlap=False, steps=2, global_batch=4, micro_batch=2, seq_len=34,
                     trace_dir=None, metrics_out=None)
    with pytest.raises(UserError, match="--seq-len 34 does not split into 2·cp = 4"):
        launch(2, args)


@pytest.mark.slow
@pytest.mark.dist
def test_moetrain_train_cp2_on_a_corpus_gives_the_single_process_metrics(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(3)
    words = ["the", "king", "queen", "sword", "crown", "night", "day", "war", "peace", "heart", "of", "and"]
    data = tmp_path / "tiny.txt"
    # Short documents: several start inside each 16-token sequence, across the CP chunk boundaries.
    data.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(60)))
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    shape = ["--data", str(data), "--steps", "3", "--seq-len", "16", "--global-batch", "4", "--micro-batch", "2"]
    threads = torch.get_num_threads()
    try:
        assert main(["train", *shape, "--device", "cpu", "--threads", "1", "--quiet",
                     "--metrics-out", str(tmp_path / "single.jsonl")]) == 0
    finally:
        torch.set_num_threads(threads)
    assert main(["train", *shape, "--nproc", "2", "--cp", "2", "--metrics-out", str(tmp_path / "cp2.jsonl")]) == 0
    single, cp2 = ([json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
                   for name in ("single.jsonl", "cp2.jsonl"))
    assert [r["step"] for r in cp2] == [r["step"] for r in single] == [1, 2, 3]
    for got, want in zip(cp2, single):
        assert got["layout"]["cp"] == 2 and got["tokens"] == want["tokens"] == 4 * 16
        for key in ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), f"step {want['step']} {key}"
