"""The weights an RL run starts from (``moetrain rl --from PATH``): a moetrain checkpoint or a Hugging Face
model folder.

A moetrain checkpoint is a save dir of ``moetrain train`` / ``moetrain convert --from-hf`` (its newest
complete step) or one step folder; its model is ``--model`` when given (a checkpoint of another model is
then refused in one line: DCP names the tensor that does not fit), else the ``model.yaml`` beside it, else
the model its marker records (``moetrain.hf.converted_checkpoint.checkpoint_model_config``). A
folder with ``config.json`` is read as a Hugging Face model (``moetrain.hf.load_pretrained``).

The policy is the model without its multi-token-prediction modules (``loop.policy_config``): their
weights are left behind, every other tensor must be there.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moetrain.config import ModelConfig
from moetrain.errors import UserError
from moetrain.hf.configs import model_config_from_hf
from moetrain.hf.converted_checkpoint import checkpoint_model_config, newest_step_folder, read_checkpoint_model
from moetrain.hf.load import load_pretrained, read_hf_config, readable_safetensors
from moetrain.models.transformer import build_model
from moetrain.runtime_base.checkpoint_files import COMPLETE_MARKER


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


WHAT_FROM_TAKES = ("a moetrain checkpoint (a --save-dir with step-NNNNNN/ folders, or one of them, with its "
                   f"{COMPLETE_MARKER} marker) or a Hugging Face model folder (config.json + *.safetensors)")


def _has_step_folders(path: Path) -> bool:
    """``step-NNNNNN/`` folders, complete or not (an unfinished ``.tmp`` one is no checkpoint)."""
    return any(p.is_dir() and p.name.removeprefix("step-").isdigit() for p in path.glob("step-*"))


def starting_config(path: Path, model: str | None) -> ModelConfig:
    """The model config of the weights at ``path`` (cheap: reads the config and the safetensors headers only),
    refusing a path that holds no weights before any model is built."""
    if not path.exists():
        raise UserError(f"--from {path}: no such file or folder; give {WHAT_FROM_TAKES}")
    if not path.is_dir():
        raise UserError(f"--from {path} is a file; give {WHAT_FROM_TAKES}")
    if is_hf_folder(path):
        cfg = model_config_from_hf(read_hf_config(path), name=path.name, source=str(path / "config.json"))
        readable_safetensors(path)
        return cfg
    if not (path / COMPLETE_MARKER).is_file() and not _has_step_folders(path):
        raise UserError(f"--from {path} holds no weights; give {WHAT_FROM_TAKES}")
    try:
        return checkpoint_model_config(newest_step_folder(path), model)[0]
    except UserError as exc:
        raise UserError(f"--from {path}: {exc}") from None


def starting_weights(path: Path, policy_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The policy's state dict from the weights at ``path``."""
    if is_hf_folder(path):
        net, _ = load_pretrained(path)
    else:
        net, _ = read_checkpoint_model(path, cfg=policy_cfg)
    state = net.state_dict()
    wanted = build_model(policy_cfg, "meta").state_dict()
    missing = [name for name in wanted if name not in state]
    if missing:
        raise UserError(f"--from {path}: the checkpoint lacks {len(missing)} tensors of {policy_cfg.name} "
                        f"(first: {missing[0]}); it holds another model")
    for name, like in wanted.items():
        if state[name].shape != like.shape:
            raise UserError(f"--from {path}: {name} is {tuple(state[name].shape)} in the checkpoint but "
                            f"{tuple(like.shape)} in {policy_cfg.name}; it holds another model")
    return {name: state[name] for name in wanted}
