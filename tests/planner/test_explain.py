"""``moetrain validate --explain ROW``: the terms add up to the predicted step, a hand-computed term and
sensitivity on a one-device dense row, and one-line errors for an unknown or unsimulable row."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.costs.flops import attention_core_flops
from moetrain.planner.calibration import load_calibration
from moetrain.planner.compute import attention_head_dim_factor
from moetrain.planner.explain import explain
from moetrain.planner.validation import prepare_row

HEADER = ("id,model,attention,ffn_act,layers,dense_layers,hidden,ffn_hidden,heads,kv_heads,head_dim,q_lora_rank,"
           "kv_lora_rank,qk_nope_dim,qk_rope_dim,v_head_dim,num_experts,topk,moe_ffn_hidden,shared_experts,vocab,"
           "seq_len,global_batch_seqs,hardware,num_devices,devices_per_node,tp,sp,pp,vpp,ep,etp,cp,dp,zero,"
           "micro_batch,recompute,precision,metric,value,flops_convention,source")
COLUMNS = HEADER.split(",")
# One H100 trains a 24-layer, 2048-wide GPT-style model (GeLU MLP, 16 heads of 128) on 8 sequences of 4096
# tokens in micro-batches of 2: no communication, no pipeline; only compute, the optimizer and nothing else.
ONE_DEVICE = dict(id="HAND-1", model="hand", attention="mha", ffn_act="gelu", layers="24", dense_layers="24",
                  hidden="2048", ffn_hidden="8192", heads="16", kv_heads="16", head_dim="128", vocab="32000",
                  seq_len="4096", global_batch_seqs="8", hardware="h100-sxm-80gb", num_devices="1",
                  devices_per_node="8", tp="1", pp="1", dp="1", zero="0", micro_batch="2", recompute="none",
                  precision="bf16", metric="tokens_per_s_per_device", value="10000", flops_convention="na",
                  source="hand-checked row")


def _write(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in COLUMNS})
    return path


def test_terms_add_up_and_attention_is_hand_computed() -> None:
    row = prepare_row(dict(ONE_DEVICE))
    calibration = load_calibration()
    eff = calibration.for_device("h100-sxm-80gb")
    e = explain(row, calibration)
    terms = {t.name: t.seconds for t in e.terms}
    assert sum(terms.values()) == pytest.approx(e.step_time_s, rel=1e-9)
    assert sum(t.share for t in e.terms) == pytest.approx(1.0)
    for name in ("TP collectives (exposed)", "expert all-to-all (exposed)", "PP bubble", "DP/ZeRO traffic (exposed)",
                 "routed experts (grouped GEMM)", "MoE fixed cost per pass", "recompute"):
        assert terms[name] == 0.0
    # fused attention by hand: causal core FLOPs of 2 × 4096 tokens at peak × attention efficiency (head dim
    # 128: factor 1), forward + 3 × backward, 24 layers, 4 micro-batches; the embedding's element-wise pass
    # (spread over the parts) is well under 1 % of a layer
    flops = attention_core_flops(row.workload.model, 4096, causal=True) * 2 * 4096
    core = flops / (989.4e12 * eff.attention * float(attention_head_dim_factor(128)))
    assert terms["fused attention"] == pytest.approx(4 * 24 * (1 + 3) * core, rel=0.01)
    # a tokens/s metric goes as 1/step and attention time as 1/attention, so d(error %)/d(log attention) =
    # (100 + error) × attention's share of the step
    share = terms["fused attention"] / e.step_time_s
    assert e.sensitivity["attention"] == pytest.approx((100 + e.error_pct) * share, rel=0.02)
    # nothing in this row moves with the links or the overlaps
    for name in ("bus_intra", "bus_inter", "grad_overlap", "tp_overlap", "moe_overhead_us"):
        assert abs(e.sensitivity[name]) < 1e-9


def test_explain_a_deepseek_row_names_its_terms(calibration_csv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(calibration_csv), "--explain", "DSV3-1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    terms = {t["name"]: t["seconds"] for t in out["terms"]}
    assert sum(terms.values()) == pytest.approx(out["step_time_s"])
    assert terms["routed experts (grouped GEMM)"] > 0 and terms["expert all-to-all (exposed)"] > 0
    assert terms["PP bubble"] > 0 and terms["MoE fixed cost per pass"] > 0
    assert set(out["sensitivity_pct_per_log"]) >= {"gemm_max", "attention", "moe_overhead_us", "bus_inter"}


def test_explain_refuses_unknown_and_unsimulable_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path / "rows.csv", [ONE_DEVICE, {**ONE_DEVICE, "id": "HAND-2", "num_devices": ""}])
    for row_id, expected in (("NOPE-7", "no row with that id"), ("HAND-2", "cannot be simulated")):
        assert main(["validate", str(path), "--explain", row_id]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and expected in err and row_id in err
    assert main(["validate", str(path), "--explain", "HAND-1"]) == 0
    out = capsys.readouterr().out
    assert "fused attention" in out and "sensitivity" in out
