"""Shared by the distributed parity tests: per-layout losses gathered from spawned ranks, the
single-process reference computed on one thread (as each gloo rank runs), and the parity check."""

from __future__ import annotations

import torch

from moetrain.config import ModelConfig, TrainingConfig
from moetrain.distributed.step import reference_losses


def losses_by_layout(per_rank: list[dict[str, list[float]]]) -> dict[str, list[list[float]]]:
    """Each rank's ``{layout: losses}`` (``spawn``'s results) → ``{layout: [losses of each member rank]}``."""
    by_layout: dict[str, list[list[float]]] = {}
    for rank_losses in per_rank:
        for name, losses in rank_losses.items():
            by_layout.setdefault(name, []).append(losses)
    return by_layout


def single_thread_reference(model_cfg: ModelConfig, training: TrainingConfig, steps: int, **kwargs) -> list[float]:
    """``reference_losses`` on one torch thread, restoring the thread count after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference_losses(model_cfg, training, steps, **kwargs)
    finally:
        torch.set_num_threads(threads)


def assert_parity(name: str, per_rank: list[list[float]], reference: list[float], ranks: int) -> None:
    """Every one of the layout's ``ranks`` reports the same losses, each within 1e-4 relative of the reference."""
    assert len(per_rank) == ranks
    for losses in per_rank:
        assert losses == per_rank[0], f"{name}: ranks of one layout disagree on the step loss"
        assert len(losses) == len(reference)
        for step, (got, want) in enumerate(zip(losses, reference)):
            assert abs(got - want) <= 1e-4 * abs(want), f"{name} step {step}: {got} vs {want}"
