"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically.

Layout under ``save_dir``: one folder ``step-000123/`` per checkpoint holding the DCP files and a
``COMPLETE`` marker (JSON: step, config hash). A save writes into ``step-000123.tmp/``, flushes every
file to disk, writes the marker last and only then renames the folder: a crash at any point leaves
either a ``.tmp`` folder (ignored and removed on the next resume) or a complete checkpoint, never a
half-written folder under a final name.

State: model and optimizer through ``get_state_dict``/``set_state_dict`` (so sharded modules and
optimizers save the same way later), the RNG states as tensors, and the trainer's own state (step,
scheduler, data position) as one JSON string. Router score biases are buffers of the model and
travel with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from moetrain.errors import UserError

COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_dir(save_dir: Path, step: int) -> Path:
    return save_dir / f"step-{step:06d}"


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every call without a process group that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _is_coordinator() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _rng_state() -> dict[str, torch.Tensor]:
    # The host generator only: training draws no device random numbers today (no dropout), and a
    # CPU-only entry keeps checkpoints loadable across CPU and GPU machines.
    return {"torch": torch.get_rng_state()}


def _state_to_save(model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any]) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {
        "model": model_state,
        "optim": optim_state,
        "rng": _rng_state(),
        "trainer": json.dumps(trainer_state, sort_keys=True),
    }


def save_checkpoint(
    save_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any], config_hash: str,
) -> Path:
    """Write the checkpoint of (completed) step ``step`` atomically; returns its folder."""
    final = checkpoint_dir(save_dir, step)
    staging = final.with_name(final.name + ".tmp")
    if _is_coordinator():
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    if _distributed():
        dist.barrier()
    with _single_process_quiet():
        dcp.save(_state_to_save(model, optimizer, trainer_state), checkpoint_id=staging, no_dist=not _distributed())
    if _distributed():
        dist.barrier()  # every rank's shard is written before the coordinator seals the folder
    if _is_coordinator():
        _fsync_tree(staging)
        marker = staging / COMPLETE_MARKER
        marker.write_text(json.dumps({"step": step, "config_hash": config_hash}))
        with marker.open("rb") as f:
            os.fsync(f.fileno())
        _fsync_dir(staging)
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        _fsync_dir(save_dir)
    if _distributed():
        dist.barrier()
    return final


def latest_checkpoint(save_dir: Path) -> Path | None:
    """The newest complete checkpoint in ``save_dir`` (None if there is none). Unfinished ``.tmp``
    folders from an interrupted save are removed; a final-named folder without a marker is corrupt."""
    if not save_dir.is_dir():
        return None
    steps: list[tuple[int, Path]] = []
    for entry in save_dir.iterdir():
        if entry.is_dir() and entry.name.endswith(".tmp") and _is_coordinator():
            shutil.rmtree(entry, ignore_errors=True)
            continue
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            steps.append((int(match.group(1)), entry))
    if not steps:
        return None
    newest = max(steps)[1]
    if not (newest / COMPLETE_MARKER).is_file():
        raise UserError(
            f"checkpoint {newest} is incomplete or corrupt (no {COMPLETE_MARKER} marker); "
            "remove that folder to resume from an older one, or choose another --save-dir"
        )
    return newest


def read_marker(path: Path) -> dict[str, Any]:
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text())
        return {"step": int(marker["step"]), "config_hash": str(marker["config_hash"])}
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(
            f"checkpoint {path} has an unreadable {COMPLETE_MARKER} marker; remove that folder or choose another"
        ) from None


def is_model_only(path: Path) -> bool:
    """Weights-only checkpoints come from ``moetrain convert --from-hf`` (see ``moetrain.hf.checkpoint``)."""
    try:
        return bool(json.loads((path / COMPLETE_MARKER).read_text()).get("model_only"))
    except (OSError, ValueError, AttributeError):
        return False


def _load_model_only(path: Path, model: nn.Module) -> dict[str, Any]:
    """Load the weights only; the optimizer, schedule and data start fresh at step 0. DCP reads the
    weights by parameter name, so any parallel layout can start from them."""
    model_state = get_model_state_dict(model)
    try:
        with _single_process_quiet():
            dcp.load({"model": model_state}, checkpoint_id=path, no_dist=not _distributed())
    # DCP raises many types (CheckpointException is a BaseException); the first line names the fault
    except (Exception, CheckpointException) as exc:
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise UserError(f"converted checkpoint {path} does not fit this model ({reason}); train with the "
                        "model.yaml written beside it") from None
    set_model_state_dict(model, model_state)
    return {"step": 0, "lr_scheduler": {}}


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, config_hash: str
) -> dict[str, Any]:
    """Restore model, optimizer and RNG from ``path``; returns the trainer state saved with them."""
    if is_model_only(path):
        return _load_model_only(path, model)
    marker = read_marker(path)
    if marker["config_hash"] != config_hash:
        raise UserError(
            f"checkpoint {path} was written by a run with another model, data or training config "
            f"(hash {marker['config_hash']} ≠ {config_hash}); resume with the same flags or another --save-dir"
        )
    # The template tells DCP which keys and shapes to read; its values are overwritten in place.
    state = _state_to_save(model, optimizer, {})
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path, no_dist=not _distributed())
        trainer_state = json.loads(state["trainer"])
    except (Exception, CheckpointException) as exc:  # CheckpointException derives from BaseException
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"checkpoint {path} is corrupt or unreadable ({reason}); remove that folder or choose another --save-dir"
        ) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"]["torch"])
    return trainer_state


def config_hash(model_cfg, training_cfg, corpus_hash: str) -> str:
    """Identifies what a checkpoint may be resumed into: model, training config and corpus."""
    import hashlib

    key = "|".join([model_cfg.model_dump_json(), training_cfg.model_dump_json(), corpus_hash])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def should_save(step: int, last_step: int, save_every: int) -> bool:
    """Save at the run's last step and every ``save_every`` steps (0: only at the last)."""
    return step == last_step or (save_every > 0 and step % save_every == 0)
