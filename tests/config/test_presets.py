import pytest

from moetrain.config import (
    ParallelConfig,
    cluster_presets,
    load_cluster_config,
    load_model_config,
    model_presets,
)
from moetrain.errors import UserError

REQUIRED_MODELS = {"pangu-ultra-moe-718b", "deepseek-v3-671b", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b",
                   "tiny-pangu", "tiny-qwen3", "tiny-mixtral"}
REQUIRED_CLUSTERS = {"atlas-800t-a2", "a100-sxm-80gb", "h100-sxm-80gb", "h800-sxm-80gb", "h200-sxm-141gb", "b200",
                     "gb200", "cpu"}


def test_every_required_preset_ships_and_validates():
    assert set(model_presets()) >= REQUIRED_MODELS
    assert set(cluster_presets()) >= REQUIRED_CLUSTERS
    for name in model_presets():
        assert load_model_config(name).name == name
    for name in cluster_presets():
        assert load_cluster_config(name).peak_tflops_bf16 > 0


@pytest.mark.parametrize("name", ["tiny-pangu", "tiny-qwen3", "tiny-mixtral"])
def test_tiny_presets_split_by_two_and_four(name):
    cfg = load_model_config(name)
    assert cfg.num_layers == 8 and 8 <= cfg.moe.num_experts <= 16
    assert cfg.num_layers % 4 == 0 and cfg.moe.num_experts % 4 == 0


def test_unknown_preset_is_one_line_error_naming_the_choices():
    with pytest.raises(UserError, match=r"unknown model preset 'tiny-gpt'; choose one of: .*tiny-pangu"):
        load_model_config("tiny-gpt")


def test_user_yaml_with_inconsistent_dims_names_the_field(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "vocab_size: 100\nhidden_size: 32\nnum_layers: 2\n"
        "attention: {kind: gqa, num_heads: 4, num_kv_heads: 3, head_dim: 8}\n"
        "moe: {num_experts: 4, expert_ffn_hidden: 8, router: {top_k: 2}}\n"
    )
    with pytest.raises(UserError) as err:
        load_model_config(str(path))
    message = str(err.value)
    assert "\n" not in message
    assert "num_heads=4 is not a multiple of num_kv_heads=3" in message


def test_user_yaml_loads(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "vocab_size: 100\nhidden_size: 32\nnum_layers: 2\n"
        "attention: {kind: gqa, num_heads: 4, num_kv_heads: 2, head_dim: 8}\n"
        "moe: {num_experts: 4, expert_ffn_hidden: 8, router: {top_k: 5}}\n"
    )
    with pytest.raises(UserError, match="top_k=5 exceeds moe.num_experts=4"):
        load_model_config(str(path))


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_model_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_model_config(str(bad))


def test_parallel_config_rejects_layouts_that_do_not_divide():
    with pytest.raises(ValueError, match="ep·etp=3 must divide tp·cp·dp=4"):
        ParallelConfig(tp=2, dp=2, ep=3)
    assert ParallelConfig(tp=2, dp=4, ep=8, pp=2).edp == 1
    assert ParallelConfig(tp=2, dp=4, pp=2).world_size == 16


def test_a_gpu_is_priced_by_the_preset_its_name_says():
    from moetrain.config import cluster_for_device, load_cluster_config

    assert cluster_for_device("NVIDIA H200") == "h200-sxm-141gb"
    assert cluster_for_device("NVIDIA H100 80GB HBM3") == "h100-sxm-80gb"
    assert cluster_for_device("NVIDIA GB200") == "gb200"  # not the B200 its name contains
    assert cluster_for_device("NVIDIA B200") == "b200"
    assert cluster_for_device("cpu") == "cpu"
    assert cluster_for_device("Tesla T4") == "h100-sxm-80gb"  # a name not listed
    assert load_cluster_config(cluster_for_device("NVIDIA H200")).hbm_gb == 141


def test_ranks_beyond_a_hosts_cores_share_them():
    from moetrain.config import load_cluster_config

    cpu = load_cluster_config("cpu").model_copy(update={"shared_host_slowdown": 1.0})  # a 2-core host, nominally
    four = cpu.for_ranks(4)
    assert (four.peak_tflops_bf16, four.hbm_bandwidth_tbps, four.hbm_gb, four.core_share) == (0.05, 0.01, 6.0, 0.5)
    two = cpu.for_ranks(2)  # a core each: only the memory is split
    assert (two.peak_tflops_bf16, two.hbm_bandwidth_tbps, two.hbm_gb, two.core_share) == (0.1, 0.02, 12.0, 1.0)
    assert cpu.for_ranks(1) == cpu and four.for_ranks(4) == four and four.unshared().peak_tflops_bf16 == 0.1


def test_ranks_that_keep_every_core_busy_pay_the_shared_host_slowdown():
    from moetrain.config import load_cluster_config

    cpu = load_cluster_config("cpu").model_copy(update={"shared_host_slowdown": 1.25})
    two = cpu.for_ranks(2)  # every core busy: the measured slowdown whole
    assert (two.peak_tflops_bf16, two.hbm_bandwidth_tbps, two.core_share) == pytest.approx((0.08, 0.016, 0.8))
    four = cpu.for_ranks(4)  # half a core each, and slowed
    assert (four.peak_tflops_bf16, four.core_share) == pytest.approx((0.04, 0.4))
    assert two.unshared().peak_tflops_bf16 == pytest.approx(0.1) and cpu.for_ranks(1) == cpu
    eight = load_cluster_config("cpu").model_copy(update={"host_cores": 8, "shared_host_slowdown": 1.7})
    # 3 ranks on 8 cores keep 2 of the 7 other cores busy: 2/7 of the slowdown
    assert eight.for_ranks(3).core_share == pytest.approx(1.0 / (1.0 + 0.7 * 2 / 7))
    h100 = load_cluster_config("h100-sxm-80gb")  # devices with compute and memory of their own
    assert h100.for_ranks(8) == h100
