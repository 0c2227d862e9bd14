"""The SC21 runs take the layout their launch script states (Megatron-LM examples/sc21/run_table_1.sh) where
their rows are silent; a stated cell and other sources' rows are left as they are."""

from __future__ import annotations

import pytest

from moetrain.planner.calibration import Efficiency
from moetrain.planner.costmodel import evaluate
from moetrain.planner.launch_facts import with_launch_facts
from moetrain.planner.validation import prepare_row, row_workload


def _rows(published_rows: list[dict]) -> dict[str, dict]:
    return {r["id"]: r for r in published_rows}


def test_sc21_rows_take_the_scripts_micro_batch_and_interleaving(published_rows: list[dict]) -> None:
    rows = _rows(published_rows)
    # run_table_1.sh: (MBS, layers per virtual stage) per size; stages per rank = layers / pp / that.
    expected = {"NAR21-01": (16, 1), "NAR21-04": (8, 1), "NAR21-05": (4, 1),
                "NAR21-06": (2, 60 // 4 // 5), "NAR21-07": (2, 80 // 8 // 5), "NAR21-08": (1, 96 // 16 // 3),
                "NAR21-09": (1, 105 // 35 // 1), "NAR21-10": (1, 1)}
    for row_id, (micro_batch, vpp) in expected.items():
        strategy = prepare_row(rows[row_id]).strategy
        assert (int(strategy.micro_batch[0]), int(strategy.vpp[0])) == (micro_batch, vpp), row_id
    stages = tuple(int(prepare_row(rows[i]).strategy.vpp[0]) for i in ("NAR21-06", "NAR21-07", "NAR21-08", "NAR21-09"))
    assert stages == (3, 2, 2, 3)


def test_torch_ddp_runs_overlap_their_gradient_reduction(published_rows: list[dict]) -> None:
    rows = _rows(published_rows)
    torch_ddp = prepare_row(rows["NAR21-01"])  # DDP=torch: bucketed all-reduce under the backward
    local_ddp = prepare_row(rows["NAR21-05"])  # DDP=local: all-reduce after the backward
    assert torch_ddp.workload.comm_overlap_stated == ("DP",) and torch_ddp.workload.overlap_grad_comm
    assert local_ddp.workload.comm_overlap_stated == () and not local_ddp.workload.overlap_grad_comm
    # The same row without the script's DDP mode exposes its whole all-reduce; with it, one layer's
    # chunk of 24 (the last bucket has no backward left to hide under).
    num_layers = torch_ddp.workload.model.num_layers
    silent = prepare_row({**rows["NAR21-01"], "id": "NAR21-X"})
    assert not silent.workload.overlap_grad_comm
    out_silent = evaluate(silent.workload, torch_ddp.strategy, Efficiency())
    out_stated = evaluate(torch_ddp.workload, torch_ddp.strategy, Efficiency())
    assert out_silent.dp.comm_s[0] > 0
    assert out_silent.dp.exposed_s[0] == pytest.approx(out_silent.dp.comm_s[0], rel=1e-12)
    assert out_stated.dp.exposed_s[0] == pytest.approx(out_stated.dp.comm_s[0] / num_layers, rel=1e-12)


def test_a_stated_cell_or_another_source_is_not_overwritten(published_rows: list[dict]) -> None:
    row = _rows(published_rows)["NAR21-06"]
    stated = with_launch_facts({**row, "micro_batch": "8", "vpp": "1"})
    assert (stated["micro_batch"], stated["vpp"]) == ("8", "1")
    other = {**row, "source": "a re-run of the same model elsewhere"}
    assert with_launch_facts(other) is other
    filled = with_launch_facts(row)
    assert filled["source"].endswith("from Megatron-LM examples/sc21/run_table_1.sh: micro_batch 2, vpp 3")
    assert row["micro_batch"] == "" and row["vpp"] == ""  # the caller's row is not changed


def test_every_stated_overlap_phrase_counts(published_rows: list[dict]) -> None:
    row = _rows(published_rows)["MEGH100-1"]
    prepared = prepare_row(row)
    both = {**row, "source": "TP comm overlap; later also DP comm overlap"}
    workload = row_workload(both, prepared.workload.model, prepared.workload.cluster)
    assert workload.comm_overlap_stated == ("DP", "TP")
