"""``moetrain plan`` ranks only layouts the runtime can run (``runtime_limits`` empty) unless asked with
``--any-layout``, and says when that costs it a faster layout; the vectorised mask of the search and
the scalar rules the runtime checks give the same answer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from moetrain.cli import main
from moetrain.config import ParallelConfig, load_cluster_config, load_model_config
from moetrain.config.parallel import runtime_limits
from moetrain.planner.calibration import load_calibration
from moetrain.planner.runnable import runnable_mask
from moetrain.planner.search import SearchOptions, SearchSpace, enumerate_strategies, search
from moetrain.planner.strategy import Strategies
from moetrain.planner.workload import Workload

QWEN = ["--model", "qwen3-30b-a3b", "--cluster", "h100-sxm-80gb", "--devices", "64", "--seq-len", "4096",
        "--global-batch", "256"]
MIXTRAL = ["--model", "mixtral-8x7b", "--cluster", "h100-sxm-80gb", "--devices", "64", "--seq-len", "4096",
           "--global-batch", "1024"]


@pytest.mark.parametrize(("model", "cluster", "devices", "batch"), [
    ("tiny-pangu", "cpu", 8, 16),
    ("qwen3-30b-a3b", "h100-sxm-80gb", 64, 256),
    ("mixtral-8x7b", "h100-sxm-80gb", 32, 64),
])
def test_the_search_mask_and_the_runtime_rules_agree(model: str, cluster: str, devices: int, batch: int) -> None:
    w = Workload(load_model_config(model), load_cluster_config(cluster), 4096, batch, "bf16", 1.0)
    layouts = Strategies.concat(list(enumerate_strategies(w, devices, SearchSpace())))
    rng = np.random.default_rng(0)
    sample = layouts.take(rng.choice(len(layouts), size=min(len(layouts), 3000), replace=False))
    rpn = w.cluster.devices_per_node
    mask = runnable_mask(sample, w.model.num_layers, batch, rpn)
    scalar = np.array([not runtime_limits(sample.to_parallel(i), w.model.num_layers, batch, rpn)
                       for i in range(len(sample))])
    assert (mask == scalar).all()
    assert mask.any() and (~mask).any()  # both kinds occur, so the agreement means something


def test_each_rule_names_its_dimension() -> None:
    limits = lambda **kw: runtime_limits(ParallelConfig(**kw), 48, 256, 8)  # noqa: E731
    assert limits(pp=4, vpp=8, dp=2) == []  # 32 chunks for 48 layers: an uneven split
    assert runtime_limits(ParallelConfig(pp=8, vpp=8), 61, 256, 8) == [
        "pp·vpp = 64 chunks for 61 layers: every chunk needs a layer; pick pp·vpp no larger than the layer count"]
    assert limits(pp=4, vpp=2, dp=2, micro_batch=43) == [
        "interleaving (vpp 2) needs the micro-batches per replica (2) to be a multiple of pp 4: change the "
        "micro-batch or vpp"]
    assert limits(tp=2, sp=False) == ["tp 2 without sequence parallelism: the runtime runs tp > 1 with sp only"]
    assert "etp 1 only" in limits(tp=2, sp=True, ep=4, etp=2, dp=4, a2a="hierarchical")[0]
    assert "fill whole nodes or sit inside one" in runtime_limits(
        ParallelConfig(dp=12, ep=12, a2a="hierarchical"), 48, 252, 8)[0]
    assert "without overlap only" in limits(dp=2, zero=3, overlap=True)[0]
    assert limits(tp=2, sp=True, pp=4, vpp=3, ep=8, dp=8, zero=3, a2a="hierarchical") == []


def test_the_qwen3_30b_plan_the_issue_named_now_runs(tmp_path) -> None:
    """pp4 × vpp8 (32 chunks for 48 layers) was the winner the runtime refused; it splits unevenly now. (Since
    the paired schedule hides the fixed cost per MoE pass, the search prefers an overlapped layout without a
    pipeline; the search's winner must run all the same.)"""
    named = ParallelConfig(pp=4, vpp=8, cp=4, dp=4, zero=2, micro_batch=8, recompute="selective")
    assert runtime_limits(named, 48, 256, 8) == []
    out = tmp_path / "plan.yaml"
    assert main(["plan", *QWEN, "--out", str(out)]) == 0
    plan = yaml.safe_load(out.read_text())
    assert runtime_limits(ParallelConfig(**plan["parallel"]), 48, 256, 8) == []
    assert plan["runtime_support"] == ["every dimension of this layout is executed by the runtime"]


def test_a_plan_says_what_the_runtime_limits_cost(tmp_path, capsys) -> None:
    out = tmp_path / "plan.yaml"
    assert main(["plan", *MIXTRAL, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    plan = yaml.safe_load(out.read_text())
    assert runtime_limits(ParallelConfig(**plan["parallel"]), 32, 1024, 8) == []
    # the cost model's favourite runs ZeRO-2 under the overlapped schedule, which the runtime cannot run
    assert "runtime limits: the fastest layout overall (" in text
    limits = plan["runtime_limits"]
    assert ("ZeRO-2 with the overlapped schedule: the runtime runs ZeRO-2/3 without overlap only (use zero 1 to "
            "overlap)") in limits
    assert "--any-layout ranks every layout" in text


def test_the_runtime_names_the_all_to_all_it_cannot_run_with_expert_tp() -> None:
    hierarchical_etp = ParallelConfig(tp=2, sp=True, ep=8, etp=2, dp=8, a2a="hierarchical")
    assert runtime_limits(hierarchical_etp, 32, 1024, 8) == [
        "the hierarchical all-to-all with etp 2: the runtime runs it with etp 1 only (or use the flat all-to-all)"]
    assert runtime_limits(hierarchical_etp.model_copy(update={"a2a": "flat"}), 32, 1024, 8) == []


def test_any_layout_ranks_what_the_runtime_cannot_run(tmp_path, capsys) -> None:
    assert main(["plan", *MIXTRAL, "--any-layout", "--json", "--out", str(tmp_path / "plan.yaml")]) == 0
    summary = json.loads(capsys.readouterr().out)
    winner = ParallelConfig(**summary["top"][0]["parallel"])
    assert runtime_limits(winner, 32, 1024, 8) != [] and summary["runnable_only"] is False
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert plan["runtime_support"] == runtime_limits(winner, 32, 1024, 8)


def test_when_nothing_runnable_fits_the_search_says_which_rule_blocks() -> None:
    """A dense model searched only over tensor parallelism without sequence parallelism."""
    w = Workload(load_model_config("tiny-pangu").model_copy(update={"moe": None, "num_dense_layers": 8,
                                                                    "dense_ffn_hidden": 256}),
                 load_cluster_config("cpu"), 128, 16, "bf16", 1.0)
    space = SearchSpace(tp=(2,), sp=(0,), cp=(1,), pp=(1,), zero=(1,))
    eff = load_calibration(None).for_device(w.cluster.device)
    result = search(w, 4, eff, SearchOptions(space, top_k=1))
    assert len(result.top) == 0 and result.excluded is not None
    assert result.excluded.reasons == ["tp 2 without sequence parallelism: the runtime runs tp > 1 with sp only"]
    anything = search(w, 4, eff, SearchOptions(space, top_k=1, runnable_only=False))
    assert len(anything.top) == 1
