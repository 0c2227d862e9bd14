import os

import pytest

# Deterministic, single-threaded-ish CPU math keeps tests fast and repeatable on 2-core CI machines.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
    yield
