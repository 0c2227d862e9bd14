import json

import pytest

from moetrain.cli import main
from moetrain.cli.model_info import model_info
from moetrain.config import load_model_config
from moetrain.costs.params import count_params


def test_pangu_718b_json_matches_the_published_counts(capsys):
    assert main(["model-info", "--model", "pangu-ultra-moe-718b", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["total_params"] == pytest.approx(719e9, rel=0.002)  # SPEC §0: about 719B total
    assert info["active_params"] == pytest.approx(39.2e9, rel=0.002)  # and 39.2B active, without MTP
    assert info["parts_disagree"] == []
    assert info["training_flops_per_token"] == pytest.approx(3 * info["forward_flops_per_token"])


@pytest.mark.parametrize("name", ["tiny-pangu", "tiny-qwen3", "tiny-mixtral"])
def test_meta_count_equals_the_formula(name):
    info = model_info(name, seq_len=128)
    counts = count_params(load_model_config(name))
    assert info["parts_disagree"] == []
    assert (info["total_params"], info["active_params"]) == (counts.total, counts.active)
    assert info["total_params_with_mtp"] == counts.total_with_mtp


def test_tables_list_and_errors(capsys):
    assert main(["model-info", "--model", "tiny-pangu"]) == 0
    assert "active (without MTP)" in capsys.readouterr().out
    assert main(["model-info", "--list"]) == 0
    assert "pangu-ultra-moe-718b" in capsys.readouterr().out.split()
    assert main(["model-info", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown model preset 'no-such-model'" in err
    assert main(["model-info"]) == 2
    assert "give --model NAME" in capsys.readouterr().err


def test_a_module_that_disagrees_with_the_formulas_fails_loudly(monkeypatch, capsys):
    import moetrain.models

    real = moetrain.models.param_counts_by_part
    monkeypatch.setattr(moetrain.models, "param_counts_by_part", lambda m: {**real(m), "router": 1})
    assert main(["model-info", "--model", "tiny-pangu", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["parts_disagree"] == ["router"]
    assert main(["model-info", "--model", "tiny-pangu"]) == 1
    assert "disagree on router; this is a bug in moetrain" in capsys.readouterr().err
