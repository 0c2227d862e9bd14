"""StaleSync's admission rule and its metrics: one gate, used by both placements (``stalesync``,
``colocated``).

The trainer, at weight version v, trains on a batch only if it is at most k versions old:

    v − min(versions of its samples) ≤ k

A sample's version is the oldest weight version that generated any of its tokens. Today one version
generates a whole batch, so every sample carries the batch's; with partial rollouts (a generation
interrupted at a weight update and resumed under the new weights) a sample's tokens span versions, and
taking the oldest is what keeps the bound true of every token trained on. A batch is admitted or dropped
whole: one sample too old drops it.

A dropped batch is counted (batches and samples) and never trained on; the caller takes the next one.
The gate keeps the counts and, over admitted samples, a histogram of their staleness (0 … k); the step's
metrics row takes ``AdmissionStats.row`` (the fields every StaleSync row has carried: ``staleness_mean``,
``staleness_max`` of the batch trained on, ``dropped_batches``, ``dropped_samples`` so far).

Torch-free, so the rule can be tested (and reused by a controller) without a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BatchStaleness:
    """An admitted batch's staleness over its samples (current version − sample version)."""

    num_samples: int
    mean: float
    max: int
    """That of its oldest sample: the one the rule judged."""


@dataclass(frozen=True)
class AdmissionStats:
    """What the gate has admitted and dropped so far."""

    staleness_bound: int
    """k: the oldest admitted sample is at most this many versions behind."""
    admitted_batches: int
    admitted_samples: int
    dropped_batches: int
    dropped_samples: int
    staleness_counts: tuple[int, ...]
    """Admitted samples by staleness: entry s counts those s versions old (s = 0 … k, so k + 1 entries)."""
    last: BatchStaleness | None
    """The latest admitted batch: the one the step trains on (None before the first)."""

    @property
    def run_staleness_mean(self) -> float:
        """Mean staleness of every admitted sample (0 before any)."""
        total = sum(self.staleness_counts)
        return sum(s * n for s, n in enumerate(self.staleness_counts)) / total if total else 0.0

    @property
    def run_staleness_max(self) -> int:
        """The largest staleness of any admitted sample (0 before any)."""
        return max((s for s, n in enumerate(self.staleness_counts) if n), default=0)

    def row(self) -> dict[str, Any]:
        """The step's metrics-row fields (names kept from before the gate existed: docs, benchmarks and
        tests read them): the trained batch's staleness and the run's drops so far."""
        assert self.last is not None, "a metrics row before any batch was admitted"
        return {"staleness_mean": self.last.mean, "staleness_max": self.last.max,
                "dropped_batches": self.dropped_batches, "dropped_samples": self.dropped_samples}


class StalenessGate:
    """Admits a batch when its oldest sample is at most k weight versions behind the trainer."""

    def __init__(self, staleness_bound: int) -> None:
        if staleness_bound < 0:
            raise ValueError(f"the staleness bound k must be ≥ 0, not {staleness_bound}")
        self.k = staleness_bound
        self._counts = [0] * (staleness_bound + 1)
        self._admitted_batches = self._dropped_batches = self._dropped_samples = 0
        self._last: BatchStaleness | None = None

    def admit(self, current_version: int, sample_versions: Sequence[int]) -> bool:
        """Whether the trainer at ``current_version`` may train on the batch whose samples have these
        versions (each sample's oldest token's); the batch is counted as admitted or dropped either way."""
        assert sample_versions, "a batch without samples"
        staleness = [current_version - v for v in sample_versions]
        # a version the trainer has not reached yet means a mislabelled batch, not an old one
        assert min(staleness) >= 0, f"version {max(sample_versions)} is ahead of the trainer's {current_version}"
        oldest = current_version - min(sample_versions)  # the oldest sample decides for the batch
        if oldest > self.k:
            self._dropped_batches += 1
            self._dropped_samples += len(staleness)
            return False
        for s in staleness:
            self._counts[s] += 1
        self._admitted_batches += 1
        self._last = BatchStaleness(len(staleness), sum(staleness) / len(staleness), oldest)
        return True

    def stats(self) -> AdmissionStats:
        return AdmissionStats(self.k, self._admitted_batches, sum(self._counts), self._dropped_batches,
                              self._dropped_samples, tuple(self._counts), self._last)
