import json
import time
import warnings

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


def refused_within(capsys, argv: list[str], message: str, seconds: float = 2.0) -> None:
    """``moetrain argv`` exits 2 within ``seconds`` with stderr exactly ``moetrain balance: error: <message>``:
    one line, no warning above it (a numpy warning fails the test here: pytest would swallow its line)."""
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        code = main(argv)
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2 and err == f"moetrain balance: error: {message}\n", err
    assert elapsed < seconds, f"refused after {elapsed:.2f} s"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--balance-interval", "-1"], "--balance-interval -1: give a positive number of steps (default 5)"),
        (["--balance-interval", "0"], "--balance-interval 0: give a positive number of steps (default 5)"),
        (["--balance-horizon", "-1"], "--balance-horizon -1: give a positive number of steps (default 50)"),
        (["--seq-len", "0"], "--seq-len 0: give a positive number of tokens per sequence (default 4096)"),
    ],
)
def test_a_count_below_one_is_refused_before_the_replay(trace_file, capsys, extra, message):
    # a negative horizon once reached the forecast-error window as a numpy broadcast error, and a 0 printed
    # numpy's division warning above the refusal
    refused_within(capsys, ["balance", "--trace-routing", str(trace_file), "--ep", "4", "--cluster", "cpu", *extra],
                   message)


def test_the_exact_solver_replays_a_small_trace(trace_file, capsys):
    # its drift-triggered re-plans once asked the MILP for an incremental plan, which it has no form of
    assert main(["balance", "--trace-routing", str(trace_file), "--ep", "4", "--cluster", "cpu", "--solver", "milp",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["solver"] == "milp" and report["imbalance_before"] > report["imbalance_after"] >= 1.0


def test_the_exact_solver_refuses_a_large_instance(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    write_trace(zipf_trace(TraceShape(2, 1, 128, 16, 4096, 8), seed=0), path)
    refused_within(capsys, ["balance", "--trace-routing", str(path), "--ep", "16", "--cluster", "cpu", "--solver",
                            "milp"],
                   "--solver milp: 128 experts on 16 ranks are 2048 expert-rank pairs, more than the 1024 the exact "
                   "program is for (a replay solves every layer at every re-plan, each solve up to 10 s); use "
                   "--solver local", seconds=5.0)


@pytest.mark.parametrize(
    ("count", "message"),
    [
        ("Infinity", ":2: tokens_per_expert[1] is Infinity, not a whole number of tokens from 0 to 2^53; record it "
                     "again with `moetrain train --trace-routing FILE`"),
        ("NaN", ":2: tokens_per_expert[1] is NaN, not a whole number of tokens from 0 to 2^53; record it again with "
                "`moetrain train --trace-routing FILE`"),
        ("2.5", ":2: tokens_per_expert[1] is 2.5, not a whole number of tokens from 0 to 2^53; record it again with "
                "`moetrain train --trace-routing FILE`"),
    ],
)
def test_a_count_that_is_no_whole_number_is_refused_by_line(tmp_path, capsys, count, message):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"step": 0, "layer": 0, "tokens_per_expert": [1, 2]}\n'
                    f'{{"step": 1, "layer": 0, "tokens_per_expert": [1, {count}]}}\n', encoding="utf-8")
    refused_within(capsys, ["balance", "--trace-routing", str(path), "--ep", "2", "--cluster", "cpu"],
                   f"{path}{message}")


def test_a_trace_that_is_not_utf8_is_refused_by_line(trace_file, capsys):
    lines = trace_file.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b"}", b',"note":"M\xe9gatron"}')
    trace_file.write_bytes(b"\n".join(lines))
    column = len(lines[2].split(b"\xe9")[0]) + 1
    refused_within(capsys, ["balance", "--trace-routing", str(trace_file), "--ep", "4", "--cluster", "cpu"],
                   f"trace file {trace_file} is not UTF-8 text: byte 0xe9 at line 3, column {column}; save it as UTF-8 "
                   "or record it again with `moetrain train --trace-routing FILE`")
