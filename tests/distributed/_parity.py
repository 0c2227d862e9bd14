"""Shared by the distributed parity tests: they drive ``moetrain.train.Trainer`` (the loop and step that
``moetrain train`` runs, on the real data pipeline) under several layouts side by side in one gloo world,
and compare each with the single-process run of the same loop.

A small word-salad corpus stands in for Shakespeare: the tokenizer, packing and per-step batches are the
product's, only faster to build. The parent prepares the data cache before the ranks fork, so the ranks
read it instead of racing to write it.
"""

from __future__ import annotations

import copy
import io
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from moetrain.config import ModelConfig, ParallelConfig, TrainingConfig
from moetrain.config.run import RunSpec
from moetrain.distributed.layout import ParallelDims

WORDS = ["the", "king", "and", "queen", "of", "denmark", "speak", "love", "death", "honour", "night",
         "crown", "ghost", "sword", "my", "lord", "good", "sir", "what", "say", "you", "now", "mark", "me"]
LOSS_FIELDS = ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm")


def write_corpus(folder: Path) -> Path:
    """A JSONL corpus of documents of varied length (so packed sequences cross document boundaries)."""
    import json

    rng = random.Random(0)
    path = folder / "docs.jsonl"
    rows = [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))) + "."} for _ in range(120)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def run_spec(training: TrainingConfig, parallel: ParallelConfig, data: Path | None, **run) -> RunSpec:
    """The spec of one layout (``parallel``'s micro-batch is the training's)."""
    layout = parallel.model_dump(exclude={"sp", "micro_batch"})
    source = {"model": "tiny-pangu", "training": training.model_dump(), "parallel": layout,
              "run": {"device": "cpu", "quiet": True, "data": str(data) if data else None,
                      "synthetic_data": data is None, "cluster": "cpu", **run}}
    return RunSpec(**source)


def train_rows(spec: RunSpec, dims: ParallelDims | None = None, model_cfg: ModelConfig | None = None,
               model: torch.nn.Module | None = None) -> list[dict]:
    """Every metrics row of ``Trainer(spec).train()`` (this rank's copy; identical on every rank)."""
    from moetrain.train import SuppliedParts, Trainer

    trainer = Trainer(spec, SuppliedParts(dims=dims, model_cfg=model_cfg, model=model,
                                          console=Console(file=io.StringIO())))
    return trainer.train()


def single_process_rows(spec: RunSpec, **kwargs) -> list[dict]:
    """The one-process run of the same loop, on one torch thread (as each gloo rank runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_rows(spec, **kwargs)
    finally:
        torch.set_num_threads(threads)


@dataclass
class ReferenceRuns:
    """The single-process runs of the parity tests, by training config: several modules compare against
    the same one, and it is the same computation each time (the same loop on the same corpus)."""

    data: Path | None = None
    runs: dict[tuple[str, str], list[dict]] = field(default_factory=dict)

    def rows(self, training: TrainingConfig) -> list[dict]:
        """``single_process_rows`` of ``training`` with every degree 1 (a copy: callers may edit it)."""
        key = (training.model_dump_json(), str(self.data))
        if key not in self.runs:
            self.runs[key] = single_process_rows(run_spec(training, ParallelConfig(), self.data))
        return copy.deepcopy(self.runs[key])


def losses_by_layout(per_rank: list[dict[str, list[dict]]]) -> dict[str, list[list[dict]]]:
    """Each rank's ``{layout: rows}`` (``spawn``'s results) → ``{layout: [rows of each member rank]}``."""
    by_layout: dict[str, list[list[dict]]] = {}
    for rank_rows in per_rank:
        for name, rows in rank_rows.items():
            by_layout.setdefault(name, []).append(rows)
    return by_layout


def assert_parity(name: str, per_rank: list[list[dict]], reference: list[dict], ranks: int,
                  fields: tuple[str, ...] = ("loss",), rel: float = 1e-4) -> None:
    """Every one of the layout's ``ranks`` reports the same rows, each field within ``rel`` of the reference."""
    assert len(per_rank) == ranks, f"{name}: {len(per_rank)} ranks reported, expected {ranks}"
    for rows in per_rank:
        assert [r["loss"] for r in rows] == [r["loss"] for r in per_rank[0]], f"{name}: ranks disagree"
        assert [r["step"] for r in rows] == [r["step"] for r in reference], f"{name}: steps differ"
        for got, want in zip(rows, reference):
            for key in fields:
                assert abs(got[key] - want[key]) <= rel * abs(want[key]), \
                    f"{name} step {got['step']} {key}: {got[key]} vs {want[key]}"


def side_by_side(layouts: dict[str, ParallelConfig], rank: int,
                 ranks_per_node: int | None = None) -> list[tuple[str, ParallelConfig, ParallelDims]]:
    """The layouts this rank belongs to, placed one after another on the world's ranks. Every rank calls
    this with the same layouts (``ParallelDims.build`` creates every group on every rank)."""
    offset, members = 0, []
    for name, parallel in layouts.items():
        members.append((name, parallel, ParallelDims.build(parallel, rank, ranks_per_node, rank_offset=offset)))
        offset += parallel.world_size
    return [(name, parallel, dims) for name, parallel, dims in members if dims.is_member]
