"""Checkpoint folders: naming, sealing with checksums, verifying, and what a checkpoint may be resumed into.

The tensors are written and read by ``moetrain.distributed.checkpoint`` (DCP, every layout, one process
included); this module holds what does not depend on the layout.

Layout under ``save_dir``: one folder ``step-000123/`` per checkpoint holding the DCP files and a
``COMPLETE`` marker. A save writes into ``step-000123.tmp/``; ``seal_checkpoint`` then flushes every file
to disk, writes the marker last and only then renames the folder: a crash at any point leaves either a
``.tmp`` folder (ignored and removed on the next resume) or a complete checkpoint, never a half-written
folder under a final name.

The marker is canonical JSON (sorted keys, no spaces): the step, the run identity (``run_identity``: the
model config, the training config and the corpus hash, with a short hash of the three), the SHA-256 of
every other file in the folder under ``files``, and its own SHA-256 under ``marker_sha256``. So a flipped
byte anywhere, the marker included, is found before anything is loaded, and named (``verify_checkpoint``).
Markers written before the checksums (no ``files``: older runs, ``moetrain convert``) load as before,
unverified.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moetrain.errors import UserError
from moetrain.runtime_base.recovery import PeerLost, peer_lost

if TYPE_CHECKING:
    from moetrain.config import ModelConfig, TrainingConfig

COMPLETE_MARKER = "COMPLETE"
MARKER_CHECKSUM = "marker_sha256"
"""The marker's own SHA-256 (of its canonical JSON without this key)."""
_STEP_DIR = re.compile(r"^step-(\d+)$")
_DAMAGED_MEND = "remove that folder to resume from an older one"


def checkpoint_dir(save_dir: Path, step: int) -> Path:
    return save_dir / f"step-{step:06d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of checkpoint folder ``path`` by its name (``step-000123``: 123); None for another name."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


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


# ----- sealing and verifying -----
def _canonical(marker: dict[str, Any]) -> bytes:
    return (json.dumps(marker, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
            + "\n").encode()


def _sha256_and_fsync(path: Path, fsync: bool) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def _checksums(folder: Path, fsync: bool = False) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` but the marker, by path relative to it (POSIX separators)."""
    return {path.relative_to(folder).as_posix(): _sha256_and_fsync(path, fsync)
            for path in sorted(folder.rglob("*")) if path.is_file() and path.name != COMPLETE_MARKER}


def seal_checkpoint(staging: Path, final: Path, marker: dict[str, Any]) -> Path:
    """Seal the finished folder ``staging`` as ``final`` (returned): fsync and checksum every file, write
    the ``COMPLETE`` marker (``marker``'s fields, ``files`` and ``marker_sha256``) last, fsync it, then
    rename ``staging`` over ``final``. Runs on one process (the coordinator) after every rank has written."""
    body = {**marker, "files": _checksums(staging, fsync=True)}
    body[MARKER_CHECKSUM] = hashlib.sha256(_canonical(body)).hexdigest()
    marker_path = staging / COMPLETE_MARKER
    with marker_path.open("wb") as f:
        f.write(_canonical(body))
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(staging)
    if final.exists():
        # A directory cannot be renamed over a non-empty one: move the old one aside first. Its name ends
        # in .tmp, so a crash before it is removed leaves it to the next resume's clean-up.
        aside = final.with_name(final.name + ".replaced.tmp")
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
        staging.rename(final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        staging.rename(final)
    _fsync_dir(final.parent)
    return final


def _damaged(path: Path, what: str) -> UserError:
    return UserError(f"checkpoint {path} is damaged: {what}; {_DAMAGED_MEND}")


def _read_marker_file(path: Path) -> dict[str, Any]:
    """The marker of checkpoint ``path``, its own checksum checked when it has one (files unchecked)."""
    try:
        raw = (path / COMPLETE_MARKER).read_bytes()
        marker = json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} marker); {_DAMAGED_MEND}") from None
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _damaged(path, f"its {COMPLETE_MARKER} marker is unreadable") from None
    if not isinstance(marker, dict):
        raise _damaged(path, f"its {COMPLETE_MARKER} marker is not a JSON object")
    # Sealed: both keys, or one of them with a byte of the other's name flipped. The bytes must be the
    # canonical form too, so that no flip (a space, a key's case) can leave the parsed content intact.
    if "files" in marker or MARKER_CHECKSUM in marker:
        unsealed = {k: v for k, v in marker.items() if k != MARKER_CHECKSUM}
        intact = (marker.get(MARKER_CHECKSUM) == hashlib.sha256(_canonical(unsealed)).hexdigest()
                  and raw == _canonical(marker) and isinstance(marker.get("files"), dict))
        if not intact:
            raise _damaged(path, f"{COMPLETE_MARKER} does not match its checksum")
    return marker


def _verify_files(path: Path, marker: dict[str, Any]) -> None:
    for name, expected in sorted(marker.get("files", {}).items()):
        file = path / name
        if not file.is_file():
            raise _damaged(path, f"{name} is missing")
        if _sha256_and_fsync(file, fsync=False) != expected:
            raise _damaged(path, f"{name} does not match its checksum")


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The marker of checkpoint ``path`` once every file matches its checksum; otherwise a one-line
    ``UserError`` naming the first file (in name order, the marker first) that differs or is missing.
    A marker without checksums (written before them) is returned unverified."""
    marker = _read_marker_file(path)
    _verify_files(path, marker)
    return marker


def latest_checkpoint(save_dir: Path, remove_unfinished: bool = True) -> Path | None:
    """The newest complete checkpoint in ``save_dir`` (None if there is none); a final-named folder without a
    marker is corrupt. The run that owns ``save_dir`` removes unfinished ``.tmp`` folders from an interrupted
    save; a reader (``convert --to-hf``, ``rl --from``) passes ``remove_unfinished=False``: the run it reads
    may still be writing one."""
    if not save_dir.is_dir():
        return None
    steps: list[tuple[int, Path]] = []
    for entry in save_dir.iterdir():
        if entry.is_dir() and entry.name.endswith(".tmp"):
            if remove_unfinished and _is_coordinator():
                shutil.rmtree(entry, ignore_errors=True)
            continue
        step = checkpoint_step(entry)
        if step is not None and entry.is_dir():
            steps.append((step, entry))
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
    """The marker of checkpoint ``path`` (its own checksum checked, the files not): every field, with
    ``step`` an int and ``config_hash`` (the run identity's short hash) a string."""
    marker = _read_marker_file(path)
    try:
        return {**marker, "step": int(marker["step"]), "config_hash": str(marker["config_hash"])}
    except (KeyError, TypeError, ValueError):
        raise _damaged(path, f"its {COMPLETE_MARKER} marker has no step or config_hash") from None


# ----- what a checkpoint may be resumed into -----
def run_identity(model_cfg: ModelConfig, training_cfg: TrainingConfig, corpus_hash: str) -> dict[str, Any]:
    """What a run learns: the model config, every ``TrainingConfig`` field and the corpus hash, plus
    ``hash``, a short hash of the three (the same as the single-process trainer's ``config_hash``, so
    markers written before the identity was stored still compare)."""
    key = "|".join([model_cfg.model_dump_json(), training_cfg.model_dump_json(), corpus_hash])
    return {"model": model_cfg.model_dump(mode="json"), "training": training_cfg.model_dump(mode="json"),
            "corpus_hash": corpus_hash, "hash": hashlib.sha256(key.encode()).hexdigest()[:16]}


# Identity fields that may change on resume. Every other one is refused; the reasons below say why.
RESUMABLE_CHANGES: dict[str, str] = {
    "model.name": "a label (the preset name or the YAML file's stem), not part of the model",
    "training.micro_batch": "gradient accumulation: each micro-batch's loss is divided by the label tokens "
                            "of the whole global batch, so the language-model gradient is the same; the router's "
                            "balance losses are per-micro-batch statistics that agree in expectation, as under "
                            "any change of layout",
    "training.dtype": "arithmetic precision of the same computation (weights and optimizer state stay fp32), "
                      "as moving a run between CPU and GPU under dtype auto already does",
}
_SCHEDULE = "the learning-rate schedule of the steps still to run would change"
_UPDATE = "the optimizer's update rule would change"
_WHY_REFUSED: dict[str, str] = {
    "training.steps": _SCHEDULE,
    "training.lr": _SCHEDULE,
    "training.min_lr_ratio": _SCHEDULE,
    "training.warmup_steps": _SCHEDULE,
    "training.global_batch": "each step would train on other sequences",
    "training.seq_len": "the sequences themselves would change",
    "training.seed": "the order of the data still to come would change",
    "training.weight_decay": _UPDATE, "training.beta1": _UPDATE, "training.beta2": _UPDATE,
    "training.eps": _UPDATE, "training.grad_clip": _UPDATE,
    "corpus_hash": "the training text differs",
}
_MAX_LISTED = 4


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, item in value.items():
        flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


_UNSET = object()
"""A field one side of the comparison does not have."""


def _show(value: Any) -> str:
    return "(unset)" if value is _UNSET else json.dumps(value, ensure_ascii=False)


def _change(field: str, old: Any, new: Any) -> str:
    name = field.removeprefix("training.")
    why = _WHY_REFUSED.get(field, "the model would change" if field.startswith("model.") else "it changes the run")
    return f"{name} {_show(old)} → {_show(new)} ({why})"


def _listing_order(field: str) -> tuple[int, str]:
    # the training flags first (what a user most often changed), then the corpus, then the model's fields
    return (0 if field.startswith("training.") else 1 if field == "corpus_hash" else 2, field)


def check_resumable(saved_marker: dict[str, Any], current: dict[str, Any], where: str = "the checkpoint") -> None:
    """Refuse, in one line listing each differing field with its old → new value and why, to resume the
    checkpoint whose marker is ``saved_marker`` into the run of identity ``current`` (``run_identity``).

    The rule, field by field: the run may change only what does not change what is learned, the fields
    of ``RESUMABLE_CHANGES`` (the model's name, ``micro_batch``, ``dtype``). Any other model field,
    the corpus, and the training fields that set the learning-rate schedule (``steps``, ``lr``,
    ``min_lr_ratio``, ``warmup_steps``), the data (``global_batch``, ``seq_len``, ``seed``: it orders the
    data still to come) or the optimizer's update (``weight_decay``, ``beta1``, ``beta2``, ``eps``,
    ``grad_clip``) must match. A marker without an identity (written before it was stored), or a
    ``current`` without one, compares the short hashes."""
    saved = saved_marker.get("identity")
    if not isinstance(saved, dict) or "training" not in current:
        saved_hash = saved.get("hash") if isinstance(saved, dict) else saved_marker.get("config_hash")
        if saved_hash != current.get("hash"):
            raise UserError(f"{where} was written by a run with another model, data or training config (hash "
                            f"{saved_hash} ≠ {current.get('hash')}); resume with the same flags or another --save-dir")
        return
    old = _flatten({k: v for k, v in saved.items() if k != "hash"}, "")
    new = _flatten({k: v for k, v in current.items() if k != "hash"}, "")
    changed = [field for field in sorted(old.keys() | new.keys(), key=_listing_order)
               if field not in RESUMABLE_CHANGES and old.get(field, _UNSET) != new.get(field, _UNSET)]
    if not changed:
        return
    listed = [_change(field, old.get(field, _UNSET), new.get(field, _UNSET)) for field in changed[:_MAX_LISTED]]
    more = f", and {len(changed) - _MAX_LISTED} more" if len(changed) > _MAX_LISTED else ""
    raise UserError(f"{where} was written with other settings: {', '.join(listed)}{more}; resume with the saved "
                    "values, or start a new run with another --save-dir")


# ----- the checkpoint library's failures -----
_DCP_DIR = str(Path(dcp.__file__).parent)


class _DropLibraryRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.pathname.startswith(_DCP_DIR)


def library_cause(exc: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's ``CheckpointException`` (or ``exc`` itself): an
    interrupt stays an interrupt, a damaged file its own error."""
    if isinstance(exc, CheckpointException) and exc.failures:
        first = next(iter(exc.failures.values()))  # (exception, traceback) by rank
        return first[0] if isinstance(first, tuple) else first
    return exc


def _library_failure(exc: BaseException) -> str:
    """One line on why DCP failed, without its internals (rank maps, tracebacks, per-rank file names)."""
    if isinstance(exc, CheckpointException) and not exc.failures:
        return "the checkpoint library failed"
    exc = library_cause(exc)
    text = str(exc).strip()
    if text.startswith("metadata is None"):  # neither the global nor a per-rank .metadata could be read
        return "its .metadata file cannot be read"
    if isinstance(exc, EOFError):  # a tensor file shorter than .metadata says
        return "a file ends early; it was cut short"
    return (text.splitlines()[0] if text else type(exc).__name__)[:160]


def _peer_failed(exc: BaseException) -> bool:
    """Whether a load failed on a collective (a peer rank that stopped, or fell past the timeout), not on
    this rank's files."""
    cause = library_cause(exc)
    return isinstance(cause, dist.DistError) or peer_lost(str(cause))


@contextlib.contextmanager
def quiet_checkpoint_load(path: Path, describe: Callable[[str], str] | None = None) -> Iterator[None]:
    """Around a DCP load of checkpoint ``path``: DCP logs a traceback on the root logger for every
    metadata file it fails to read (two for one damaged ``.metadata``) before raising; drop those records
    and turn its exception into one ``UserError`` line, ``describe(reason)`` (by default: the checkpoint
    is unreadable, remove it). A collective that fails (a peer stopped or fell behind) is never blamed on
    the files: it is a ``PeerLost`` saying to keep them, in the library's words, which mark it as a peer's
    loss (``recovery.peer_lost``) so the launcher names the rank that stopped."""
    describe = describe or (lambda reason: f"checkpoint {path} is unreadable ({reason}); {_DAMAGED_MEND}")
    try:
        with library_records_dropped(), _single_process_quiet():
            yield
    except UserError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException derives from BaseException
        if _peer_failed(exc):
            raise PeerLost(f"loading checkpoint {path} stopped waiting on another rank ({_library_failure(exc)}); "
                            "the checkpoint is not at fault, keep it: the rank that stopped says why in its own "
                            "line, and a rank that was only slow needs a longer run.startup_timeout_s") from None
        raise UserError(describe(_library_failure(exc))) from None


@contextlib.contextmanager
def library_records_dropped() -> Iterator[None]:
    """DCP logs a traceback on the root logger for each failure it then raises (a damaged file on load, a
    full disk on save): drop its records while this is open, so a failure is the one line we print."""
    drop = _DropLibraryRecords()
    root = logging.getLogger()
    # A logger's filter sees only its own records; handlers' filters also see those of child loggers.
    filtered = [root, *root.handlers, *([logging.lastResort] if logging.lastResort else [])]
    for item in filtered:
        item.addFilter(drop)
    try:
        yield
    finally:
        for item in filtered:
            item.removeFilter(drop)


def save_failure(exc: BaseException) -> str:
    """One line on why a save failed: the first rank's own error (``[Errno 28] No space left on device:
    'PATH'``), without DCP's wrapping."""
    cause = library_cause(exc)
    text = str(cause).strip()
    return (text.splitlines()[0] if text else type(cause).__name__)[:300]


def complete_checkpoints(save_dir: Path) -> list[tuple[int, Path]]:
    """The complete (marked) training checkpoints in ``save_dir`` by step, oldest first; converted
    weights-only ones are not counted."""
    found = []
    for entry in save_dir.iterdir() if save_dir.is_dir() else ():
        step = checkpoint_step(entry)
        if step is not None and (entry / COMPLETE_MARKER).is_file() and not is_model_only(entry):
            found.append((step, entry))
    return sorted(found)


def prune_checkpoints(save_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (called right after one is sealed, so
    an older one goes only once a newer one is complete); the deleted folders. Each is renamed to a
    ``.tmp`` name first, so a crash mid-delete leaves nothing that looks like a checkpoint."""
    deleted = []
    for _, path in complete_checkpoints(save_dir)[:-keep_last]:
        aside = path.with_name(path.name + ".deleted.tmp")
        path.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)
        deleted.append(path)
    if deleted:
        _fsync_dir(save_dir)
    return deleted


# ----- markers -----
def marker_fields(step: int, identity: dict[str, Any] | str) -> dict[str, Any]:
    """The ``COMPLETE`` marker's own fields (``seal_checkpoint`` adds the checksums)."""
    if isinstance(identity, str):  # a caller that has only the short hash
        return {"step": step, "config_hash": identity}
    return {"step": step, "config_hash": identity["hash"], "identity": identity}


def is_model_only(path: Path) -> bool:
    """Weights-only checkpoints come from ``moetrain convert --from-hf`` (see ``moetrain.hf.converted_checkpoint``)."""
    try:
        return bool(json.loads((path / COMPLETE_MARKER).read_text()).get("model_only"))
    except (OSError, ValueError, AttributeError):
        return False


def should_save(step: int, last_step: int, save_every: int) -> bool:
    """Whether to save after completed step ``step``: at the run's last step (``--steps``, or ``--stop-at``)
    and every ``save_every`` steps (0: only at the last)."""
    return step == last_step or (save_every > 0 and step % save_every == 0)
