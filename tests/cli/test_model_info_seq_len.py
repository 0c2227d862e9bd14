"""model-info counts FLOPs at a stated sequence length: 4096 by default (the model's max when shorter)."""

from __future__ import annotations

import json

import pytest

from moetrain.cli import main
from moetrain.config import load_model_config
from moetrain.costs.flops import model_forward_flops
from refusals import refused


def test_flops_default_to_4096_tokens_and_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model-info", "--model", "pangu-ultra-moe-718b", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    cfg = load_model_config("pangu-ultra-moe-718b")
    assert (info["seq_len"], info["max_seq_len"]) == (4096, 131072)
    assert info["forward_flops_per_token"] == pytest.approx(model_forward_flops(cfg, 4096).forward)
    # at 4096 tokens the experts, not attention, dominate (at 131,072 attention's core was most of it)
    parts = info["forward_flops_by_part"]
    assert parts["experts"] > parts["attention_core"]
    assert main(["model-info", "--model", "pangu-ultra-moe-718b"]) == 0
    out = capsys.readouterr().out
    assert "forward FLOPs/token at seq_len 4,096" in out
    assert "FLOPs at seq_len 4,096 (--seq-len N for another, up to max_seq_len 131,072)" in out


def test_seq_len_flag_is_used_and_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model-info", "--model", "tiny-pangu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq_len"] == 1024  # the tiny model's max is below 4096
    assert main(["model-info", "--model", "tiny-pangu", "--seq-len", "64", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    cfg = load_model_config("tiny-pangu")
    assert info["seq_len"] == 64
    assert info["training_flops_per_token"] == pytest.approx(model_forward_flops(cfg, 64).training)
    refused(capsys, ["model-info", "--model", "tiny-pangu", "--seq-len", "5000"],
            "--seq-len 5000 must lie in 1..1,024 (the max_seq_len of tiny-pangu); give a length the model can run")
    refused(capsys, ["model-info", "--model", "tiny-pangu", "--seq-len", "0"], "--seq-len 0 must lie in 1..1,024")
