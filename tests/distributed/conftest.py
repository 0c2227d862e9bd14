from pathlib import Path

import pytest
from _parity import ReferenceRuns, write_corpus


@pytest.fixture(scope="session")
def _session_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One corpus for the session: its data cache is built once, by the first module that trains on it."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def corpus(_session_corpus: Path):
    """The parity tests' small corpus, with the session's data cache beside it (inherited by the ranks
    ``spawn`` forks). The cache variable is set for the module only: tests elsewhere keep their own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOETRAIN_CACHE", str(_session_corpus.parent / "cache"))
        yield _session_corpus


@pytest.fixture(scope="session")
def _session_references() -> ReferenceRuns:
    return ReferenceRuns()


@pytest.fixture(scope="module")
def references(corpus: Path, _session_references: ReferenceRuns) -> ReferenceRuns:
    """Single-process reference runs on ``corpus``, each training config run once per session."""
    _session_references.data = corpus
    return _session_references
