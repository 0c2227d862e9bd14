import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread, as each gloo rank runs (a busy 2-core machine makes two crawl)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
