"""StaleSync's schedule: which weight version generates each batch of a run, and which versions the
trainer therefore pushes to the rollout replicas.

Torch-free arithmetic on the step numbers; the colocated and the disaggregated placements share it, so
the two generate the same batches with the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.run import RunSpec


@dataclass(frozen=True)
class Schedule:
    """Which weight version generates each batch ``start .. last − 1`` of a run: at most ``staleness``
    versions old, and never older than the step the run started from or the newest checkpoint step at
    or before the batch. Checkpoints are synchronisation points (the batch after one is generated with
    the saved weights), so a run resumed from one generates exactly what the uninterrupted run did."""

    staleness: int
    last: int
    """The run ends after this step (``--steps``, or ``--stop-at``)."""
    start: int = 0
    """The step the run starts at (after a resume: the checkpoint's)."""
    save_every: int = 0
    """Checkpoint steps inside the run (0: none, or no save dir)."""
    partial: bool = False
    """Partial rollouts: a batch may finish on the weights its successor starts with (``resume_version``)."""

    @classmethod
    def of_run(cls, staleness: int, spec: RunSpec, start: int, partial: bool = False) -> Schedule:
        run = spec.run
        last = min(spec.training.steps, run.stop_at or spec.training.steps)
        return cls(staleness, last, start, run.save_every if run.save_dir is not None else 0, partial)

    def version(self, batch: int) -> int:
        checkpoint = batch // self.save_every * self.save_every if self.save_every else 0
        return max(self.start, checkpoint, batch - self.staleness)

    def resume_version(self, batch: int) -> int | None:
        """With partial rollouts: the version batch ``batch`` is resumed on after its interruption, the one
        its successor starts with, when that is newer and the trainer has made it before it needs this
        batch (version ≤ batch: never at k = 0, so k = 0 stays the synchronous loop); else None."""
        if not self.partial:
            return None
        newer = self.version(batch + 1)
        return newer if self.version(batch) < newer <= batch else None

    def pushed(self) -> list[int]:
        """The versions the trainer pushes after the starting one: those some batch is generated with."""
        used = {self.version(b) for b in range(self.start, self.last)}
        used |= {v for b in range(self.start, self.last) if (v := self.resume_version(b)) is not None}
        return sorted(used - {self.start})
