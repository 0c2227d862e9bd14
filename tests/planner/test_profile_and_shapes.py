"""``moetrain profile`` writes a calibration the simulator loads; model-shape variants keep their compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.config import load_model_config
from moetrain.costs.params import count_params
from moetrain.planner.calibration import load_calibration
from moetrain.planner.model_search import _reshape


@pytest.mark.slow
def test_profile_writes_a_loadable_calibration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cpu.yaml"
    assert main(["profile", "--cluster", "cpu", "--device", "cpu", "--repeats", "1", "--threads", "1",
                 "--out", str(out)]) == 0
    measured = load_calibration(out).for_device("cpu")
    assert measured.gemm_max > 0 and measured.attention > 0 and measured.memory > 0
    capsys.readouterr()
    assert main(["simulate", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "1", "--seq-len", "128",
                 "--global-batch", "16", "--micro-batch", "4", "--precision", "fp32", "--calibration", str(out),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] > 0


def test_finer_experts_keep_activated_parameters() -> None:
    base = load_model_config("pangu-ultra-moe-718b")
    finer = _reshape(base, 512, base.hidden_size, base.num_layers)
    assert finer is not None and finer.moe is not None
    assert finer.moe.router.top_k == 16 and finer.moe.expert_ffn_hidden == 1024
    # Routed compute is kept exactly; the shared expert narrows with the experts (within 5 % overall).
    assert count_params(finer).active_experts == count_params(base).active_experts
    assert count_params(finer).active == pytest.approx(count_params(base).active, rel=0.05)
