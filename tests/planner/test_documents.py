"""Attention over packed documents, priced as the runtime computes it: the share of rows that hold a
boundary, the tiles the block mask skips (checked against a token-level mask), the masked kernels' factor
by hand, the cost model's core attention under it, and the flags that ask for it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moetrain.cli import main
from moetrain.config import load_cluster_config, load_model_config
from moetrain.planner.calibration import Efficiency
from moetrain.planner.documents import (
    OFFSETS,
    TILE,
    DocumentPacking,
    core_time_factor,
    dropped_tile_share,
    row_boundary_share,
)
from moetrain.planner.layer_costs import layer_costs
from moetrain.planner.strategy import Strategies
from moetrain.planner.workload import Workload

SMALL = str(Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "pangu-shaped-small.yaml")


def test_a_row_holds_a_boundary_as_often_as_it_reaches_past_its_document() -> None:
    assert row_boundary_share(4096, 8192) == pytest.approx(4095 / 8192)
    assert row_boundary_share(4096, 4095) == 1.0 and row_boundary_share(4096, 1000) == 1.0


def _dropped_by_tokens(seq_len: int, doc_len: float) -> float:
    """The same share from the token-level mask: a tile is kept when any of its (query, key) pairs is causal
    and within one document."""
    n = seq_len // TILE
    causal_tiles = n * (n + 1) / 2
    lowest = max(0.0, doc_len - (seq_len - 1))
    shares = []
    for offset in lowest + (np.arange(OFFSETS) + 0.5) / OFFSETS * (doc_len - lowest):
        doc = np.floor((offset + np.arange(seq_len)) / doc_len)
        allowed = np.tril(doc[:, None] == doc[None, :])
        kept = allowed.reshape(n, TILE, n, TILE).any(axis=(1, 3)).sum()
        shares.append(1.0 - kept / causal_tiles)
    return float(np.mean(shares))


@pytest.mark.parametrize("doc_len", [100.0, 300.0, 700.0, 2000.0])
def test_dropped_tiles_match_the_token_level_mask(doc_len: float) -> None:
    assert dropped_tile_share(1024, doc_len) == pytest.approx(_dropped_by_tokens(1024, doc_len), abs=1e-12)


def test_one_boundary_at_a_uniform_place_drops_a_third_of_a_long_rows_tiles() -> None:
    # a boundary at u·S hides the (1 − u)S × uS rectangle of the causal S²/2: 2u(1 − u), a third on average
    assert dropped_tile_share(131072, 1e7) == pytest.approx(1 / 3, rel=0.01)


def test_core_time_factor_by_hand() -> None:
    seq, doc, d = 4096, 16384.0, dropped_tile_share(4096, 16384.0)
    p = 4095 / 16384
    assert core_time_factor(seq, None, 3.0, 2.0) == 1.0
    # every row through the causal kernel, then the boundary rows (share p) through FlexAttention over their
    # kept tiles, at 3x the causal kernel's time per tile
    assert float(core_time_factor(seq, DocumentPacking(doc), 3.0, 2.0)) == pytest.approx(1 + p * 3.0 * (1 - d))
    # the dense mask: the whole square of 32 x 32 tiles against the causal 528, at 2x per tile
    assert float(core_time_factor(seq, DocumentPacking(doc, "dense"), 3.0, 2.0)) == pytest.approx(
        1 + p * 2.0 * 1024 / 528)


def _one(micro_batch: int) -> Strategies:
    def one(value: float | bool) -> np.ndarray:
        return np.array([value])

    return Strategies(tp=one(1), sp=one(False), pp=one(1), vpp=one(1), ep=one(1), etp=one(1), cp=one(1), dp=one(1),
                      zero=one(1), micro_batch=one(micro_batch), recompute=one(0.0), a2a=one(0), overlap=one(False))


def test_the_cost_model_prices_the_core_attention_under_the_documents() -> None:
    model, cluster = load_model_config(SMALL), load_cluster_config("h200-sxm-141gb")
    eff = Efficiency(attention_block_slowdown=3.0, attention_dense_slowdown=2.0)
    plain = Workload(model, cluster, 4096, 8)
    for mask in ("block", "dense"):
        packed = Workload(model, cluster, 4096, 8, documents=DocumentPacking(16384.0, mask))
        factor = core_time_factor(4096, packed.documents, 3.0, 2.0)
        with_docs = layer_costs(packed, _one(8), eff, moe_layer=True, num_micro=1)
        without = layer_costs(plain, _one(8), eff, moe_layer=True, num_micro=1)
        assert float(with_docs.parts.attention_core[0]) == pytest.approx(
            float(factor) * float(without.parts.attention_core[0]))
        # nothing else moves
        assert float(with_docs.parts.attention_projections[0]) == float(without.parts.attention_projections[0])
    # materialised scores (a CPU's fallback for unequal head dims) are the whole square whatever the mask
    cpu = load_cluster_config("cpu")
    scores = [layer_costs(Workload(load_model_config("tiny-pangu"), cpu, 128, 8, flash_attention=False,
                                   documents=docs), _one(4), eff, moe_layer=True, num_micro=1).attention_core
              for docs in (None, DocumentPacking(300.0, "dense"))]
    assert float(np.asarray(scores[0]).ravel()[0]) == float(np.asarray(scores[1]).ravel()[0])


ARGS = ["simulate", "--model", SMALL, "--cluster", "h200-sxm-141gb", "--devices", "1", "--seq-len", "4096",
        "--global-batch", "8", "--micro-batch", "8", "--json"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--document-mask", "block"], "--document-mask block prices packed documents: add --document-tokens L, their "
                                   "mean length in tokens"),
    (["--document-tokens", "0"], "--document-tokens is a mean document length in tokens and must be positive "
                                 "(got 0.0)"),
])
def test_document_flags_refused_in_one_line(extra: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, *extra]) == 2
    assert capsys.readouterr().err.strip() == f"moetrain simulate: error: {message}"


def test_simulate_prices_the_documents_it_is_told_of(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    cores = {}
    for name, extra in (("plain", []), ("block", ["--document-tokens", "8192"]),
                        ("dense", ["--document-tokens", "8192", "--document-mask", "dense"])):
        assert main([*ARGS, *extra]) == 0
        cores[name] = json.loads(capsys.readouterr().out)["attention_core_s"]
    # the boundary rows run again under the mask, at the causal kernel's time per tile while unmeasured: the
    # block mask over their kept tiles, the dense one over the whole square
    assert cores["plain"] < cores["block"] < cores["dense"]
