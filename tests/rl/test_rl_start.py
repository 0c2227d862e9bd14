"""``moetrain rl --from``: the policy starts from a moetrain checkpoint or a Hugging Face folder."""

import json

import pytest
import torch

from moetrain.cli import main
from moetrain.config import load_model_config
from moetrain.hf.converted_checkpoint import write_converted_checkpoint
from moetrain.hf.save import save_pretrained
from moetrain.models.transformer import build_model
from moetrain.rl.loop import policy_config
from moetrain.rl.start import starting_config, starting_weights
from refusals import refused

TINY = ["--sft-steps", "0", "--steps", "1", "--prompts", "2", "--group-size", "2", "--eval-size", "4",
        "--device", "cpu", "--quiet"]


@pytest.fixture(scope="module")
def pangu_checkpoint(tmp_path_factory):
    """A converted-style checkpoint (model.yaml + step-000000) of tiny-pangu with its MTP modules."""
    cfg = load_model_config("tiny-pangu")
    model = build_model(cfg, "cpu", seed=7)
    folder = tmp_path_factory.mktemp("pangu")
    write_converted_checkpoint(model, cfg, folder)
    return folder, {name: value.clone() for name, value in model.state_dict().items()}


def test_a_checkpoint_gives_the_policy_every_tensor_but_the_mtp_modules(pangu_checkpoint):
    folder, saved = pangu_checkpoint
    cfg = policy_config(starting_config(folder, None))
    assert cfg.num_mtp_layers == 0 and cfg.name == "tiny-pangu"
    state = starting_weights(folder, cfg)
    assert set(state) < set(saved) and all("mtp" in name for name in set(saved) - set(state))
    for name, value in state.items():
        assert torch.equal(value, saved[name]), name


def test_a_hugging_face_folder_gives_the_same_weights(tmp_path):
    cfg = policy_config(load_model_config("tiny-qwen3"))
    model = build_model(cfg, "cpu", seed=3)
    save_pretrained(model, tmp_path / "hf")
    got = starting_config(tmp_path / "hf", None)
    assert got.num_layers == cfg.num_layers and got.moe.num_experts == cfg.moe.num_experts
    state = starting_weights(tmp_path / "hf", policy_config(got))
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value), name


@pytest.mark.slow
def test_moetrain_rl_starts_from_the_checkpoint(pangu_checkpoint, tmp_path):
    folder, _ = pangu_checkpoint
    metrics = tmp_path / "rl.jsonl"
    # with a warm-up: it starts from the checkpoint too, and GRPO from the warm-up's weights
    assert main(["rl", *TINY, "--sft-steps", "2", "--sft-batch", "8", "--from", str(folder),
                 "--metrics-out", str(metrics)]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]


def test_a_checkpoint_of_another_model_is_refused(pangu_checkpoint, capsys):
    folder, _ = pangu_checkpoint
    refused(capsys, ["rl", *TINY, "--from", str(folder), "--model", "tiny-qwen3"], str(folder))


def test_a_missing_path_and_a_checkpoint_without_its_model_are_refused(pangu_checkpoint, tmp_path, capsys):
    refused(capsys, ["rl", *TINY, "--from", str(tmp_path / "nowhere")], "no such file or folder")
    folder, _ = pangu_checkpoint
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "step-000000").symlink_to(folder / "step-000000", target_is_directory=True)
    refused(capsys, ["rl", *TINY, "--from", str(bare)], f"--from {bare}: ", "records no model", "pass --model")


FROM_TAKES = ("a moetrain checkpoint (a --save-dir with step-NNNNNN/ folders, or one of them, with its COMPLETE "
              "marker) or a Hugging Face model folder (config.json + *.safetensors)")


def test_a_folder_or_file_without_weights_is_refused_before_any_model(tmp_path, capsys):
    empty = (tmp_path / "empty").resolve()
    empty.mkdir()
    assert refused(capsys, ["rl", *TINY, "--from", str(empty)]) == \
        f"moetrain rl: error: --from {empty} holds no weights; give {FROM_TAKES}"
    # an interrupted save's staging folder is no checkpoint, and reading --from leaves it where it is
    (empty / "step-000004.tmp").mkdir()
    assert refused(capsys, ["rl", *TINY, "--from", str(empty)]) == \
        f"moetrain rl: error: --from {empty} holds no weights; give {FROM_TAKES}"
    assert (empty / "step-000004.tmp").is_dir()
    file = empty / "weights.pt"
    file.write_text("kept")
    assert refused(capsys, ["rl", *TINY, "--from", str(file)]) == \
        f"moetrain rl: error: --from {file} is a file; give {FROM_TAKES}"
    assert file.read_text() == "kept"


@pytest.fixture
def hf_folder(tmp_path):
    return save_pretrained(build_model(policy_config(load_model_config("tiny-qwen3")), "cpu", seed=3),
                           tmp_path.resolve() / "hf")


def test_a_damaged_safetensors_file_is_refused_before_any_model(hf_folder, capsys):
    weights = hf_folder / "model.safetensors"
    weights.write_text("junk\n")
    assert refused(capsys, ["rl", *TINY, "--from", str(hf_folder)]) == (
        f"moetrain rl: error: {weights}: not a readable safetensors file (Error while deserializing header: header "
        "too small); replace it with the model's own (download or export it again)")
    assert weights.read_text() == "junk\n"


def test_a_config_json_that_is_no_object_is_refused(hf_folder, capsys):
    (hf_folder / "config.json").write_text("[1, 2]")
    assert refused(capsys, ["rl", *TINY, "--from", str(hf_folder)]) == (
        f"moetrain rl: error: {hf_folder / 'config.json'}: holds a JSON list, not an object ({{...}}); give the "
        "model's own config.json")
