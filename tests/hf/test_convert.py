"""``moetrain convert`` both ways, and continued training: HF → moetrain → train 5 steps → HF."""

from __future__ import annotations

import json

import pytest
import torch
from hf_reference import make_reference, reference_logits

from moetrain.cli import main
from moetrain.hf import load_pretrained
from moetrain.hf.converted_checkpoint import read_checkpoint_model

transformers = pytest.importorskip("transformers")

BYTE_VOCAB = 320  # the trainer's byte tokenizer needs at least 257 ids


@pytest.mark.slow
def test_continued_training_round_trip(tmp_path, capsys) -> None:
    reference, hf_folder = make_reference("deepseek_v3", tmp_path, vocab_size=BYTE_VOCAB)
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "--from-hf", str(hf_folder), "--to", str(ckpt)]) == 0
    assert json.loads((ckpt / "step-000000" / "COMPLETE").read_text())["model_only"] is True

    # The converted checkpoint is the reference model: same logits before any training.
    tokens = torch.randint(0, BYTE_VOCAB, (2, 16))
    converted, _ = read_checkpoint_model(ckpt)
    with torch.no_grad():
        assert (converted(tokens).logits - reference_logits(reference, tokens)).abs().max().item() < 1e-4

    args = ["train", "--model", str(ckpt / "model.yaml"), "--save-dir", str(ckpt), "--resume", "--steps", "5",
            "--global-batch", "2", "--micro-batch", "1", "--seq-len", "32", "--device", "cpu", "--quiet",
            "--lr", "1e-3"]
    assert main(args) == 0
    assert "resumed from" in capsys.readouterr().out
    assert (ckpt / "step-000005" / "COMPLETE").is_file()

    out = tmp_path / "exported"
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(out), "--dtype", "fp32"]) == 0
    trained, _ = read_checkpoint_model(ckpt)
    changed = [n for n, p in trained.named_parameters() if not torch.equal(p, converted.state_dict()[n])]
    assert "layers.2.moe.experts.w_gate_EDF" in changed and "layers.0.attention.q_up.weight" in changed
    assert not torch.equal(trained.layers[1].moe.router.score_bias, converted.layers[1].moe.router.score_bias)

    served = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        diff = (trained(tokens).logits - reference_logits(served, tokens)).abs().max().item()
    assert diff < 1e-4
    # and the export reads back into moetrain unchanged
    again, _ = load_pretrained(out)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in trained.state_dict().items())


def test_convert_flag_errors(tmp_path, capsys) -> None:
    assert main(["convert", "--from-hf", str(tmp_path)]) == 2
    assert "--from-hf needs --to CKPT_DIR" in capsys.readouterr().err
    assert main(["convert", "--to-hf", str(tmp_path)]) == 2
    assert "--to-hf needs --out DIR" in capsys.readouterr().err
    assert main(["convert", "--to-hf", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


def test_convert_refuses_a_folder_with_checkpoints(tmp_path, capsys) -> None:
    _, hf_folder = make_reference("mixtral", tmp_path)
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "--from-hf", str(hf_folder), "--to", str(ckpt)]) == 0
    capsys.readouterr()  # transformers' progress bars while the reference was saved
    assert main(["convert", "--from-hf", str(hf_folder), "--to", str(ckpt)]) == 2
    assert capsys.readouterr().err == (f"moetrain convert: error: --to {ckpt} already holds model.yaml, step-000000; "
                                       "convert into a new or empty folder\n")
