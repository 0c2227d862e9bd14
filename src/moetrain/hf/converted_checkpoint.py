"""moetrain training checkpoints for converted weights (``moetrain convert``).

``write_converted_checkpoint`` writes what ``moetrain train --resume`` starts from: ``model.yaml``
(the model config, for ``--model``) and ``step-000000/`` in the trainer's layout (DCP files keyed by
parameter name under ``model``, then a ``COMPLETE`` marker, folder renamed into place last). The
marker says ``model_only``: there is no optimizer, scheduler or data position to restore, so the
trainer loads the weights and starts at step 0 with a fresh optimizer; DCP reshards the weights
into whatever parallel layout the run uses.

``read_checkpoint_model`` is the inverse for ``convert --to-hf``: the model part of the newest
complete checkpoint (converted or written by the trainer), of the model the checkpoint records (the
trainer's ``COMPLETE`` marker holds the run's whole model config; a converted checkpoint has
``model.yaml`` beside it), so no ``--model`` is needed.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from moetrain.config import load_model_config
from moetrain.config.model import ModelConfig
from moetrain.errors import UserError
from moetrain.models.transformer import MoETransformer
from moetrain.runtime_base.checkpoint_files import COMPLETE_MARKER, checkpoint_dir, latest_checkpoint, library_cause

MODEL_YAML = "model.yaml"
MODEL_ONLY_HASH = "model-only"


def write_model_yaml(cfg: ModelConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path


def check_convert_target(save_dir: Path, named: str) -> None:
    """Refuse a folder that holds what ``write_converted_checkpoint`` writes (checkpoints, ``model.yaml``):
    a user's weights and model config are never overwritten. ``named``: how the error names the folder."""
    held = sorted(p.name for p in save_dir.iterdir() if p.name.startswith("step-") or p.name == MODEL_YAML) \
        if save_dir.is_dir() else []
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise UserError(f"{named} already holds {shown}; convert into a new or empty folder")


def write_converted_checkpoint(model: MoETransformer, cfg: ModelConfig, save_dir: str | Path) -> Path:
    """Write ``save_dir/model.yaml`` and ``save_dir/step-000000``; returns the step folder."""
    save_dir = Path(save_dir)
    final = checkpoint_dir(save_dir, 0)
    check_convert_target(save_dir, str(save_dir))
    save_dir.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(final.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    with warnings.catch_warnings():  # DCP warns that it runs in one process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=staging, no_dist=True)
    marker = {"step": 0, "config_hash": MODEL_ONLY_HASH, "model_only": True}
    (staging / COMPLETE_MARKER).write_text(json.dumps(marker))
    staging.rename(final)
    write_model_yaml(cfg, save_dir / MODEL_YAML)
    return final


def newest_step_folder(path: Path) -> Path:
    if (path / COMPLETE_MARKER).is_file():
        return path
    newest = latest_checkpoint(path, remove_unfinished=False)  # a reader: the run may be saving now
    if newest is None:
        raise UserError(f"{path} holds no complete checkpoint (step-NNNNNN/ with a {COMPLETE_MARKER} marker)")
    return newest


def model_yaml_near(step_folder: Path) -> Path | None:
    for folder in (step_folder, step_folder.parent):
        if (folder / MODEL_YAML).is_file():
            return folder / MODEL_YAML
    return None


def recorded_model_config(step_folder: Path) -> ModelConfig | None:
    """The model config a trainer's checkpoint records in its ``COMPLETE`` marker (None for markers written
    before the run identity was stored, and for converted checkpoints, which have ``model.yaml``)."""
    try:
        marker = json.loads((step_folder / COMPLETE_MARKER).read_text(encoding="utf-8"))
        recorded = marker["identity"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        return ModelConfig.model_validate(recorded)
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        raise UserError(f"{step_folder / COMPLETE_MARKER}: the recorded model config does not validate ({first}); "
                        "pass --model with the preset or YAML the run was trained with") from None


def checkpoint_model_config(step_folder: Path, model: str | None = None) -> tuple[ModelConfig, str]:
    """(config, where it came from): ``model`` (a preset or YAML) when given, else the ``model.yaml`` beside
    the checkpoint, else the config its marker records."""
    if model is not None:
        return load_model_config(model), model
    found = model_yaml_near(step_folder)
    if found is not None:
        return load_model_config(str(found)), str(found)
    recorded = recorded_model_config(step_folder)
    if recorded is None:
        raise UserError(f"{step_folder} records no model (a checkpoint from before run identities, with no "
                        f"{MODEL_YAML} beside it); pass --model with the preset or YAML the run was trained with")
    return recorded, f"the model recorded in {step_folder / COMPLETE_MARKER}"


def read_checkpoint_model(path: str | Path, model: str | None = None,
                          cfg: ModelConfig | None = None) -> tuple[MoETransformer, ModelConfig]:
    """The model of the newest complete checkpoint under ``path`` (a save dir or one step folder).

    ``model`` is a preset name or YAML; by default the checkpoint's own (``checkpoint_model_config``).
    ``cfg``, when given, is the model to read instead (e.g. the RL policy: the model less its MTP modules,
    whose tensors the checkpoint may or may not hold).
    """
    step_folder = newest_step_folder(Path(path))
    if cfg is not None:
        model = cfg.name
    else:
        cfg, model = checkpoint_model_config(step_folder, model)
    net = MoETransformer(cfg, device="meta").to_empty(device="cpu")
    for module in net.modules():
        if hasattr(module, "score_bias"):
            module.score_bias.zero_()
    state = {"model": get_model_state_dict(net)}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=step_folder, no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP's own exception is a BaseException
        cause = library_cause(exc)
        reason = str(cause).strip().splitlines()[0][:200] if str(cause).strip() else type(cause).__name__
        raise UserError(f"cannot read the model of {step_folder} with config {model} ({reason})") from None
    net.load_state_dict(state["model"])
    return net, cfg

