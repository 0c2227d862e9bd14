"""The RL step's measured host rates as a file (``planner.rl_rates``): ``moetrain profile --rl-out`` writes
it, ``moetrain simulate --rl --rl-rates`` prices generation's host work and the weight sync with it."""

from __future__ import annotations

import json

import pytest

from moetrain.cli import main
from moetrain.errors import UserError
from moetrain.planner.generation import HostCosts
from moetrain.planner.rl_rates import RLRates, load_rl_rates
from moetrain.planner.rl_step import SyncRates

RATES = RLRates(HostCosts(layer_forward_us=800.0, sample_ns_per_logit=30.0, host_is_device=True,
                          engine_step_us=500.0, engine_row_us=30.0),
                SyncRates(2e9, 1e9, 5e8), "by hand")
SIMULATE = ["simulate", "--rl", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "2", "--prompt-len", "10",
            "--response-len", "6", "--prompts", "4", "--group-size", "2", "--dtype", "fp32", "--json"]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_rates_file_round_trip(tmp_path, suffix):
    path = tmp_path / f"rates{suffix}"
    RATES.save(path)
    assert load_rl_rates(path) == RATES


def test_a_bad_rates_file_is_refused(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_rl_rates(tmp_path / "missing.yaml")
    path = tmp_path / "bad.yaml"
    path.write_text("host: {layer_forward_us: 1.0, warp_speed: 9}\nsync: {copy_bytes_per_s: 1, crc_bytes_per_s: 1}\n")
    with pytest.raises(UserError, match="'host' must be a mapping"):
        load_rl_rates(path)


def test_simulate_rl_prices_the_sync_with_the_measured_rates(tmp_path, capsys):
    path = tmp_path / "rates.yaml"
    RATES.save(path)
    assert main(SIMULATE) == 0
    without = {p["placement"]: p for p in json.loads(capsys.readouterr().out)["predictions"]}
    assert main([*SIMULATE, "--rl-rates", str(path)]) == 0
    with_rates = {p["placement"]: p for p in json.loads(capsys.readouterr().out)["predictions"]}
    # colocated on 2 devices: each packs and writes its whole model at the measured 0.5 GB/s
    assert with_rates["colocated"]["phases_s"]["reshard_s"] > without["colocated"]["phases_s"]["reshard_s"]
    assert all(with_rates[k]["step_s"] > without[k]["step_s"] for k in without)
    assert main([*SIMULATE, "--rl-rates", str(tmp_path / "missing.yaml")]) == 2
    assert "profile --rl-out" in capsys.readouterr().err
