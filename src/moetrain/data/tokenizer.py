"""A byte-level BPE tokenizer trained on the corpus with HF ``tokenizers`` and cached.

Byte-level (GPT-2 style) so that any text round-trips with no unknown token. The cache key is the
corpus hash and the vocabulary size, so a new corpus or model preset trains its own tokenizer and
a rerun loads it in milliseconds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moetrain.data.corpus import Document, cache_dir, corpus_hash
from moetrain.status import phase

if TYPE_CHECKING:
    from rich.console import Console

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(documents: list[Document], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens (EOS included) on ``documents``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((doc.text for doc in documents), trainer=trainer, length=len(documents))
    return tokenizer


def load_or_train_tokenizer(documents: list[Document], vocab_size: int, console: Console | None = None) -> Tokenizer:
    """The cached tokenizer for (corpus, vocab_size), trained and saved on first use (saying so on ``console``)."""
    path = cache_dir() / "tokenizers" / f"bpe-{corpus_hash(documents)}-v{vocab_size}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    docs = f"{len(documents):,} document{'s' * (len(documents) != 1)}"
    with phase(console, f"training a {vocab_size:,}-token BPE tokenizer on {docs}, once (cached)",
               "trained the tokenizer"):
        tokenizer = train_tokenizer(documents, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tokenizer.save(str(tmp))
    Path(tmp).replace(path)  # atomic: a reader sees the old file or the whole new one
    return tokenizer


def eos_id(tokenizer: Tokenizer) -> int:
    token_id = tokenizer.token_to_id(EOS_TOKEN)
    assert token_id is not None, "tokenizer was trained without the EOS special token"
    return token_id
