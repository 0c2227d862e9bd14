"""Two MoE terms by hand, on DGX Cloud's Grok-1 run (benchmarks/data/dgxc_heldout.csv): expert tensor
parallelism keeps each device's expert work (it computes 1/etp of the width for etp times the tokens), and
a dispatch padded to capacity pays no fixed cost per pass (no token-count sync) and computes the capacity."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from moetrain.planner.calibration import Efficiency
from moetrain.planner.layer_costs import layer_costs
from moetrain.planner.validation import PreparedRow, prepare_row, read_rows

DGXC = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "dgxc_heldout.csv"
# H100: 989.4 TFLOP/s bf16 at gemm_max 0.7; 3.35 TB/s at memory 0.7; 10 µs per GEMM call; 1.5 ms per MoE pass
EFF = Efficiency(gemm_max=0.7, memory=0.7, gemm_overhead_us=10.0, moe_overhead_us=1500.0)
RATE, BANDWIDTH = 989.4e12 * 0.7, 3.35e12 * 0.7


def _grok(row_id: str = "DGXC-GROK1-BF16-32") -> PreparedRow:
    row = prepare_row(next(r for r in read_rows(DGXC) if r["id"] == row_id))
    assert isinstance(row, PreparedRow)
    return row


def _experts_by_hand(pairs: float, width: float, h: int = 6144) -> float:
    """Forward seconds of one resident expert (SwiGLU: 3 matrices of h × width) over ``pairs`` routed tokens."""
    params = 3 * h * width
    math = 2.0 * params * (pairs + 64) / RATE + 3 * 10e-6  # half a 128-row tile of padding
    reads = (params * 2.0 + pairs * (2 * h + 3 * width) * 2.0) / BANDWIDTH
    return max(math, reads) + pairs * width * 2.0 * 3 / BANDWIDTH


@pytest.mark.parametrize("etp", [1, 2, 4])
def test_expert_tensor_parallelism_keeps_each_devices_work(etp: int) -> None:
    # The 4-layer proxy: seq 4096, micro-batch 1, TP 4 with sequence parallelism, EP 8 over 8 experts (one per
    # device). A device routes 4096/4 = 1,024 tokens to 2 experts each: 2,048 pairs. Its etp group gathers
    # them (Megatron-Core's dispatcher all-gathers the received tokens over the group), so each device runs
    # its expert's 32768/etp columns for 2,048·etp pairs.
    row = _grok()
    assert row.workload.model.moe.expert_ffn_hidden == 32768 and int(row.strategy.tp[0]) == 4
    strategy = replace(row.strategy, etp=np.array([etp]))
    layer = layer_costs(row.workload, strategy, EFF, True, 128)
    assert float(layer.experts[0]) == pytest.approx(_experts_by_hand(2048 * etp, 32768 / etp), rel=1e-9)


def test_padded_dispatch_pays_no_fixed_cost_per_pass() -> None:
    row = _grok()
    assert row.workload.moe_padded_to_capacity  # the recipe's moe_pad_expert_input_to_capacity
    padded = layer_costs(row.workload, row.strategy, EFF, True, 128)
    dropless = layer_costs(replace(row.workload, moe_padded_to_capacity=False), row.strategy, EFF, True, 128)
    assert float(padded.moe_pass) == 0.0 and float(dropless.moe_pass) == pytest.approx(1.5e-3)
    # the forward pays the 1.5 ms once, the backward twice (its input and weight gradients' passes)
    assert float(dropless.fwd[0] - padded.fwd[0]) == pytest.approx(1.5e-3, rel=1e-9)
    assert float(dropless.compute[0] - padded.compute[0]) == pytest.approx(3 * 1.5e-3, rel=1e-9)


@pytest.mark.parametrize(("statement", "load", "padded"), [
    ("experts padded to capacity (capacity factor 1.0)", 1.0, True),
    ("experts padded to capacity (capacity factor 1.25)", 1.25, True),
    ("MoE routing and token dropping not stated", 1.0, False),
])
def test_the_source_states_the_capacity(statement: str, load: float, padded: bool) -> None:
    # Padded to capacity, every expert computes (and receives) the capacity: the factor times the balanced load.
    raw = next(r for r in read_rows(DGXC) if r["id"] == "DGXC-GROK1-BF16-32")
    row = prepare_row(raw | {"source": f"training step time 10.64 s; {statement}"})
    assert isinstance(row, PreparedRow)
    assert row.workload.imbalance == load and row.workload.moe_padded_to_capacity is padded
    balanced = layer_costs(replace(row.workload, imbalance=1.0), row.strategy, EFF, True, 128)
    got = layer_costs(row.workload, row.strategy, EFF, True, 128)
    assert float(got.experts[0]) == pytest.approx(_experts_by_hand(2048 * 4 * load, 32768 / 4), rel=1e-9)
    assert float(got.experts[0]) >= float(balanced.experts[0])
