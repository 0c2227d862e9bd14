import pytest

from moetrain.rl.stalesync import RolloutWorker


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Every test here in one torch thread (tests/conftest.py)."""


@pytest.fixture
def fault_at_receive(monkeypatch):
    """``plant(version, rank, fault)``: rollout rank ``rank``, receiving weight version ``version``, gets the
    sync fault ``fault(worker)`` (a function of the worker, which may read its buckets)."""
    def plant(version: int, rank: int, fault) -> None:
        original = RolloutWorker.receive

        def receive(self, received: int):
            if received == version and self.rank == rank:
                self.sync.fault = fault(self)
            return original(self, received)

        monkeypatch.setattr(RolloutWorker, "receive", receive)

    return plant

