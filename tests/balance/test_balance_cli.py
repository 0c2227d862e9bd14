import json

import pytest

from moetrain.balance.traces import TraceShape, write_trace, zipf_trace
from moetrain.cli import main


@pytest.fixture()
def trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(zipf_trace(TraceShape(30, 2, 16, 4, 4096, 4), exponent=1.2, seed=0), path)
    return path


def test_json_report(trace_file, capsys):
    assert main(["balance", "--trace-routing", str(trace_file), "--ep", "4", "--cluster", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "tiny-pangu"  # the preset with the trace's 16 experts
    assert report["slots_per_rank"] == 5
    assert report["imbalance_before"] > report["imbalance_after"] >= 1.0
    assert report["predicted_gain"] > 0.0
    assert isinstance(report["migrations"], list) and report["migrations"]
    assert all(m["migrate"] for m in report["migrations"])
    assert set(report["forecast_error"]) and report["predictor"] in report["forecast_error"]


def test_text_report(trace_file, capsys):
    assert main(["balance", "--trace-routing", str(trace_file), "--ep", "4", "--slots-per-rank", "6",
                 "--predictor", "ema:0.9", "--solver", "greedy", "--cluster", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "predictor: ema(theta=0.9)" in out
    assert "MIGRATE" in out and "predicted gain" in out


def test_spare_slot_choice(trace_file, capsys):
    assert main(["balance", "--trace-routing", str(trace_file), "--ep", "4", "--cluster", "cpu", "--spare-slots", "0,1",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    none, one = report["spare_slots"]["options"]
    assert (none["slots_per_rank"], one["slots_per_rank"]) == (4, 5)
    # one spare slot is the default layout: the same replay as the headline figures
    assert one["predicted_gain"] == pytest.approx(report["predicted_gain"], rel=1e-12)
    assert none["memory_bytes_per_rank"] == 0.0 and one["memory_bytes_per_rank"] > 0.0
    fastest = min(report["spare_slots"]["options"], key=lambda o: o["step_seconds"])
    recommended = report["spare_slots"]["recommended_spare_per_rank"]
    chosen = report["spare_slots"]["options"][recommended]
    assert chosen["step_seconds"] <= 1.005 * fastest["step_seconds"]
    assert recommended == 0 or none["step_seconds"] > 1.005 * fastest["step_seconds"]
    assert main(["balance", "--trace-routing", str(trace_file), "--ep", "4", "--cluster", "cpu",
                 "--spare-slots", "0,1"]) == 0
    assert f"recommended: {recommended} spare slot(s) per rank" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ep", "3"], "--ep 3 must divide the trace's 16 experts"),
        (["--ep", "4", "--predictor", "lstm"], "--predictor 'lstm': expected adaptive, auto, ema:THETA"),
        (["--ep", "4", "--model", "deepseek-v3-671b"], "model 'deepseek-v3-671b' has 256 experts, the trace 16"),
        (["--ep", "4", "--spare-slots", "1,x"], "--spare-slots '1,x': expected spare slot counts >= 0"),
        (["--ep", "4", "--slots-per-rank", "3"],
         "--slots-per-rank 3 cannot hold 16 experts on 4 ranks; give at least 4 (default 5: one spare slot for "
         "replicas)"),
        # no rank holds two replicas of an expert: more slots than experts stay empty (and a typo's table would
        # not fit in memory)
        (["--ep", "4", "--slots-per-rank", "9999999999"],
         "--slots-per-rank 9999999999: a rank holds at most one replica of each of the 16 experts; give at most 16 "
         "(default 5: one spare slot for replicas)"),
        (["--ep", "4", "--spare-slots", "0,13"],
         "--spare-slots 0,13: 13 spare slots beside the 4 experts each of 4 ranks holds exceed the 16 experts a rank "
         "can hold one replica each of; give at most 12"),
    ],
)
def test_errors_exit_2_with_one_line(trace_file, capsys, extra, message):
    assert main(["balance", "--trace-routing", str(trace_file), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
