import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Every test here in one torch thread (tests/conftest.py)."""
