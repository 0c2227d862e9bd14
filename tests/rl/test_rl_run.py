"""One RL run from its spec (``moetrain.rl.run.build_rl_run``): the warm-up's and GRPO's run specs every
process builds, and the checks that refuse a run before anything starts."""

from __future__ import annotations

import pytest

from moetrain.errors import UserError
from moetrain.rl.run import build_rl_run
from moetrain.rl.spec import RLRunSpec, read_spec, resolve_rl_spec, write_spec


def _run(source: dict, world_size: int | None = None):
    return build_rl_run(resolve_rl_spec([source], ["rl.yaml"], world_size))


def test_the_warm_up_and_grpo_runs_share_the_layout_and_save_beside_each_other(tmp_path):
    run = _run({"sft": {"steps": 12, "batch": 16, "lr": 1e-3},
                "rl": {"prompts_per_step": 4, "grpo": {"group_size": 4}},
                "trainer": {"training": {"steps": 3, "seed": 7}, "parallel": {"tp": 2},
                            "run": {"device": "cpu", "save_dir": str(tmp_path), "save_every": 1,
                                    "metrics_out": str(tmp_path / "m.jsonl")}}}, world_size=4)
    sft, grpo = run.sft, run.grpo
    assert sft is not None and sft.parallel == grpo.parallel and grpo.parallel.dp == 2 and grpo.parallel.sp
    assert (sft.training.steps, sft.training.global_batch, sft.training.micro_batch) == (12, 16, 8)
    assert sft.training.lr == 1e-3
    assert sft.training.warmup_steps == 12 and sft.training.seed == grpo.training.seed == 7
    assert sft.training.seq_len == grpo.training.seq_len and grpo.training.seq_len % 2 == 0
    assert (grpo.training.steps, grpo.training.global_batch, grpo.training.micro_batch) == (3, 16, 8)
    assert sft.run.save_dir == str(tmp_path / "sft") and grpo.run.save_dir == str(tmp_path / "rl")
    assert sft.run.metrics_out is None and sft.run.save_every == 0 and grpo.run.save_every == 1
    assert run.fusion == run.spec.generation and run.stale is None
    assert run.model_cfg.num_mtp_layers == 0  # the policy: no multi-token-prediction modules


def test_given_starting_weights_replace_the_warm_up():
    run = _run({"initial_weights": "/tmp/warm.pt", "stalesync": {"staleness": 1}})
    assert run.sft is None and run.spec.disaggregated and run.stale is not None and run.fusion is None


def test_colocated_k0_is_the_synchronous_loop():
    run = _run({"stalesync": {"staleness": 0, "placement": "colocated"}})
    assert run.stale is None and run.sft is not None


def test_the_spec_a_rank_reads_builds_the_same_run(tmp_path):
    spec = resolve_rl_spec([{"sft": {"steps": 2}, "trainer": {"parallel": {"ep": 2}}}], ["rl.yaml"], 2)
    assert build_rl_run(read_spec(write_spec(spec, tmp_path))) == build_rl_run(spec)


@pytest.mark.parametrize(("source", "world_size", "message"), [
    ({"rl": {"prompts_per_step": 3, "grpo": {"group_size": 2}}, "trainer": {"parallel": {"tp": 2}}}, 4,
     "6 samples per step (--prompts × --group-size) do not split over 4 generation replicas"),
    ({"generation": {"gen_ep": 3}, "sft": {"steps": 0}, "rl": {"prompts_per_step": 3, "grpo": {"group_size": 2}}}, 3,
     "--gen-ep 3: tiny-pangu's 16 experts do not divide by it"),
    ({"stalesync": {"staleness": 1, "placement": "colocated"}, "generation": {"offload": "always"}}, None,
     "--offload always"),
    ({"model": "no-such-model"}, None, "no-such-model"),
])
def test_what_cannot_run_is_refused_before_anything_starts(source, world_size, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _run(source, world_size)


def test_the_spec_defaults_build_a_run():
    run = build_rl_run(RLRunSpec())
    assert run.sft is not None and run.grpo.world_size == 1 and run.options.task == "addition"


def test_the_rl_launch_modules_import_one_way():
    """launch → ray_engine → worker → run, at module level and inside functions alike: no module of the
    chain imports one before it (a cycle here made the CLI's process and the ranks import each other)."""
    from test_layering import SRC, imports_of

    chain = ["launch", "ray_engine", "worker", "run"]
    for i, name in enumerate(chain):
        earlier = {f"moetrain.rl.{other}" for other in chain[:i + 1]}
        back = [str(edge) for edge in imports_of(SRC / "rl" / f"{name}.py")
                if any(edge.target == module or edge.target.startswith(module + ".") for module in earlier)]
        assert back == [], back
