"""The planner's commands: outputs, plan-file round trip and one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.config import load_plan_file
from moetrain.planner.calibration import accuracy_line, load_calibration
from moetrain.planner.search import TIE_TOLERANCE

TINY = ["--model", "tiny-pangu", "--cluster", "cpu", "--seq-len", "128", "--global-batch", "16"]


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert expected in err


def test_simulate_json_reports_breakdown(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *TINY, "--devices", "4", "--pp", "2", "--ep", "2", "--micro-batch", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parallel"]["dp"] == 2 and out["micro_batches_per_pipeline"] == 4
    assert out["step_time_s"] > 0 and 0 < out["mfu"] < 1
    assert out["tokens_per_s"] == pytest.approx(16 * 128 / out["step_time_s"])
    assert {"tensor_parallel", "all_to_all", "data_parallel", "pipeline_p2p"} <= set(out["communication_s"])
    assert out["memory_gib"]["total"] == pytest.approx(sum(v for k, v in out["memory_gib"].items() if k != "total"))
    assert 0 < out["bubble_s"] < out["step_time_s"]


def test_simulate_writes_timeline_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "t.png"
    assert main(["simulate", *TINY, "--devices", "2", "--pp", "2", "--overlap", "--timeline", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--devices", "3", "--tp", "2"], "--devices 3 is not divisible by tp·pp·cp = 2"),
        (["--devices", "2", "--ep", "3"], "--ep 3 does not divide the 16 experts"),
        (["--devices", "4", "--micro-batch", "3"], "is not a multiple of dp·micro-batch"),
        (["--devices", "0"], "--devices must be positive"),
        (["--devices", "2", "--recompute", "most"], "the simulator knows none, selective and full"),
    ],
)
def test_simulate_errors(capsys: pytest.CaptureFixture[str], extra: list[str], expected: str) -> None:
    _one_line_error(capsys, ["simulate", *TINY, *extra], expected)


def test_plan_writes_a_plan_the_runtime_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = tmp_path / "plan.yaml"
    assert main(["plan", *TINY, "--devices", "8", "--out", str(plan_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["candidates_evaluated"] > 1000 and summary["seconds"] > 0
    steps = [row["step_time_s"] for row in summary["top"]]
    memory = [row["memory_gib"] for row in summary["top"]]
    # Layouts within the tie tolerance of the fastest come first, least memory first; then by step time.
    tied = sum(step <= min(steps) * (1 + TIE_TOLERANCE) for step in steps)
    assert all(step <= min(steps) * (1 + TIE_TOLERANCE) for step in steps[:tied])
    assert memory[:tied] == sorted(memory[:tied]) and steps[tied:] == sorted(steps[tied:])
    plan = load_plan_file(str(plan_path))
    assert plan["parallel"].model_dump() == summary["top"][0]["parallel"]
    assert plan["parallel"].world_size == 8
    assert set(plan["predicted"]) == {"step_time_s", "mfu", "tokens_per_s", "memory_gib"}
    assert plan["runtime_support"]
    # The shipped calibration carries its cross-validation's fits: the plan says how the winner fares under each.
    check = summary["calibration_check"]
    assert check["held_out_fits"] == 7 and check["layouts_compared"] > len(summary["top"]) - 1
    assert plan["calibration_check"] == {k: v for k, v in check.items() if k != "seconds"}
    low, high = check["winner_step_time_s_range"]
    assert low <= high and check["max_winner_regret_pct"] >= 0


def test_plan_error_when_nothing_fits(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _one_line_error(capsys, ["plan", "--model", "pangu-ultra-moe-718b", "--cluster", "h100-sxm-80gb", "--devices",
                             "8", "--seq-len", "4096", "--global-batch", "8", "--out", str(tmp_path / "p.yaml")],
                    "no layout of pangu-ultra-moe-718b fits")


def test_output_files_get_their_folders_and_a_folder_given_as_a_file_is_refused(
        small_csv: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plan_path = tmp_path / "runs" / "a" / "plan.yaml"
    assert main(["plan", *TINY, "--devices", "2", "--out", str(plan_path)]) == 0
    assert load_plan_file(str(plan_path))["parallel"].tp >= 1
    png = tmp_path / "figures" / "t.png"
    assert main(["simulate", *TINY, "--devices", "2", "--pp", "2", "--timeline", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    # The check runs before the work: a fit or search that cannot write its result does not start.
    _one_line_error(capsys, ["plan", *TINY, "--devices", "2", "--out", str(tmp_path)],
                    f"--out {tmp_path} is a folder; name a file, e.g. {tmp_path / 'plan.yaml'}")
    _one_line_error(capsys, ["validate", str(small_csv), "--fit", str(tmp_path)], "--fit")
    _one_line_error(capsys, ["simulate", *TINY, "--devices", "2", "--timeline", str(tmp_path)], "is a folder")
    blocker = tmp_path / "a-file"
    blocker.write_text("kept")
    _one_line_error(capsys, ["plan", *TINY, "--devices", "2", "--out", str(blocker / "plan.yaml")],
                    "cannot create its folder")
    assert blocker.read_text() == "kept"


def test_validate_json_keys_and_unsimulable_rows(small_csv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(small_csv), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["summary"]) == {"median_abs_pct_error", "p90_abs_pct_error", "n"}
    assert out["summary"]["n"] == 3 == len(out["rows"])
    assert {r["id"] for r in out["rows"]} == {"NAR21-01", "VTRAIN-M-002", "MBR-1"}
    assert out["unsimulated"] == [{"id": "DSV2-1", "family": "DSV2", "reason": "no num_devices, tp in the row"}]
    for row in out["rows"]:
        assert row["abs_pct_error"] == pytest.approx(abs(row["predicted"] - row["measured"]) / row["measured"] * 100)


def test_validate_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _one_line_error(capsys, ["validate", str(tmp_path / "missing.csv")], "does not exist")
    bad = tmp_path / "bad.csv"
    bad.write_text("id,value\nX-1,3\n")
    _one_line_error(capsys, ["validate", str(bad)], "missing column(s)")
    _one_line_error(capsys, ["simulate", *TINY, "--devices", "2", "--calibration", str(tmp_path / "no.yaml")],
                    "calibration file")


@pytest.fixture
def each_fit_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fit_calibration`` fits the same rows with the same options once: a second ``validate --fit`` of the
    same file takes the first's parameters (under its own note) instead of repeating scipy's search, which is
    deterministic (the same start, the same evaluations) and takes about 14 CPU-seconds on these three rows.
    Only the search is shared: validate still writes the file, its accuracy and its held-out fits each time."""
    from dataclasses import replace

    from moetrain.planner import fit

    unshared, fitted = fit.fit_calibration, {}

    def fit_calibration(rows, note: str = "", **options):
        key = (tuple((r.row_id, r.metric, r.measured) for r in rows), repr(sorted(options.items())))
        if key not in fitted:
            fitted[key] = unshared(rows, note, **options)
        return replace(fitted[key], fitted_on=note)

    monkeypatch.setattr(fit, "fit_calibration", fit_calibration)


def test_a_fit_records_its_error_and_simulate_and_plan_print_it(small_csv: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  each_fit_once: None) -> None:
    pytest.importorskip("scipy")
    fitted = tmp_path / "fit.yaml"
    assert main(["validate", str(small_csv), "--fit", str(fitted), "--cv", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    accuracy = load_calibration(str(fitted)).accuracy
    assert accuracy == {"mode": "leave-one-family-out", "rows": 3, "file": "rows.csv",
                        "median_abs_pct_error": round(summary["median_abs_pct_error"], 2),
                        "p90_abs_pct_error": round(summary["p90_abs_pct_error"], 2)}
    assert main(["simulate", *TINY, "--devices", "2", "--calibration", str(fitted), "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["calibration_accuracy"] == accuracy
    # The same layout under each held-out fit: a fit with other efficiencies predicts another step time.
    held = simulated["step_time_s_held_out_fits"]
    assert list(held) == ["MBR", "NAR21", "VTRAIN-M"] and len(set(held.values())) == 3
    line = (f"calibration error on the 3 runs of rows.csv (leave-one-family-out): median "
            f"{accuracy['median_abs_pct_error']:.1f} %, 90th percentile {accuracy['p90_abs_pct_error']:.1f} %")
    assert main(["simulate", *TINY, "--devices", "2", "--calibration", str(fitted)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert line in out
    low, high = min(held, key=held.__getitem__), max(held, key=held.__getitem__)
    assert (f"step time under the 3 fits that each leave one source of published runs out: {held[low]:.4g}-"
            f"{held[high]:.4g} s (without {low} and without {high})") in out
    assert main(["plan", *TINY, "--devices", "2", "--calibration", str(fitted), "--out", str(tmp_path / "p.yaml")]) == 0
    out = capsys.readouterr().out
    assert line in out.splitlines()
    # The file keeps the cross-validation's fits, one per family left out; plan re-ranks under each.
    assert list(load_calibration(str(fitted)).held_out_fits) == ["MBR", "NAR21", "VTRAIN-M"]
    assert "  calibration check: re-ranked under the 3 fits that each leave one source of published runs out" in out
    # Without --cv the file says its error is in-sample and holds no held-out fits.
    assert main(["validate", str(small_csv), "--fit", str(fitted), "--json"]) == 0
    capsys.readouterr()
    assert load_calibration(str(fitted)).accuracy["mode"] == "in-sample"
    assert load_calibration(str(fitted)).held_out_fits == {}
    assert main(["plan", *TINY, "--devices", "2", "--calibration", str(fitted), "--out", str(tmp_path / "p.yaml"),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["calibration_check"] is None and summary["calibration_check_line"] is None
    assert main(["simulate", *TINY, "--devices", "2", "--calibration", str(fitted), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s_held_out_fits"] == {}


def test_the_shipped_calibration_states_its_cross_validated_error() -> None:
    accuracy = load_calibration().accuracy
    assert accuracy["mode"] == "leave-one-family-out" and accuracy["file"] == "calibration.csv"
    assert 0 < accuracy["median_abs_pct_error"] < accuracy["p90_abs_pct_error"] and accuracy["rows"] > 50
    assert accuracy_line(load_calibration().accuracy).startswith("calibration error on the")
    # One held-out fit per source family of calibration.csv with speed rows.
    assert sorted(load_calibration().held_out_fits) == ["DSV3", "MBR", "MEGH100", "MPT", "NAR21", "TT", "VTRAIN-M"]


def test_a_calibration_file_with_a_malformed_accuracy_is_refused(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("global: {gemm_max: 0.7}\naccuracy: 6.2\n")
    _one_line_error(capsys, ["simulate", *TINY, "--devices", "2", "--calibration", str(bad)],
                    "'accuracy' must be a mapping")


@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_a_plan_given_as_the_calibration_is_refused_before_any_search(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    from refusals import refused_within

    plan = tmp_path / "plan.yaml"
    plan.write_text("model: tiny-pangu\ncluster: cpu\ndevices: 2\nseq_len: 128\nglobal_batch: 16\n"
                    "parallel: {tp: 1, ep: 2}\n")
    out = ["--out", str(tmp_path / "out.yaml")] if command == "plan" else []
    refused_within(capsys, [command, *TINY, "--devices", "2", "--calibration", str(plan), *out],
                   f"{plan}: not a calibration file (it has model, cluster, devices, seq_len, …; a calibration file "
                   "has global and per_arch sections); write one with `moetrain profile --out FILE` or "
                   "`moetrain validate --fit FILE`", seconds=2.0)
    assert not (tmp_path / "out.yaml").exists()


def test_a_reader_that_closes_the_pipe_stops_the_command_quietly(tmp_path: Path) -> None:
    # `moetrain plan ... | head -1`: no traceback, and the exit status of a command stopped by SIGPIPE.
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "moetrain", "plan", *TINY, "--devices", "2", "--out",
                             str(tmp_path / "p.yaml")], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141
    assert stderr == ""


def test_ranks_sharing_a_hosts_cores_compute_no_faster_together(capsys):
    """dp2 on a 2-core host gives each rank a core for half the batch; dp4 gives each rank half a core for
    a quarter of it: the same compute per step, but for the fixed cost per GEMM of the calibration, which
    the ranks' fewer micro-batches pay less often (priced as four devices of their own, dp4 would take
    half of dp2's time)."""
    import json

    from moetrain.cli import main

    compute = {}
    for devices in (2, 4):
        assert main(["simulate", *TINY, "--devices", str(devices), "--micro-batch", "4", "--json"]) == 0
        compute[devices] = json.loads(capsys.readouterr().out)["compute_s"]
    # the fixed cost per MoE pass is paid per micro-batch: dp4's ranks run 1 each, dp2's 2
    assert compute[4]["moe_fixed"] == pytest.approx(compute[2]["moe_fixed"] / 2)
    work = {devices: sum(v for k, v in parts.items() if k != "moe_fixed") for devices, parts in compute.items()}
    assert work[4] == pytest.approx(work[2], rel=0.05)


def test_cpu_ranks_are_priced_as_this_runtime_trains_them(capsys: pytest.CaptureFixture[str]) -> None:
    """On CPU ranks (gloo, which only this runtime drives) simulate prices the runtime: ZeRO reduces after
    the backward, so none of the data-parallel traffic hides; tiny-pangu's q/k and v head dims differ, so
    torch's CPU attention materialises the scores. On GPUs the published stacks' overlap stays."""
    from moetrain.config import load_cluster_config, load_model_config
    from moetrain.planner.workload import Workload, runtime_workload

    def simulate(cluster: str) -> dict:
        assert main(["simulate", "--model", "tiny-pangu", "--seq-len", "128", "--global-batch", "16",
                     "--micro-batch", "8", "--devices", "2", "--cluster", cluster, "--zero", "1", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["communication_s"]["data_parallel"]

    cpu = simulate("cpu")
    assert cpu["total_s"] > 0 and cpu["exposed_s"] == cpu["total_s"]
    gpu = simulate("h100-sxm-80gb")
    assert gpu["exposed_s"] < gpu["total_s"]
    tiny, cpu_cluster = load_model_config("tiny-pangu"), load_cluster_config("cpu")
    assert tiny.attention.qk_head_dim != tiny.attention.v_head_dim
    assert not runtime_workload(Workload(tiny, cpu_cluster, 128, 16)).flash_attention
    assert runtime_workload(Workload(tiny, load_cluster_config("h100-sxm-80gb"), 128, 16)).flash_attention


def test_runtime_workload_keeps_the_asked_workload_and_sets_the_runtime():
    """``runtime_workload(w)``: ``w``'s model, cluster, batch, precision, imbalance and head share, the
    runtime's semantics, and the defaults on every other field whatever ``w`` says (``cli.workload`` on CPU
    ranks, ``rl_step.training_workload``)."""
    from dataclasses import fields

    from moetrain.config import load_cluster_config, load_model_config
    from moetrain.planner.workload import Workload, runtime_workload

    asked = Workload(load_model_config("tiny-pangu"), load_cluster_config("cpu"), 96, 12, "fp16", imbalance=1.25,
                     head_share=0.375, comm_overlap_stated=("DP",))
    run = runtime_workload(asked)
    runtime = {"flash_attention": False, "grad_bytes": 2.0, "overlap_grad_comm": False, "overlap_tp_comm": False,
               "async_tp_input_grad": False,
               "reduce_scatter_by_all_reduce": True, "project_tensor_parallel": True, "expert_count_exchange": True,
               "paired_count_sync_hidden": False}
    kept = {"model", "cluster", "seq_len", "global_batch", "precision", "imbalance", "head_share"}
    for f in fields(Workload):
        expected = getattr(asked, f.name) if f.name in kept else runtime.get(f.name, f.default)
        assert getattr(run, f.name) == expected, f.name
    assert (run.seq_len, run.global_batch, run.imbalance, run.head_share, run.comm_overlap_stated) == (
        96, 12, 1.25, 0.375, ())
    assert runtime_workload(Workload(asked.model, asked.cluster, 96, 12, "bf16")).grad_bytes == 4.0


def test_comm_overlap_flag_states_the_stack_overlap(capsys: pytest.CaptureFixture[str]) -> None:
    """--comm-overlap TP hides the TP collectives under the layer's compute, as a validate row stating MC2 or
    AsyncTP does; anything but TP/DP, or a CPU cluster, is refused in one line."""
    layout = ["--model", "qwen3-30b-a3b", "--cluster", "h100-sxm-80gb", "--devices", "8", "--seq-len", "4096",
              "--global-batch", "64", "--tp", "8", "--json"]
    assert main(["simulate", *layout]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["simulate", *layout, "--comm-overlap", "tp"]) == 0
    stated = json.loads(capsys.readouterr().out)
    tp_plain, tp_stated = (out["communication_s"]["tensor_parallel"]["exposed_s"] for out in (plain, stated))
    assert tp_plain > 0 and tp_stated < 0.1 * tp_plain
    assert stated["step_time_s"] < plain["step_time_s"]
    _one_line_error(capsys, ["simulate", *layout, "--comm-overlap", "TP,PP"], "PP is not TP or DP")
    _one_line_error(capsys, ["simulate", *TINY, "--devices", "2", "--comm-overlap", "DP"], "drop the flag")
