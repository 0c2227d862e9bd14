"""StaleSync's admission gate (``moetrain.rl.admission``): the bound at its boundary (k admitted, k + 1
dropped and counted), a batch judged by its oldest sample, counts and histogram by hand; and in real runs
of both placements at k = 2, the gate drops a batch exactly k + 1 old and admits none older than k."""

import dataclasses

import pytest
from test_rl_colocated import _colocated, _steps
from test_rl_stalesync import _stalesync

from moetrain.rl.admission import AdmissionStats, BatchStaleness, StalenessGate
from moetrain.rl.colocated import ColocatedStaleSync

SAMPLES = 16
"""Samples per batch of the runs below (4 prompts × group of 4)."""


@pytest.mark.parametrize("k", [0, 2])
def test_a_batch_exactly_k_old_is_admitted_and_one_k_plus_1_old_is_dropped_and_counted(k):
    gate = StalenessGate(k)
    current = 5
    assert gate.admit(current, [current - k] * 3)
    assert not gate.admit(current, [current - (k + 1)] * 4)
    stats = gate.stats()
    assert (stats.admitted_batches, stats.admitted_samples) == (1, 3)
    assert (stats.dropped_batches, stats.dropped_samples) == (1, 4)
    assert stats.last == BatchStaleness(3, float(k), k)  # the drop did not replace the trained batch
    assert stats.staleness_counts == (0,) * k + (3,)


def test_a_batch_is_judged_by_its_oldest_sample():
    gate = StalenessGate(2)
    # oldest k + 1 behind, newest current: one sample too old drops the batch
    assert not gate.admit(5, [5, 5, 2])
    assert gate.admit(5, [5, 4, 3])
    stats = gate.stats()
    assert (stats.dropped_batches, stats.dropped_samples) == (1, 3)
    assert stats.last == BatchStaleness(num_samples=3, mean=1.0, max=2)
    assert stats.staleness_counts == (1, 1, 1)


def test_counts_histogram_and_row_by_hand():
    gate = StalenessGate(2)
    offered = [(0, [0, 0]), (1, [0, 0, 1]), (3, [0, 0]), (3, [1, 2]), (4, [1])]
    verdicts = [gate.admit(current, versions) for current, versions in offered]
    assert verdicts == [True, True, False, True, False]
    stats = gate.stats()
    # admitted staleness: [0, 0], [1, 1, 0], [2, 1]; dropped: 3 and 3 versions old
    assert stats == AdmissionStats(staleness_bound=2, admitted_batches=3, admitted_samples=7, dropped_batches=2,
                                   dropped_samples=3, staleness_counts=(3, 3, 1),
                                   last=BatchStaleness(num_samples=2, mean=1.5, max=2))
    assert stats.run_staleness_mean == pytest.approx(5 / 7) and stats.run_staleness_max == 2
    # the metrics add up: every offered batch and sample is admitted or dropped, once
    assert stats.admitted_batches + stats.dropped_batches == len(offered)
    assert stats.admitted_samples + stats.dropped_samples == sum(len(v) for _, v in offered)
    assert sum(stats.staleness_counts) == stats.admitted_samples
    assert stats.row() == {"staleness_mean": 1.5, "staleness_max": 2, "dropped_batches": 2, "dropped_samples": 3}


def test_what_the_gate_refuses():
    with pytest.raises(ValueError, match="must be ≥ 0, not -1"):
        StalenessGate(-1)
    gate = StalenessGate(1)
    with pytest.raises(AssertionError, match="before any batch"):
        gate.stats().row()
    with pytest.raises(AssertionError, match="ahead of the trainer"):
        gate.admit(2, [3])
    assert gate.stats().run_staleness_mean == 0.0 and gate.stats().run_staleness_max == 0


def _assert_bound(steps: list[dict], stats: AdmissionStats, k: int) -> None:
    """No step trained on a sample older than k, and the rows' counters are the gate's."""
    assert all(r["staleness_max"] <= k for r in steps)
    assert max(s for s, n in enumerate(stats.staleness_counts) if n) <= k
    assert stats.admitted_batches == len(steps) and stats.admitted_samples == SAMPLES * len(steps)
    assert steps[-1]["dropped_batches"] == stats.dropped_batches
    assert steps[-1]["dropped_samples"] == stats.dropped_samples == SAMPLES * stats.dropped_batches


@pytest.mark.dist
def test_disaggregated_at_k2_a_batch_k_plus_1_old_is_dropped_and_none_older_than_k_trained():
    # batch 0 (version 0) sent again after batch 2: it reaches the trainer at version 3 = k + 1
    _, trainer = _stalesync(5, staleness=2, resend_first_after=2)
    assert trainer.trained == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 2)]
    steps = [r for r in trainer.rows if "loss" in r]
    assert [r["staleness_max"] for r in steps] == [0, 1, 2, 2, 2]
    assert trainer.admission.dropped_batches == 1 and trainer.admission.staleness_counts == (16, 16, 48)
    _assert_bound(steps, trainer.admission, k=2)


def _aged(age: int) -> type[ColocatedStaleSync]:
    class Aged(ColocatedStaleSync):
        """Marks the batch generated ahead for step 3 as ``age`` versions old."""

        def rollout(self, trainer, step):
            if step == 3 and self._ready is not None:
                self._ready = dataclasses.replace(self._ready, weight_version=step - age)
            return super().rollout(trainer, step)

    return Aged


@pytest.mark.parametrize("age, dropped", [(2, 0), (3, 1)], ids=["k-old-admitted", "k+1-old-dropped"])
def test_colocated_at_k2_a_batch_k_plus_1_old_is_dropped_and_none_older_than_k_trained(age, dropped):
    trainer, rows, _ = _colocated(4, staleness=2, hooks_cls=_aged(age))
    steps = _steps(rows)
    stats = trainer.gate.stats()
    assert stats.dropped_batches == dropped
    # admitted: step 3 trains on the aged batch (staleness k); dropped: on one generated again, fresh
    assert [r["staleness_max"] for r in steps] == [0, 1, 1, 0 if dropped else 2]
    assert [r["overlapped"] for r in steps] == [False, True, True, not dropped]
    _assert_bound(steps, stats, k=2)
