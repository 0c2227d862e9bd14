"""Attention over packed documents, as the runtime computes it.

The runtime packs documents back to back into rows of ``seq_len`` tokens (``moetrain.data.packing``), and
attention must not cross them. A row that lies inside one document is plain causal attention. The core
attention runs the fused causal kernel over every row of a micro-batch, and then the rows that hold a
boundary again under the document mask, their outputs replacing the causal ones (``moetrain.models.attention``).
The mask reaches that kernel one of two ways:

- ``block``: FlexAttention tiles of ``TILE`` × ``TILE`` (compiled CUDA layers): the kernel computes every
  tile that holds a causal same-document pair, each in full, and skips the others;
- ``dense``: a boolean [S, S] mask handed to SDPA: the fused kernels compute every tile of the square.

So the core attention of a micro-batch costs the causal kernel's time × a factor:

    1 + p · f_kernel · w

with p the share of rows that hold a boundary, w the tiles the masked kernel computes for such a row over the
causal kernel's (block: its kept tiles; dense: the square, 2n/(n + 1) for n tiles a side), and f_kernel its
time per tile over the causal kernel's (``Efficiency.attention_block_slowdown`` and
``attention_dense_slowdown``, which ``moetrain profile`` measures on a GPU at the model's head dims).

Documents are modelled as all of the mean length, laid back to back, each row at a uniformly random offset
(the data loader's rows are windows of the stream at a seeded random order): a row of S tokens holds a
boundary with probability min(1, (S − 1)/L) for documents of L tokens. Numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

TILE = 128
"""FlexAttention's block, as ``models.attention.document_block_mask`` builds it."""
OFFSETS = 32
"""Row offsets within a document averaged over for the kept tiles."""

DocumentMask = Literal["block", "dense"]


@dataclass(frozen=True)
class DocumentPacking:
    """Sequences packed from documents of ``mean_tokens`` tokens (EOS included), their mask handed to the
    kernel as ``mask``."""

    mean_tokens: float
    mask: DocumentMask = "block"


def row_boundary_share(seq_len: int, mean_tokens: float) -> float:
    """Share of rows of ``seq_len`` tokens that hold a document boundary (module docstring)."""
    return float(min(1.0, (seq_len - 1) / mean_tokens))


@lru_cache(maxsize=64)
def dropped_tile_share(seq_len: int, mean_tokens: float) -> float:
    """Of a boundary-holding row's causal tiles, the share the block mask skips (no causal same-document
    pair), averaged over ``OFFSETS`` offsets of the row in its documents among those that put a boundary in
    it. An off-diagonal tile (query tile i after key tile j) holds such a pair when the document of its first
    query is no later than the document of its last key (documents only grow along the row); a diagonal
    tile always does."""
    n = -(-seq_len // TILE)
    start = np.arange(n) * TILE
    end = np.minimum(start + TILE, seq_len) - 1
    q_tile, k_tile = np.tril_indices(n)
    causal = q_tile.size
    doc_len = max(float(mean_tokens), 1.0)
    shares = []
    # a row starting at offset o of a document holds a boundary when o > L − S (every o when L < S)
    lowest = max(0.0, doc_len - (seq_len - 1))
    for offset in lowest + (np.arange(OFFSETS) + 0.5) / OFFSETS * (doc_len - lowest):
        first_query_doc = np.floor((offset + start) / doc_len)
        last_key_doc = np.floor((offset + end) / doc_len)
        if last_key_doc[-1] == first_query_doc[0]:
            continue  # the row lies inside one document: no mask
        kept = (q_tile == k_tile) | (first_query_doc[q_tile] <= last_key_doc[k_tile])
        shares.append(1.0 - kept.sum() / causal)
    return float(np.mean(shares)) if shares else 0.0


def core_time_factor(seq_len: int, packing: DocumentPacking | None, block_slowdown: float, dense_slowdown: float):
    """The core attention's time over the causal kernel's, per micro-batch: 1 without documents (module
    docstring)."""
    if packing is None:
        return 1.0
    p = row_boundary_share(seq_len, packing.mean_tokens)
    if packing.mask == "dense":
        n = -(-seq_len // TILE)
        return 1.0 + p * dense_slowdown * 2.0 * n / (n + 1)
    return 1.0 + p * block_slowdown * (1.0 - dropped_tile_share(seq_len, float(packing.mean_tokens)))
