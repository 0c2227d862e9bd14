"""Checkpoint layouts (sharded, fused experts) and one-line refusals naming what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_reference import make_reference, reference_logits
from safetensors.torch import load_file, save_file

from moetrain.config import load_model_config
from moetrain.errors import UserError
from moetrain.hf import load_pretrained, model_config_from_hf, save_pretrained
from moetrain.models import build_model

transformers = pytest.importorskip("transformers")


def _edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_sharded_save_loads_in_both(tmp_path, random_tokens) -> None:
    reference, folder = make_reference("qwen3_moe", tmp_path)
    model, _ = load_pretrained(folder)
    out = save_pretrained(model, tmp_path / "sharded", max_shard_bytes=20_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 3 and set(index["weight_map"].values()) == set(shards)
    expected = reference_logits(reference, random_tokens)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert (reference_logits(reloaded, random_tokens) - expected).abs().max().item() < 1e-4
    ours, _ = load_pretrained(out)
    with torch.no_grad():
        assert (ours(random_tokens).logits - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_fused_expert_layout_loads(family: str, tmp_path, random_tokens) -> None:
    """transformers 5 keeps experts fused in memory (gate_up_proj [E, 2F, D], down_proj [E, D, F]);
    a checkpoint written from that state dict loads the same."""
    reference, folder = make_reference(family, tmp_path)
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(folder / "config.json", fused / "config.json")
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"))
    model, _ = load_pretrained(fused)
    with torch.no_grad():
        diff = (model(random_tokens).logits - reference_logits(reference, random_tokens)).abs().max().item()
    assert diff < 1e-4


def test_bf16_checkpoint_is_cast_on_load(tmp_path) -> None:
    _, folder = make_reference("mixtral", tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    model, _ = load_pretrained(folder)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    expected = tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"].to(torch.bfloat16).float()
    assert torch.equal(model.layers[0].moe.experts.w_down_EFD[3], expected.t())


def test_missing_tensor_is_named(tmp_path) -> None:
    _, folder = make_reference("mixtral", tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    missing = r"missing tensors: model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight$"
    with pytest.raises(UserError, match=missing):
        load_pretrained(folder)


def test_unknown_tensor_is_named(tmp_path) -> None:
    _, folder = make_reference("qwen3_moe", tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(48)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(UserError, match=r"does not know .*: model\.layers\.0\.self_attn\.q_proj\.bias$"):
        load_pretrained(folder)


def test_shape_mismatch_is_named(tmp_path) -> None:
    _, folder = make_reference("mixtral", tmp_path)
    _edit_config(folder, intermediate_size=32)
    with pytest.raises(UserError, match=r"experts.0.w1.weight has shape \[24, 32\], expected \[32, 32\]"):
        load_pretrained(folder)


@pytest.mark.parametrize(("family", "changes", "message"), [
    ("llama", {}, "model_type 'llama' is not supported; supported families: deepseek_v3, qwen3_moe, mixtral"),
    ("mixtral", {"sliding_window": 4096}, "mixtral config field sliding_window=4096 is not supported"),
    ("qwen3_moe", {"attention_bias": True}, "qwen3_moe config field attention_bias=True is not supported"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, r"qwen3_moe config field mlp_only_layers=\[1\] is not supported"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "qwen3_moe config field decoder_sparse_step=2 is not supported"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4}},
     "deepseek_v3 config field rope_parameters.rope_type='dynamic' is not supported"),
    ("deepseek_v3", {"rms_norm_eps": 1e-5}, "deepseek_v3 config field rms_norm_eps=1e-05 is not supported"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}},
     "deepseek_v3 config field quantization_config.quant_method='fp8' is not supported"),
    ("mixtral", {"hidden_act": "gelu"}, "mixtral config field hidden_act='gelu' is not supported"),
])
def test_unsupported_config_is_refused_in_one_line(family, changes, message, tmp_path) -> None:
    config = json.loads((make_reference(family if family != "llama" else "mixtral", tmp_path)[1]
                         / "config.json").read_text())
    config.update(changes)
    if family == "llama":
        config["model_type"] = "llama"
    with pytest.raises(UserError, match=message) as info:
        model_config_from_hf(config)
    assert "\n" not in str(info.value)


def test_missing_folder_pieces(tmp_path) -> None:
    with pytest.raises(UserError, match="is not a folder"):
        load_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        load_pretrained(tmp_path / "empty")


def test_export_refuses_what_no_family_represents(tmp_path) -> None:
    scaled = load_model_config("tiny-mixtral").model_copy(deep=True)
    router = scaled.moe.router.model_copy(update={"scaling_factor": 2.0})
    scaled = scaled.model_copy(update={"moe": scaled.moe.model_copy(update={"router": router})})
    with pytest.raises(UserError, match=r"cannot be exported as mixtral: scaling_factor=2.0 \(needs 1\)"):
        save_pretrained(build_model(scaled, device="meta"), tmp_path / "y")


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3"])
def test_presets_export_to_transformers(preset: str, tmp_path) -> None:
    """A model trained from scratch with moetrain is served by transformers with the same logits."""
    model = build_model(load_model_config(preset), seed=3)
    out = save_pretrained(model, tmp_path / preset)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 12))
    with torch.no_grad():
        diff = (model(tokens).logits - reloaded(input_ids=tokens).logits).abs().max().item()
    assert diff < 1e-4
