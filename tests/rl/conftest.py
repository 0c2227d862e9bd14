import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: a busy 2-core machine makes two crawl (as in tests/train)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
