"""The default thread count: the cores this process may use that are not busy, shared among the ranks."""

import pytest

from moetrain import threads
from moetrain.threads import busy_cores, choose_threads


@pytest.fixture(autouse=True)
def no_omp_env(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.mark.parametrize(("cores", "busy", "ranks", "expected", "reason"), [
    (2, 0.0, 1, 2, "2 of 2 cores free"),
    (2, 1.2, 1, 1, "1 of 2 cores free"),  # another job holds more than a core
    (2, 3.5, 1, 1, "1 of 2 cores free"),  # oversubscribed already: one thread, never zero
    (8, 2.0, 4, 1, "6 of 8 cores free, 4 ranks"),
    (16, 0.4, 4, 4, "16 of 16 cores free, 4 ranks"),
    (2, 0.0, 4, 1, "2 of 2 cores free, 4 ranks"),  # ranks sharing cores: one thread each
])
def test_free_cores_are_shared_among_the_ranks(cores, busy, ranks, expected, reason):
    choice = choose_threads(None, ranks, cores=cores, busy=busy)
    assert (choice.threads, choice.reason) == (expected, reason)


def test_asked_threads_win(monkeypatch):
    assert choose_threads(3, 1, cores=2, busy=2.0).threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    choice = choose_threads(None, 1, cores=2, busy=0.0)
    assert (choice.threads, choice.reason) == (5, "OMP_NUM_THREADS=5")


def test_busy_cores_take_the_larger_of_the_sample_and_the_load(monkeypatch):
    samples = iter([(100.0, 400.0), (175.0, 500.0)])  # 75 of 100 jiffies busy: 3 of 4 cores
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    busy_cores.cache_clear()
    try:
        assert busy_cores() == pytest.approx(3.0)
    finally:
        busy_cores.cache_clear()
