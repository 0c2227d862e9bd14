"""Context parallelism: the load-balanced split, CP attention == full-sequence attention (MLA and GQA,
documents, forward and gradients), CP layouts training like the single process on the loop and step
``moetrain train`` runs (tiny-pangu, fp32, gloo, the real data pipeline: per-step loss, its parts and the
gradient norm within 1e-4), a CP2 checkpoint resumed under DP2 on the same curve, ``moetrain train --cp 2``
on a packed corpus (documents inside sequences, MTP) == ``moetrain train`` in one process, and the
sequence-length checks made before any rank starts.

As ``test_layout_parity.py``: the layouts run side by side on disjoint ranks of one 4-process world, each
process single-threaded, against the single-process run computed first (it builds the data cache the
ranks then read)."""

from __future__ import annotations

import json
import random
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
    side_by_side,
    train_rows,
)

from forked_ranks import forked_train_ranks
from moetrain.cli import main
from moetrain.config import GQAConfig, ParallelConfig, TrainingConfig, load_model_config
from moetrain.distributed.cp import ContextParallel, load_balanced_index
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.world import spawn
from moetrain.errors import UserError
from moetrain.models.attention import GQA, MLA, build_attention_context
from moetrain.models.rope import Rotary
from moetrain.runtime_base.checkpoint_files import checkpoint_dir
from moetrain.train.checks import check_seq_len

STEPS, SAVED_AT = 3, 1  # two steps after the resume: the last shows the restored moments
TRAINING = TrainingConfig(steps=STEPS, global_batch=8, micro_batch=2, seq_len=32, warmup_steps=2)
ROUNDS: list[dict[str, ParallelConfig]] = [
    {"cp2": ParallelConfig(cp=2), "cp2_ep2_overlap": ParallelConfig(cp=2, ep=2, overlap=True)},
    {"cp2_tp2": ParallelConfig(cp=2, tp=2, sp=True)},
    {"cp2_pp2_overlap": ParallelConfig(cp=2, pp=2, overlap=True)},
    {"cp2_dp2_ep4": ParallelConfig(cp=2, dp=2, ep=4)},
    {"cp2_overlap": ParallelConfig(cp=2, overlap=True), "cp2_ep2": ParallelConfig(cp=2, ep=2)},
]
SAVE_LAYOUT = "cp2"
"""Saves every ``SAVED_AT`` steps (on ranks 0 and 1) while it trains."""
RESUME_LAYOUT = ParallelConfig(dp=2)
"""Resumes from the ``SAVE_LAYOUT``'s checkpoint at step ``SAVED_AT`` on the same two ranks."""


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
        rotary = Rotary(cfg.rope_theta)
        modules[f"mla_{backend}"] = MLA(cfg.hidden_size, cfg.attention, cfg.norm_eps, rotary, backend)
        modules[f"gqa_{backend}"] = GQA(cfg.hidden_size, GQAConfig(num_heads=4, num_kv_heads=2, head_dim=16,
                                                                   qk_norm=True), cfg.norm_eps, rotary, backend)
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


def _worker(rank: int, world_size: int, data: Path, root: Path) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for index, layouts in enumerate(ROUNDS):
        members = side_by_side(layouts, rank)
        resume = ParallelDims.build(RESUME_LAYOUT, rank) if index == 0 else None
        for name, parallel, dims in members:
            if name != SAVE_LAYOUT:
                rows[name] = train_rows(run_spec(TRAINING, parallel, data), dims)
                continue
            saved = root / "cp2"
            rows[name] = train_rows(run_spec(TRAINING, parallel, data, save_dir=str(saved), save_every=SAVED_AT), dims)
            # The step-SAVED_AT checkpoint alone in a folder of its own: what an interrupted run would have left.
            resumed = root / "dp2_from_cp2"
            if rank == dims.group_ranks["world"][0]:
                shutil.copytree(checkpoint_dir(saved, SAVED_AT), checkpoint_dir(resumed, SAVED_AT))
            assert resume is not None and resume.is_member
            dist.barrier(group=resume.get_group("world"))
            rows["dp2_from_cp2"] = train_rows(run_spec(TRAINING, RESUME_LAYOUT, data, save_dir=str(resumed),
                                                       resume=True), resume)
    return rows


@pytest.fixture(scope="module")
def reference(references) -> list[dict]:
    return references.rows(TRAINING)


@pytest.fixture(scope="module")
def layout_rows(corpus, reference, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[dict]]]:
    # after the reference: it has built the data cache the ranks then read
    return losses_by_layout(spawn(_worker, 4, corpus, tmp_path_factory.mktemp("cp_checkpoint")))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", [name for layouts in ROUNDS for name in layouts])
def test_cp_layout_matches_single_process(layout: str, layout_rows: dict, reference: list[dict]) -> None:
    ranks = next(p.world_size for layouts in ROUNDS for n, p in layouts.items() if n == layout)
    assert len(reference) == STEPS
    assert_parity(layout, layout_rows[layout], reference, ranks, fields=LOSS_FIELDS)
    assert reference[-1]["loss"] < reference[0]["loss"]  # the run trains
    for got, want in zip(layout_rows[layout][0], reference):
        assert got["expert_load_max_over_mean"] == pytest.approx(want["expert_load_max_over_mean"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.dist
def test_cp2_checkpoint_resumes_under_dp2(layout_rows: dict, reference: list[dict]) -> None:
    resumed = layout_rows["dp2_from_cp2"]
    assert [r["step"] for r in resumed[0]] == list(range(SAVED_AT + 1, STEPS + 1))
    assert_parity("dp2 resumed from cp2", resumed, reference[SAVED_AT:], RESUME_LAYOUT.world_size,
                  fields=LOSS_FIELDS)
    assert resumed[0][0]["layout"]["dp"] == 2 and resumed[0][0]["layout"]["cp"] == 1


TINY = load_model_config("tiny-pangu")


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
        check_seq_len(seq_len, parallel, TINY)
    assert str(info.value) == message
    check_seq_len(32, parallel, TINY)


def test_launch_refuses_before_any_process_starts(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                                  tmp_path: Path) -> None:
    def refuse(*args: object, **kwargs: object) -> int:
        raise AssertionError("a process was started")

    monkeypatch.setattr("moetrain.distributed.launch.subprocess.call", refuse)
    code = main(["train", "--nproc", "2", "--cp", "2", "--steps", "2", "--global-batch", "4", "--micro-batch", "2",
                 "--seq-len", "34", "--synthetic-data", "--log-dir", str(tmp_path / "logs")])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "moetrain train: error: --seq-len 34 does not split into 2·cp = 4 context-parallel chunks; "
        "make it a multiple of 4"]
    assert not (tmp_path / "logs").exists()


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
    # the CP2 ranks forked from this process, each reading back the launcher's spec file (forked_ranks): a
    # torchrun start costs about 5 CPU-seconds a rank, and torchrun stays under test in test_launch.py
    with forked_train_ranks():
        assert main(["train", *shape, "--nproc", "2", "--cp", "2", "--metrics-out", str(tmp_path / "cp2.jsonl"),
                     "--log-dir", str(tmp_path / "logs")]) == 0
    single, cp2 = ([json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
                   for name in ("single.jsonl", "cp2.jsonl"))
    assert [r["step"] for r in cp2] == [r["step"] for r in single] == [1, 2, 3]
    for got, want in zip(cp2, single):
        assert got["layout"]["cp"] == 2 and got["tokens"] == want["tokens"] == 4 * 16
        for key in ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), f"step {want['step']} {key}"
