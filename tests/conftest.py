import os

import pytest

# Deterministic, single-threaded-ish CPU math keeps tests fast and repeatable on 2-core CI machines.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
    yield


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test, as each gloo rank runs (a busy 2-core machine makes two crawl);
    tests/train and tests/rl use it for every test."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
