"""The default model exports (issue 45, item 5): a Pangu-style model (sandwich norm, MLA, sigmoid router,
shared expert, MTP) saves as a Hugging Face folder with its own modeling code, which transformers loads
offline with ``trust_remote_code=True`` and which computes moetrain's logits (fp32, CPU: the largest difference
within 1e-5 of the largest logit, or of 1 when the logits are smaller).
``moetrain convert --to-hf`` reads the model from the checkpoint itself."""

from __future__ import annotations

import json
import random

import pytest
import torch

from moetrain.cli import main
from moetrain.config import load_model_config
from moetrain.config.model import ModelConfig
from moetrain.hf import load_pretrained, save_pretrained
from moetrain.hf.converted_checkpoint import read_checkpoint_model, write_converted_checkpoint
from moetrain.models import build_model
from refusals import refused

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
"""Largest logit difference over max(1, largest |logit|), fp32 on CPU: float rounding only (tied embeddings of
std 0.5 make logits of about 25, whose rounding is 25 times that of logits about 1)."""
WORDS = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in", "mind"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path_factory):
    """Nothing may come from the network: the folder carries everything transformers needs."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "moetrain-cache"))


def _variant(**changes) -> ModelConfig:
    """tiny-pangu with some fields changed (``router`` changes go to moe.router)."""
    data = load_model_config("tiny-pangu").model_dump()
    data["moe"]["router"].update(changes.pop("router", {}))
    data.update(changes)
    return ModelConfig.model_validate(data)


VARIANTS = {
    "tiny-pangu": {},
    # DeepSeek-V3's routing (score bias, expert groups) under sandwich norm
    "bias-and-groups": {"router": {"score_bias": True, "num_groups": 4, "num_top_groups": 2}},
    # pre-norm MLA with a norm eps DeepSeek-V3's code cannot take, softmax routing, no q latent
    "pre-norm-softmax": {"norm_style": "pre", "attention": {"kind": "mla", "num_heads": 4, "q_lora_rank": 0,
                                                            "kv_lora_rank": 32, "qk_nope_head_dim": 32,
                                                            "qk_rope_head_dim": 16, "v_head_dim": 32},
                         "router": {"score_function": "softmax", "normalize_top_k": False}},
    "yarn-tied": {"rope_scaling": {"factor": 4.0, "original_max_seq_len": 16, "mscale": 1.0, "mscale_all_dim": 1.0},
                  "tie_embeddings": True},
    "dense": {"moe": None, "num_dense_layers": 0, "num_mtp_layers": 0},
}


def _random_model(cfg: ModelConfig):
    """Weights with random norm gains and score biases, so that a swapped or skipped tensor shows."""
    model = build_model(cfg, seed=3).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
        for module in model.modules():
            if getattr(getattr(module, "cfg", None), "score_bias", False):
                module.score_bias.copy_(0.05 * torch.randn_like(module.score_bias))
    return model


def _load(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


def _max_diff(model, served, tokens: torch.Tensor) -> float:
    """The largest logit difference, relative to the logits' scale (``TOLERANCE``)."""
    with torch.no_grad():
        ours = model(tokens).logits
        return (ours - served(input_ids=tokens).logits).abs().max().item() / max(1.0, ours.abs().max().item())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_transformers_computes_moetrains_logits(variant, tmp_path):
    model = _random_model(_variant(**VARIANTS[variant]))
    out = save_pretrained(model, tmp_path / variant)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "moetrain_pangu" and config["architectures"] == ["MoetrainPanguForCausalLM"]
    assert config["auto_map"] == {"AutoConfig": "configuration_moetrain_pangu.MoetrainPanguConfig",
                                  "AutoModelForCausalLM": "modeling_moetrain_pangu.MoetrainPanguForCausalLM"}
    assert (out / "configuration_moetrain_pangu.py").is_file() and (out / "modeling_moetrain_pangu.py").is_file()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    assert _max_diff(model, _load(out), tokens) < TOLERANCE


def test_the_folder_reads_back_into_the_same_model_mtp_included(tmp_path):
    cfg = _variant(router={"score_bias": True})
    model = _random_model(cfg)
    out = save_pretrained(model, tmp_path / "hf")
    again, again_cfg = load_pretrained(out, name=cfg.name)
    assert again_cfg == cfg  # training-only settings (balance losses, init) travel in moetrain_training
    state = again.state_dict()
    assert any(name.startswith("mtp.") for name in state)
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


def test_generate_and_padding_agree_with_moetrain(tmp_path):
    model = _random_model(load_model_config("tiny-pangu"))
    served = _load(save_pretrained(model, tmp_path / "hf"))
    prompt = torch.randint(0, 2048, (1, 6), generator=torch.Generator().manual_seed(9))
    ids = prompt
    for _ in range(4):  # greedy decoding, by hand, with moetrain
        with torch.no_grad():
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(served.generate(prompt, max_new_tokens=4, do_sample=False), ids)
    # left padding: the padded row's real tokens get the unpadded logits
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(prompt)], dim=1)
    with torch.no_grad():
        got = served(input_ids=padded, attention_mask=mask).logits[:, 3:]
        assert (got - model(prompt).logits).abs().max().item() < TOLERANCE


def _corpus(folder):
    rng = random.Random(1)
    folder.mkdir()
    (folder / "play.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(3000)))
    return folder


@pytest.mark.slow
def test_convert_exports_a_trained_tiny_pangu_checkpoint_without_model(tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    assert main(["train", "--data", str(_corpus(tmp_path / "texts")), "--steps", "2", "--seq-len", "32",
                 "--global-batch", "4", "--micro-batch", "2", "--threads", "1", "--quiet", "--device", "cpu",
                 "--save-dir", str(ckpt)]) == 0
    capsys.readouterr()
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(out)]) == 0  # no --model: the checkpoint's own
    printed = capsys.readouterr().out
    assert f"wrote {out} (tiny-pangu, Hugging Face family moetrain_pangu)" in printed
    assert "trust_remote_code=True" in printed
    trained, _ = read_checkpoint_model(ckpt)
    tokens = torch.randint(0, trained.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    assert _max_diff(trained.eval(), _load(out), tokens) < TOLERANCE


def test_a_checkpoint_that_records_no_model_asks_for_it(tmp_path, capsys):
    cfg = load_model_config("tiny-pangu")
    ckpt = tmp_path / "ckpt"
    write_converted_checkpoint(build_model(cfg, seed=1), cfg, ckpt)
    (ckpt / "model.yaml").unlink()  # a converted checkpoint whose model.yaml was lost: its marker has no model
    refused(capsys, ["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "hf")],
            f"{ckpt / 'step-000000'} records no model", "pass --model with the preset or YAML")
    assert not (tmp_path / "hf").exists()


def test_sandwich_norm_with_gqa_is_refused(tmp_path):
    from moetrain.errors import UserError

    data = load_model_config("tiny-qwen3").model_dump()
    data["norm_style"] = "sandwich"
    with pytest.raises(UserError, match="norm_style='sandwich' with GQA attention has no Hugging Face family"):
        save_pretrained(build_model(ModelConfig.model_validate(data), device="meta"), tmp_path / "x")
