"""One call from corpus to batches: ``prepare_data`` reads (or fetches) the corpus, trains (or loads) the
tokenizer, tokenizes (or loads) the token stream and packs it, saying what it does when a phase is slow."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from tokenizers import Tokenizer

from moetrain.data.corpus import corpus_hash, load_corpus
from moetrain.data.packing import PackedDataset, load_or_tokenize
from moetrain.data.size import record_corpus_size
from moetrain.data.tokenizer import load_or_train_tokenizer
from moetrain.errors import UserError


@dataclass(frozen=True)
class PreparedData:
    corpus_name: str
    corpus_hash: str
    num_documents: int
    tokenizer: Tokenizer
    dataset: PackedDataset


def prepare_data(data: str | None, vocab_size: int, seq_len: int, seed: int,
                 console: Console | None = None) -> PreparedData:
    """Everything the trainer needs from the data side, built (or loaded from the cache) in one call. The
    slow first-time phases (download, tokenizer training, tokenizing) say what they do on ``console``."""
    name, documents = load_corpus(data, console)
    tokenizer = load_or_train_tokenizer(documents, vocab_size, console)
    if tokenizer.get_vocab_size() > vocab_size:
        raise UserError(f"tokenizer has {tokenizer.get_vocab_size()} tokens but the model only {vocab_size}")
    stream = load_or_tokenize(documents, tokenizer, console)
    record_corpus_size(data, vocab_size, len(stream.tokens))
    return PreparedData(name, corpus_hash(documents), len(documents), tokenizer,
                        PackedDataset(stream, seq_len, seed))
