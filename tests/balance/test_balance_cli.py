import json

import pytest

from moetrain.balance.traces import write_trace, zipf_trace
from moetrain.cli import main


@pytest.fixture()
def trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(zipf_trace(30, 2, 16, 4096, 4, exponent=1.2, seed=0), path)
    return path


def test_json_report(trace_file, capsys):
    assert main(["balance", "--trace", str(trace_file), "--ep", "4", "--cluster", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "tiny-pangu"  # the preset with the trace's 16 experts
    assert report["slots_per_rank"] == 5
    assert report["imbalance_before"] > report["imbalance_after"] >= 1.0
    assert report["predicted_gain"] > 0.0
    assert isinstance(report["migrations"], list) and report["migrations"]
    assert all(m["migrate"] for m in report["migrations"])
    assert set(report["forecast_error"]) and report["predictor"] in report["forecast_error"]


def test_text_report(trace_file, capsys):
    assert main(["balance", "--trace", str(trace_file), "--ep", "4", "--slots-per-rank", "6",
                 "--predictor", "ema:0.9", "--solver", "greedy", "--cluster", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "predictor: ema(theta=0.9)" in out
    assert "MIGRATE" in out and "predicted gain" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ep", "3"], "--ep 3 must divide the trace's 16 experts"),
        (["--ep", "4", "--predictor", "lstm"], "--predictor 'lstm': expected auto, ema:THETA"),
        (["--ep", "4", "--model", "deepseek-v3-671b"], "model 'deepseek-v3-671b' has 256 experts, the trace 16"),
        (["--ep", "4", "--slots-per-rank", "3"],
         "slots_per_rank=3 is below the 4 experts each rank must hold; use at least 4"),
    ],
)
def test_errors_exit_2_with_one_line(trace_file, capsys, extra, message):
    assert main(["balance", "--trace", str(trace_file), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
