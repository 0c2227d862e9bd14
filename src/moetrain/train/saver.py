"""The trainer's checkpoints: synchronous or in the background, the newest K kept, a failed save survived.

``CheckpointSaver.save`` is called by every rank after the steps that save (``should_save``). It writes
through DCP into ``step-N.tmp/`` and seals the folder as ``moetrain.runtime_base.checkpoint_files`` describes (every
file's SHA-256, the ``COMPLETE`` marker last, the rename), then

- ``--async-save``: ``save`` copies this rank's state to host memory and returns; DCP's thread writes it
  (over a gloo group of its own, so its collectives never meet the step's), and the coordinator's thread
  seals the folder once every rank has written. The next ``save`` (or ``finish``, at the end of the run
  or before a rollback) first waits for that write and learns whether it completed. A failure between
  the two leaves the ``.tmp`` folder, which the next resume removes: the newest complete checkpoint is
  then the one before, as after a crash mid-save.
- ``--keep-last K``: right after a checkpoint is sealed the coordinator deletes all but the newest K
  complete ones; an older checkpoint never goes before a newer one is complete.
- a failed save (a full disk, a permission; ``MOETRAIN_FAULT``'s ``save_error`` rehearses one): the
  ``.tmp`` folder is removed, the previous checkpoint stays as it was, and one line names the
  checkpoint, the path and the cause; ``--on-save-error stop`` ends the run with it (a ``UserError``),
  ``continue`` prints it and trains on. Every rank takes the same decision: the coordinator's outcome
  (DCP gathers every rank's write errors there) is broadcast.

What each save cost the step loop, ``SaveCost``, joins the metrics row of the step that saved:
``save_mode`` (sync/async), ``save_stall_s`` (the loop's wall time in ``save``) and, asynchronously,
``save_wait_s`` (the part spent waiting for the previous background write).
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from rich.console import Console
from torch.distributed.checkpoint.api import CheckpointException

from moetrain.config.run import RunOptions, SaveErrorChoice
from moetrain.distributed.checkpoint import HostStager, finish_folder, start_write, write_state
from moetrain.errors import UserError
from moetrain.runtime_base.checkpoint_files import (
    checkpoint_dir,
    complete_checkpoints,
    library_cause,
    library_records_dropped,
    prune_checkpoints,
    save_failure,
)


@dataclass(frozen=True)
class SaveCost:
    """What one save cost the training loop."""

    mode: str
    stall_s: float
    wait_s: float = 0.0

    def fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"save_mode": self.mode, "save_stall_s": self.stall_s}
        if self.mode == "async":
            fields["save_wait_s"] = self.wait_s
        return fields


@dataclass(frozen=True)
class SavePolicy:
    """How a run saves: in the background or not, how many checkpoints it keeps, what a failed save does
    (``RunOptions``' fields of the same names)."""

    async_save: bool = False
    keep_last: int | None = None
    """None: keep every checkpoint."""
    on_save_error: SaveErrorChoice = "stop"

    @classmethod
    def of(cls, options: RunOptions) -> SavePolicy:
        return cls(options.async_save, options.keep_last, options.on_save_error)


@dataclass
class _Pending:
    step: int
    staging: Path
    done: Future


class CheckpointSaver:
    """Saves of one run, on every rank of its layout (``world``: the layout's group, ``ranks``: its
    global ranks, for the background writes' own group)."""

    def __init__(self, save_dir: Path, world: dist.ProcessGroup, ranks: list[int], policy: SavePolicy = SavePolicy(),
                 console: Console | None = None) -> None:
        self.save_dir, self.world = save_dir, world
        self.async_save, self.keep_last, self.on_save_error = policy.async_save, policy.keep_last, policy.on_save_error
        self.console = console or Console(quiet=True)
        self.coordinator = dist.get_rank(world) == 0
        # background writes: a CPU group of their own (async_save needs one; a second group also keeps their
        # collectives apart from the step's, which run meanwhile on the layout's groups)
        # (torch's default timeout: a write waits on the slowest rank's disk; a hung rank shows on the step's groups)
        self.group = dist.new_group(ranks=ranks, backend="gloo") if self.async_save else world
        self._pending: _Pending | None = None
        self._sealer: ThreadPoolExecutor | None = None
        self._stager = None
        if self.async_save:
            self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetrain-seal")
            self._stager = HostStager()
        self._quiet = library_records_dropped()
        self._quiet.__enter__()
        self.failed_saves = 0

    # ----- one save -----
    def save(self, step: int, state: dict, identity: dict | str, expert_placement: dict | None = None,
             fail: bool = False) -> tuple[Path | None, SaveCost]:
        """Save ``state`` (``checkpoint_state`` of this rank) as the checkpoint after ``step`` steps; the
        folder it will have (None when the save failed and the run goes on) and what it cost the loop.
        ``fail``: this rank's write fails as a full disk does (an injected fault)."""
        start = time.perf_counter()
        waited = self.finish() if self.async_save else 0.0
        final = checkpoint_dir(self.save_dir, step)
        staging = final.with_name(final.name + ".tmp")
        if self.coordinator:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
        dist.barrier(group=self.world)
        if self.async_save:
            try:
                written = start_write(state, staging, self.group, self._stager.for_next_save(), fail)
            except (Exception, KeyboardInterrupt, CheckpointException) as exc:
                self._failed(step, staging, self._agreed(_cause(exc), staging))
                return None, SaveCost("async", time.perf_counter() - start, waited)
            done = self._sealer.submit(self._seal_after, written, staging, final, step, identity, expert_placement)
            self._pending = _Pending(step, staging, done)
            return final, SaveCost("async", time.perf_counter() - start, waited)
        error = None
        try:
            write_state(state, staging, self.world, fail)
            if self.coordinator:
                finish_folder(staging, final, step, identity, expert_placement)
                self._prune()
        except (Exception, KeyboardInterrupt, CheckpointException) as exc:
            error = _cause(exc)
        error = self._agreed(error, staging)
        cost = SaveCost("sync", time.perf_counter() - start)
        if error is not None:
            self._failed(step, staging, error)
            return None, cost
        return final, cost

    def _seal_after(self, written: Future, staging: Path, final: Path, step: int, identity: dict | str,
                    expert_placement: dict | None) -> None:
        """The background thread's second half: once this rank's write is done (on the coordinator: every
        rank's, DCP's last collective gathers them), the coordinator seals and prunes."""
        written.result()
        if self.coordinator:
            finish_folder(staging, final, step, identity, expert_placement)
            self._prune()

    def finish(self) -> float:
        """Wait for the background write in flight, if any, and learn on every rank whether it completed;
        the seconds waited. Before the next save, a rollback, and at the end of the run."""
        pending, self._pending = self._pending, None
        if pending is None:
            return 0.0
        start = time.perf_counter()
        error = None
        try:
            pending.done.result()
        except (Exception, KeyboardInterrupt, CheckpointException) as exc:
            error = _cause(exc)
        self._failed_if(pending.step, pending.staging, self._agreed(error, pending.staging))
        return time.perf_counter() - start

    # ----- failures -----
    def _agreed(self, error: str | None | KeyboardInterrupt, staging: Path) -> str | None:
        """The coordinator's outcome on every rank (its view holds every rank's write errors, and the
        sealing); an interrupt stays an interrupt, leaving nothing that looks like a checkpoint."""
        if isinstance(error, KeyboardInterrupt):
            if self.coordinator:
                shutil.rmtree(staging, ignore_errors=True)
            raise KeyboardInterrupt
        if dist.get_world_size(self.world) == 1:
            return error
        box = [error]
        dist.broadcast_object_list(box, group_src=0, group=self.group)
        return box[0]

    def _failed_if(self, step: int, staging: Path, error: str | None) -> None:
        if error is not None:
            self._failed(step, staging, error)

    def _failed(self, step: int, staging: Path, error: str) -> None:
        """Remove what the failed save left, say so in one line, and stop or go on as the run says."""
        self.failed_saves += 1
        if self.coordinator:
            shutil.rmtree(staging, ignore_errors=True)
        kept = complete_checkpoints(self.save_dir)
        previous = f"{kept[-1][1].name} is intact" if kept else "there is no earlier checkpoint"
        line = f"checkpoint {checkpoint_dir(self.save_dir, step).name} not saved: {error}; {previous}"
        if self.on_save_error == "stop":
            raise UserError(f"{line}; stopping (--on-save-error stop; continue trains on)")
        self.console.print(f"{line}; training goes on (--on-save-error continue)", markup=False, highlight=False)

    def _prune(self) -> None:
        if self.keep_last is not None:
            prune_checkpoints(self.save_dir, self.keep_last)

    def close(self) -> None:
        """Stop without waiting (a failed run: its peers may be gone); an unfinished write stays ``.tmp``."""
        if self._sealer is not None:
            self._sealer.shutdown(wait=False, cancel_futures=True)
        if self._stager is not None and (self._pending is None or self._pending.done.done()):
            self._stager.close()  # its host buffers (a write still running keeps them until it ends)
        self._quiet.__exit__(None, None, None)


def _cause(exc: BaseException) -> str | KeyboardInterrupt:
    """A failed save's one line; an interrupt (which DCP wraps in its own exception) stays an interrupt."""
    cause = library_cause(exc)
    if isinstance(cause, KeyboardInterrupt):
        return KeyboardInterrupt()
    return save_failure(cause)
