"""``moetrain validate --explain ROW``: the terms add up to the predicted step, a hand-computed term and
sensitivity on a one-device dense row, and one-line errors for an unknown or unsimulable row; with --cv, the
held-out prediction is the cross-validation's and its move from the all-rows fit is split by parameter."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from moetrain.cli import main
from moetrain.costs.flops import attention_core_flops
from moetrain.planner.calibration import Calibration, load_calibration
from moetrain.planner.compute import ExpertShard, attention_speed_factor, expert_compute_time
from moetrain.planner.explain import UNEVEN_SPLIT, explain, explain_held_out
from moetrain.planner.fit import leave_one_family_out
from moetrain.planner.validation import prepare_all, prepare_row, read_rows

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
                 "routed experts (grouped GEMM)", "MoE fixed cost per pass", "recompute", "FP8 operand casts"):
        assert terms[name] == 0.0
    # fused attention by hand: causal core FLOPs of 2 × 4096 tokens at peak × attention efficiency (head dim
    # 128: factor 1), forward + 3 × backward, 24 layers, 4 micro-batches; the embedding's element-wise pass
    # (spread over the parts) is well under 1 % of a layer
    flops = attention_core_flops(row.workload.model, 4096, causal=True) * 2 * 4096
    core = flops / (989.4e12 * eff.attention * float(attention_speed_factor(128)))
    assert terms["fused attention"] == pytest.approx(4 * 24 * (1 + 3) * core, rel=0.01)
    # a tokens/s metric goes as 1/step and attention time as 1/attention, so d(error %)/d(log attention) =
    # (100 + error) × attention's share of the step
    share = terms["fused attention"] / e.step_time_s
    assert e.sensitivity["attention"] == pytest.approx((100 + e.error_pct) * share, rel=0.02)
    # nothing in this row moves with the links or the overlaps
    for name in ("bus_intra", "bus_inter", "grad_overlap", "tp_overlap", "moe_overhead_us"):
        assert abs(e.sensitivity[name]) < 1e-9


# One H100 trains 1 dense and 3 MoE layers (16 experts of 1024, top 4, a shared expert) on 8 sequences of
# 2048 tokens in micro-batches of 2.
DENSE_FIRST = {**ONE_DEVICE, "id": "HAND-3", "layers": "4", "dense_layers": "1", "num_experts": "16", "topk": "4",
               "moe_ffn_hidden": "1024", "shared_experts": "1", "seq_len": "2048"}


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_dense_first_moe_row_counts_its_moe_layers_by_hand(recompute: str) -> None:
    """The routed experts and the fixed cost per MoE pass come from the 3 MoE layers alone, forward and
    twice that backward (what full recompute runs again is the recompute term); the explanation once
    priced all 4 layers as MoE layers."""
    row = prepare_row({**DENSE_FIRST, "recompute": recompute})
    calibration = load_calibration()
    eff = calibration.for_device("h100-sxm-80gb")
    model = row.workload.model
    terms = {t.name: t.seconds for t in explain(row, calibration).terms}
    num_micro, tokens = 4, 2 * 2048
    expert_fwd = float(expert_compute_time(tokens * 4, model, row.workload.cluster, eff,
                                           ExpertShard(num_local_experts=16, etp=1)))
    assert terms["routed experts (grouped GEMM)"] == pytest.approx(num_micro * 3 * 3.0 * expert_fwd, rel=1e-9)
    assert terms["MoE fixed cost per pass"] == pytest.approx(num_micro * 3 * 3.0 * eff.moe_overhead_us * 1e-6,
                                                             rel=1e-9)
    if recompute == "full":  # the forward of every layer again, the experts' among it
        assert terms["recompute"] > num_micro * 3 * expert_fwd
    else:
        assert terms["recompute"] == 0.0
    assert UNEVEN_SPLIT not in terms and "other" not in terms


def test_an_uneven_pipeline_split_is_a_term_of_its_own() -> None:
    """5 dense layers over 2 stages: the parts are the mean rank's 2.5 layers; the slowest rank's third
    layer (less the head and embedding it balances against) is the uneven split's term."""
    even = explain(prepare_row({**ONE_DEVICE, "layers": "4", "dense_layers": "4", "num_devices": "2", "pp": "2"}),
                   load_calibration())
    uneven = explain(prepare_row({**ONE_DEVICE, "layers": "5", "dense_layers": "5", "num_devices": "2", "pp": "2"}),
                     load_calibration())
    assert UNEVEN_SPLIT not in {t.name for t in even.terms}
    terms = {t.name: t.seconds for t in uneven.terms}
    assert sum(terms.values()) == pytest.approx(uneven.step_time_s, rel=1e-9)
    assert terms[UNEVEN_SPLIT] > 0
    # the mean rank's 2.5 layers against the even split's 2: the layer parts scale by 5/4
    even_terms = {t.name: t.seconds for t in even.terms}
    assert terms["fused attention"] == pytest.approx(even_terms["fused attention"] * 5 / 4, rel=1e-9)


def test_explain_a_deepseek_row_names_its_terms(calibration_csv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(calibration_csv), "--explain", "DSV3-1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    terms = {t["name"]: t["seconds"] for t in out["terms"]}
    assert sum(terms.values()) == pytest.approx(out["step_time_s"])
    assert terms["routed experts (grouped GEMM)"] > 0 and terms["expert all-to-all (exposed)"] > 0
    assert terms["PP bubble"] > 0 and terms["MoE fixed cost per pass"] > 0
    assert terms["FP8 operand casts"] > 0  # DeepSeek-V3 trains its linears in FP8
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


def _with_held_out(calibration: Calibration, family: str, **changed: float) -> Calibration:
    held = replace(calibration, global_params=replace(calibration.global_params, **changed), held_out_fits={})
    return replace(calibration, held_out_fits={family: held})


def test_held_out_attention_alone_moves_the_error_as_its_share_says() -> None:
    row = prepare_row(dict(ONE_DEVICE))
    calibration = load_calibration()
    e_all = explain(row, calibration)
    terms = {t.name: t.seconds for t in e_all.terms}
    # the fit without HAND finds attention 1.25× faster: only the fused attention term shrinks, by 1/1.25,
    # and tokens/s goes as 1/step
    faster = calibration.global_params.attention * 1.25
    e = explain_held_out(row, _with_held_out(calibration, "HAND", attention=faster))
    step = e_all.step_time_s - terms["fused attention"] * (1 - 1 / 1.25)
    by_hand = (e_all.predicted * e_all.step_time_s / step - row.measured) / row.measured * 100
    h = e.held_out
    assert h is not None and h.family == "HAND"
    assert h.all_rows_error_pct == pytest.approx(e_all.error_pct)
    assert h.held_out_error_pct == pytest.approx(e.error_pct)
    assert e.error_pct - e_all.error_pct == pytest.approx(by_hand - e_all.error_pct, rel=0.01)
    assert [p.name for p in h.shifts] == ["attention"]
    assert h.shifts[0].all_rows == calibration.global_params.attention and h.shifts[0].held_out == faster
    assert h.shifts[0].alone_pct == pytest.approx(e.error_pct - e_all.error_pct)
    assert h.together_pct == pytest.approx(0.0, abs=1e-9)


def test_held_out_moves_add_up_and_rank_by_effect() -> None:
    row = prepare_row(dict(ONE_DEVICE))
    calibration = load_calibration()
    g = calibration.global_params
    # a link efficiency moves too, but a one-device row has no traffic: listed, no effect
    held = _with_held_out(calibration, "HAND", attention=g.attention * 1.25, memory=g.memory * 0.8,
                          bus_inter=g.bus_inter * 0.5)
    h = explain_held_out(row, held).held_out
    assert h is not None
    assert [p.name for p in h.shifts][-1] == "bus_inter" and h.shifts[-1].alone_pct == 0.0
    assert {p.name for p in h.shifts} == {"attention", "memory", "bus_inter"}
    assert abs(h.shifts[0].alone_pct) >= abs(h.shifts[1].alone_pct) > 0
    assert h.all_rows_error_pct + sum(p.alone_pct for p in h.shifts) + h.together_pct == pytest.approx(
        h.held_out_error_pct)


def test_explain_cv_predicts_as_the_cross_validation_does(calibration_csv: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(calibration_csv), "--explain", "DSV3-1", "--cv", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows, _ = prepare_all(read_rows(calibration_csv))
    calibration = load_calibration()
    cv = leave_one_family_out(rows, calibration.held_out_fits)
    index = [r.row_id for r in rows].index("DSV3-1")
    assert out["predicted"] == pytest.approx(float(cv[index]), rel=1e-9)
    assert out["held_out"]["family"] == "DSV3"
    all_rows = explain(rows[index], calibration)
    assert out["held_out"]["all_rows_error_pct"] == pytest.approx(all_rows.error_pct, rel=1e-9)


def test_explain_cv_refuses_a_calibration_without_the_family(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path / "rows.csv", [ONE_DEVICE])
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump({"global": {"attention": 0.5}, "per_arch": {}}))
    assert main(["validate", str(path), "--explain", "HAND-1", "--cv", "--calibration", str(plain)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "holds no fit without family HAND" in err and "--fit OUT.yaml --cv" in err
    assert main(["validate", str(path), "--explain", "HAND-1", "--fit", str(tmp_path / "out.yaml")]) == 2
    assert "drop --fit" in capsys.readouterr().err
    assert not (tmp_path / "out.yaml").exists()
