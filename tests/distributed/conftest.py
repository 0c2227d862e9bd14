import pytest
from _parity import write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory):
    """The parity tests' small corpus, with a private data cache (inherited by the ranks ``spawn`` forks)."""
    root = tmp_path_factory.mktemp("corpus")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOETRAIN_CACHE", str(root / "cache"))
        yield write_corpus(root)
