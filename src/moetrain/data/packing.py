"""Pack documents into fixed-length training sequences, keeping document boundaries, and build the
micro-batches of each optimizer step for any data-parallel layout.

Packing: every document is tokenized and followed by one EOS token; the documents are concatenated
into one stream. Sample ``i`` is the window ``stream[i·L : i·L + L + 1]`` (L = seq_len): inputs are
its first L tokens, labels the next L. ``document_ids`` give each input token's document (restarting
at 0 in each sample) so that attention is masked across documents and rotary positions restart.
Label choice: the last token of a document predicts its EOS (the model learns to end a document);
the EOS itself would have to predict the first token of an unrelated document, which it cannot see
through the mask, so its label is -100 (ignored).

Batches: step ``s`` uses global positions ``s·B … s·B + B − 1`` (B = global batch) of an endless
sample order made of one seeded permutation per epoch. The order is a pure function of (seed, step),
so resuming at step s needs no sampler state and replays the uninterrupted run exactly. Data-parallel
rank r of D takes the r-th contiguous slice of the global batch and splits it into micro-batches.
Every rank gets the global label-token count, so the loss can be normalised by it without an
all-reduce and every layout trains on the same math.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tokenizers import Tokenizer

from moetrain.data.corpus import Document, cache_dir, corpus_hash
from moetrain.data.tokenizer import eos_id
from moetrain.errors import UserError
from moetrain.status import phase

if TYPE_CHECKING:
    from rich.console import Console

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenStream:
    """All documents as one token stream; ``document_index[t]`` is the document of token t."""

    tokens: np.ndarray
    document_index: np.ndarray

    @property
    def mean_document_tokens(self) -> float:
        """Mean length of the documents in tokens, EOS included (``moetrain simulate --document-tokens``)."""
        return len(self.tokens) / (int(self.document_index[-1]) + 1)


def tokenize_documents(documents: list[Document], tokenizer: Tokenizer) -> TokenStream:
    eos = eos_id(tokenizer)
    encoded = tokenizer.encode_batch([doc.text for doc in documents])
    pieces = [np.append(np.asarray(e.ids, dtype=np.int32), np.int32(eos)) for e in encoded]
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    tokens = np.concatenate(pieces)
    document_index = np.repeat(np.arange(len(pieces), dtype=np.int32), lengths)
    return TokenStream(tokens, document_index)


def load_or_tokenize(documents: list[Document], tokenizer: Tokenizer, console: Console | None = None) -> TokenStream:
    """The token stream of ``documents``, cached by corpus and tokenizer hash (tokenizing says so on ``console``)."""
    tokenizer_hash = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]
    path = cache_dir() / "tokens" / f"{corpus_hash(documents)}-{tokenizer_hash}.npz"
    if path.is_file():
        with np.load(path) as arrays:
            return TokenStream(arrays["tokens"], arrays["document_index"])
    docs = f"{len(documents):,} document{'s' * (len(documents) != 1)}"
    with phase(console, f"tokenizing {docs}, once (cached)", "tokenized the corpus"):
        stream = tokenize_documents(documents, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, tokens=stream.tokens, document_index=stream.document_index)
    tmp.replace(path)
    return stream


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on the host. Shapes: [micro_batch, seq_len]."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor | None
    """Document of each token (attention is masked across documents); None: one document per row."""
    num_label_tokens: int
    """Labels that are not IGNORE_INDEX in this micro-batch."""
    objective: Any = None
    """A per-token objective replacing next-token cross-entropy (``distributed.pipeline.TokenObjective``; RL)."""
    expert_ids: torch.Tensor | None = None
    """Router replay record [micro_batch, seq_len, M, K] (RL), or None."""


@dataclass(frozen=True)
class StepBatch:
    """What one data-parallel rank trains on in one optimizer step."""

    micro_batches: list[MicroBatch]
    global_label_tokens: int
    """Label tokens of the whole global batch (all ranks): the loss denominator."""
    global_tokens: int
    """Input tokens of the whole global batch (for tokens/s and MFU)."""

    @property
    def masked(self) -> bool:
        """Whether a micro-batch holds a document boundary, so that its attention runs under the mask."""
        return any(mb.document_ids is not None for mb in self.micro_batches)


def boundary_rows(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """The rows that hold a document boundary, as int64 indices: a row's ids restart at 0, so a row of all 0
    lies inside one document. On the host's ids, so that the device never waits for the count."""
    return (document_ids_BS != 0).any(dim=1).nonzero().flatten()


class PackedDataset:
    """Fixed-length samples over a token stream, in a seeded order that is a function of the step."""

    def __init__(self, stream: TokenStream, seq_len: int, seed: int) -> None:
        self.stream = stream
        self.seq_len = seq_len
        self.seed = seed
        self.num_samples = (len(stream.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise UserError(
                f"the corpus has {len(stream.tokens)} tokens, fewer than one sequence of --seq-len {seq_len} + 1; "
                "add text or lower --seq-len"
            )

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids, labels, document_ids) of sample ``index``, each [seq_len]."""
        start = index * self.seq_len
        window = slice(start, start + self.seq_len + 1)
        tokens = self.stream.tokens[window].astype(np.int64)
        documents = self.stream.document_index[window].astype(np.int64)
        labels = np.where(documents[1:] == documents[:-1], tokens[1:], IGNORE_INDEX)
        return tokens[:-1], labels, documents[:-1] - documents[0]

    @lru_cache(maxsize=4)  # noqa: B019 - a handful of epochs, and the dataset lives for the whole run
    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def global_batch_indices(self, step: int, global_batch: int) -> list[int]:
        """Sample indices of optimizer step ``step`` (0-based), in global-batch order."""
        positions = range(step * global_batch, (step + 1) * global_batch)
        return [int(self._epoch_order(p // self.num_samples)[p % self.num_samples]) for p in positions]

    def step_batch(
        self, step: int, global_batch: int, micro_batch: int, dp_rank: int = 0, dp_size: int = 1
    ) -> StepBatch:
        """The micro-batches rank ``dp_rank`` of ``dp_size`` trains on at step ``step``."""
        if global_batch % (dp_size * micro_batch):
            raise UserError(
                f"global batch {global_batch} does not split into {dp_size} data-parallel ranks × "
                f"micro-batches of {micro_batch}; make it a multiple of {dp_size * micro_batch}"
            )
        if global_batch > self.num_samples:
            # moetrain.train.checks.check_corpus refuses this before the run whenever it knows the corpus's
            # size; a corpus tokenized for the first time is counted here, before the first step's batch
            raise UserError(f"--global-batch {global_batch} but the corpus has {self.num_samples:,} sequences of "
                            f"{self.seq_len} tokens; lower --global-batch to at most {self.num_samples:,}, or add "
                            "text (--data)")
        samples = [self.sample(i) for i in self.global_batch_indices(step, global_batch)]
        inputs, labels, documents = (torch.from_numpy(np.stack(part)) for part in zip(*samples))
        # A row inside one document needs no document mask: it is plain causal attention at positions
        # 0..S-1 (``moetrain.models.attention``), so a micro-batch of such rows carries no documents.
        global_label_tokens = int((labels != IGNORE_INDEX).sum())
        per_rank = global_batch // dp_size
        micro_batches = []
        for start in range(dp_rank * per_rank, (dp_rank + 1) * per_rank, micro_batch):
            rows = slice(start, start + micro_batch)
            micro_labels = labels[rows]
            micro_batches.append(MicroBatch(
                input_ids=inputs[rows],
                labels=micro_labels,
                document_ids=documents[rows] if boundary_rows(documents[rows]).numel() else None,
                num_label_tokens=int((micro_labels != IGNORE_INDEX).sum()),
            ))
        return StepBatch(micro_batches, global_label_tokens, global_tokens=global_batch * self.seq_len)
