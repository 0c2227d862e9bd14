import os

import pytest

# Deterministic, single-threaded-ish CPU math keeps tests fast and repeatable on 2-core CI machines.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    """pyproject's addopts run the suite on two pytest-xdist workers, each taking whole files
    (``--numprocesses 2 --dist loadfile``: a module's shared runs and its Ray cluster stay in one process).
    Where pytest-xdist is not installed (``pip install -e '.[dev]'`` brings it) or is turned off
    (``-p no:xdist``), accept the two options and run every test in this one process."""
    if not pluginmanager.has_plugin("xdist"):
        group = parser.getgroup("xdist", "pytest-xdist is not installed: these options are ignored")
        group.addoption("--numprocesses", dest="numprocesses", default=None)
        group.addoption("--dist", dest="dist", default="no")


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
