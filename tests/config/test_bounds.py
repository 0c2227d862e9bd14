"""The bounds of a model's sizes and the devices a run takes: every preset sits an order of magnitude under
each bound, and a value past one is refused in one line naming the field and the bound."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moetrain.config import limits, load_model_config, model_presets
from moetrain.config.run import is_device, resolve_run_spec
from moetrain.errors import UserError

BOUNDED = {
    "hidden_size": limits.MAX_HIDDEN, "num_layers": limits.MAX_LAYERS, "num_mtp_layers": limits.MAX_LAYERS,
    "vocab_size": limits.MAX_VOCAB, "max_seq_len": limits.MAX_CONTEXT, "dense_ffn_hidden": limits.MAX_FFN_HIDDEN,
    "moe.expert_ffn_hidden": limits.MAX_FFN_HIDDEN, "moe.num_experts": limits.MAX_EXPERTS,
    "moe.num_shared_experts": limits.MAX_EXPERTS, "attention.num_heads": limits.MAX_HEADS,
    "attention.num_kv_heads": limits.MAX_HEADS, "attention.head_dim": limits.MAX_HEAD_DIM,
    "attention.q_lora_rank": limits.MAX_HEAD_DIM, "attention.kv_lora_rank": limits.MAX_HEAD_DIM,
    "attention.qk_nope_head_dim": limits.MAX_HEAD_DIM, "attention.qk_rope_head_dim": limits.MAX_HEAD_DIM,
    "attention.v_head_dim": limits.MAX_HEAD_DIM, "rope_scaling.original_max_seq_len": limits.MAX_CONTEXT,
}
"""Each bounded size of ``ModelConfig`` (dotted path) and its bound."""


def _at(data: dict, path: str) -> int | None:
    for key in path.split("."):
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


@pytest.mark.parametrize("name", model_presets())
def test_every_preset_sits_an_order_of_magnitude_under_each_bound(name: str) -> None:
    data = load_model_config(name).model_dump()
    for path, bound in BOUNDED.items():
        value = _at(data, path)
        assert value is None or 10 * value <= bound, (path, value, bound)


def _model_file(tmp_path: Path, section: str | None, **sizes: int) -> str:
    data = load_model_config("tiny-pangu").model_dump(mode="json")
    (data[section] if section else data).update(sizes)
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    ("section", "field", "value", "message"),
    [
        (None, "vocab_size", 10**9, "vocab_size: Input should be at most 4,194,304 (sixteen times the largest "
         "published vocabulary, 262,144), got 1000000000"),
        ("moe", "num_experts", 2**20, "moe.num_experts: Input should be at most 65,536 (thirty-two times the most "
         "experts published, Switch-C's 2,048), got 1048576"),
        ("attention", "kv_lora_rank", 10**6, "attention.mla.kv_lora_rank: Input should be at most 16,384 (ten times "
         "the widest head or latent dimension published, 1,536), got 1000000"),
        (None, "max_seq_len", 10**10, "max_seq_len: Input should be at most 134,217,728 (thirteen times the longest "
         "published context, 10M tokens), got 10000000000"),
    ],
)
def test_a_size_past_its_bound_is_one_line_naming_the_field_and_the_bound(tmp_path: Path, section: str | None,
                                                                          field: str, value: int,
                                                                          message: str) -> None:
    path = _model_file(tmp_path, section, **{field: value})
    with pytest.raises(UserError) as caught:
        load_model_config(path)
    assert str(caught.value) == f"{path}: {message}"


def test_a_size_at_its_bound_loads(tmp_path: Path) -> None:
    path = _model_file(tmp_path, None, hidden_size=limits.MAX_HIDDEN, num_layers=limits.MAX_LAYERS)
    assert load_model_config(path).hidden_size == limits.MAX_HIDDEN


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_the_documented_devices_are_taken(device: str) -> None:
    assert is_device(device)
    assert resolve_run_spec([{"run": {"device": device}}]).run.device == device


@pytest.mark.parametrize("device", ["tpu", "CUDA", "cuda:", "cuda:x", "cuda:0:1", "mps", "", " cpu"])
def test_any_other_device_is_one_line_listing_the_devices(device: str) -> None:
    assert not is_device(device)
    with pytest.raises(UserError) as caught:
        resolve_run_spec([{"run": {"device": device}}], names=["run.yaml"])
    assert str(caught.value) == (f"run.yaml: run.device: Input should be 'auto', 'cpu', 'cuda' or 'cuda:N' "
                                 f"(N: a GPU's index), got \"{device}\"")
